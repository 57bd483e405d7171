"""LlamaIndex integration of kvrag (distribution ``llama-index-llms-kvrag``)."""

from llama_index.llms.kvrag.base import KVRagLLM
from llama_index.llms.kvrag.hooks import KVCacheWarmer, KVPrecompute, KVWarmingRetriever, node_texts

__all__ = ["KVRagLLM", "KVPrecompute", "KVCacheWarmer", "KVWarmingRetriever", "node_texts"]
