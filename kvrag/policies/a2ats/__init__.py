"""A²ATS: decode-time top-K key selection scored through per-model vector-quantization codebooks.

``policy`` is the reuse policy (registered as ``"a2ats"``), ``codebook`` holds, stores and finds
the codebooks, ``calibrate`` fits them on text (``kvrag calibrate a2ats``)."""

from kvrag.policies.a2ats.policy import A2ATS

__all__ = ["A2ATS"]
