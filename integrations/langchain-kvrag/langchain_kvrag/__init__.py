"""LangChain integration of kvrag (distribution ``langchain-kvrag``)."""

from langchain_kvrag.chat_models import ChatKVRag, to_kvrag_messages
from langchain_kvrag.hooks import KVPrecomputeHook, KVWarmingRetriever, precompute_on_add

__all__ = ["ChatKVRag", "KVPrecomputeHook", "KVWarmingRetriever", "precompute_on_add", "to_kvrag_messages"]
