"""LlamaIndex integration of kvrag (distribution ``llama-index-llms-kvrag``)."""

from llama_index.llms.kvrag.base import (
    KVCacheWarmer,
    KVPrecompute,
    KVRagLLM,
    KVWarmingRetriever,
    node_texts,
)

__all__ = ["KVRagLLM", "KVPrecompute", "KVCacheWarmer", "KVWarmingRetriever", "node_texts"]
