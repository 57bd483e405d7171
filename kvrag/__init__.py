"""kvrag: precomputed per-chunk KV caches, fused at query time, to cut RAG time-to-first-token."""

__version__ = "0.1.0"
