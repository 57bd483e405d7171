"""The frameworks' own conventions, as a newcomer meets them in the first hour: the keywords
their components take, the channels that report token usage, copying and serializing
an LLM object. Tiny random model with SmolLM2's tokenizer (fast)."""

import copy
import pickle
from pathlib import Path

import pytest

from kvrag.engine import KVRag
from kvrag.testing import tiny_llama

TEXTS = [
    "The red fox lives in the northern forest and hunts small rodents at dawn.",
    "Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres.",
]
PROMPT = "Context:\n\n" + "\n\n".join(TEXTS) + "\n\nQuestion: Where does the red fox live?"


@pytest.fixture
def rag(model_dir, tmp_path):
    rag = KVRag(str(model_dir), cache_dir=tmp_path / "kv")
    rag.precompute(TEXTS)
    return rag


# ---- LlamaIndex ----------------------------------------------------------------------------
@pytest.fixture
def li_llm(rag):
    from llama_index.llms.kvrag import KVRagLLM

    llm = KVRagLLM(rag, max_new_tokens=4)
    yield llm
    llm.precomputer.shutdown(cancel_pending=True, timeout=30)


def test_llamaindex_llm_class_conventions(li_llm, rag):
    """What every llama-index-llms-* package tests (tests/test_llms_<name>.py): the class is a
    BaseLLM; plus its metadata, and that the sync, streaming and async paths agree."""
    import asyncio

    from llama_index.core.base.llms.base import BaseLLM
    from llama_index.core.llms import ChatMessage

    from llama_index.llms.kvrag import KVRagLLM

    assert BaseLLM.__name__ in [b.__name__ for b in KVRagLLM.__mro__]
    assert KVRagLLM.class_name() == "KVRagLLM" == li_llm.to_dict()["class_name"]
    md = li_llm.metadata
    assert md.context_window == rag.handle.max_context and md.num_output == li_llm.max_new_tokens
    assert md.is_chat_model and md.model_name.startswith("kvrag:")
    text = li_llm.complete(PROMPT, formatted=True).text
    assert list(li_llm.stream_complete(PROMPT, formatted=True))[-1].text == text
    assert asyncio.run(li_llm.acomplete(PROMPT, formatted=True)).text == text
    chat = [ChatMessage(role="user", content=PROMPT)]
    assert asyncio.run(li_llm.achat(chat)).message.content == li_llm.chat(chat).message.content


def test_llamaindex_hooks_take_llm_keyword(li_llm, rag):
    from llama_index.core import VectorStoreIndex  # noqa: F401  (the components below need core)
    from llama_index.core.retrievers import BaseRetriever

    from llama_index.llms.kvrag import KVCacheWarmer, KVPrecompute, KVWarmingRetriever

    class Nothing(BaseRetriever):
        def _retrieve(self, query_bundle):
            return []

    assert KVPrecompute(llm=li_llm).precomputer is li_llm.precomputer
    assert KVCacheWarmer(llm=li_llm).precomputer is li_llm.precomputer
    assert KVWarmingRetriever(Nothing(), llm=li_llm).precomputer is li_llm.precomputer
    assert KVPrecompute(rag=rag).precomputer is li_llm.precomputer  # the KVRag's shared one
    with pytest.raises(TypeError, match="needs a target.*got none"):
        KVPrecompute()
    with pytest.raises(TypeError, match="got 2: target, llm"):
        KVPrecompute(li_llm, llm=li_llm)


def test_llamaindex_token_counting_handler_sees_the_real_counts(li_llm):
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
    from llama_index.core.llms import ChatMessage

    counter = TokenCountingHandler(tokenizer=lambda s: s.split())  # a wrong tokenizer on purpose
    li_llm.callback_manager = CallbackManager([counter])
    resp = li_llm.complete(PROMPT, formatted=True)
    stats = li_llm.last_stats
    assert stats.cached_tokens > 0
    assert counter.prompt_llm_token_count == stats.prompt_tokens
    assert counter.completion_llm_token_count == stats.new_tokens
    assert resp.raw["usage"]["prompt_tokens_details"]["cached_tokens"] == stats.read_tokens
    li_llm.chat([ChatMessage(role="user", content=PROMPT)])
    assert counter.prompt_llm_token_count > stats.prompt_tokens  # the chat call was counted too
    totals = li_llm.usage_totals
    assert totals["calls"] == 2 and totals["calls_with_hit"] == 2
    assert totals["cached_tokens"] >= 2 * stats.cached_tokens - 2 and 0 < totals["cache_hit_rate"] < 1


def test_llamaindex_llm_serializes_its_model_and_store(li_llm, rag, model_dir):
    from llama_index.llms.kvrag import KVRagLLM

    d = li_llm.to_dict()
    assert d["model"] == str(model_dir) and d["cache_dir"] == str(rag.store.directory)
    again = KVRagLLM.from_dict(d)
    assert again.rag is not rag and again.rag.fingerprint == rag.fingerprint
    assert again.rag.is_cached(TEXTS[0])  # the same store, not an empty default one
    assert again.complete(PROMPT, formatted=True).text == li_llm.complete(PROMPT, formatted=True).text
    again.precomputer.shutdown(cancel_pending=True)


def test_llamaindex_in_memory_model_refuses_from_dict(tmp_path):
    from llama_index.llms.kvrag import KVRagLLM

    llm = KVRagLLM(KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv"), set_tokenizer=False)
    with pytest.raises(ValueError, match="built in memory"):
        KVRagLLM.from_dict(llm.to_dict())


@pytest.mark.parametrize("framework", ["llamaindex", "langchain"])
def test_pickle_refuses_without_breaking_the_live_object(framework, rag):
    llm = _llm(framework, rag)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(llm)
    assert _answer(framework, llm)  # still works


@pytest.mark.parametrize("framework", ["llamaindex", "langchain"])
def test_deepcopy_shares_the_model(framework, rag):
    llm = _llm(framework, rag)
    _answer(framework, llm)
    twin = copy.deepcopy(llm)
    assert twin.rag is llm.rag and twin.max_new_tokens == llm.max_new_tokens
    assert _answer(framework, twin) == _answer(framework, llm)
    assert twin.usage_totals["calls"] == 2 and llm.usage_totals["calls"] == 2  # counted apart after the copy


def _llm(framework, rag):
    if framework == "llamaindex":
        from llama_index.llms.kvrag import KVRagLLM

        return KVRagLLM(rag, max_new_tokens=3, set_tokenizer=False)
    from langchain_kvrag import ChatKVRag

    return ChatKVRag(rag=rag, max_new_tokens=3)


def _answer(framework, llm):
    if framework == "llamaindex":
        return llm.complete(PROMPT, formatted=True).text or "<empty>"
    return llm.invoke(PROMPT).content or "<empty>"


# ---- LangChain -----------------------------------------------------------------------------
@pytest.fixture
def lc_llm(rag):
    from langchain_kvrag import ChatKVRag

    llm = ChatKVRag(rag=rag, max_new_tokens=4)
    yield llm
    llm.precomputer.shutdown(cancel_pending=True, timeout=30)


def test_langchain_hooks_take_llm_keyword(lc_llm):
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.vectorstores import InMemoryVectorStore

    from langchain_kvrag import KVPrecomputeHook, KVWarmingRetriever, precompute_on_add

    store = precompute_on_add(InMemoryVectorStore(DeterministicFakeEmbedding(size=8)), llm=lc_llm)
    store.add_texts(["A third passage about owls."])
    assert lc_llm.precomputer.wait_until_idle(timeout=60)
    assert lc_llm.rag.is_cached("A third passage about owls.")
    assert KVPrecomputeHook(llm=lc_llm).precomputer is lc_llm.precomputer
    r = KVWarmingRetriever(retriever=store.as_retriever(), llm=lc_llm)
    assert isinstance(r, BaseRetriever) and r.precomputer is lc_llm.precomputer
    with pytest.raises(TypeError, match="needs a target"):
        KVWarmingRetriever(retriever=store.as_retriever())


def test_langchain_usage_tokens_and_totals(lc_llm):
    from langchain_core.callbacks import BaseCallbackHandler

    class Tokens(BaseCallbackHandler):
        def __init__(self):
            self.tokens = []

        def on_llm_new_token(self, token, **kwargs):
            self.tokens.append(token)

    cb = Tokens()
    msg = lc_llm.invoke(PROMPT, config={"callbacks": [cb]})
    assert "".join(cb.tokens) == msg.content
    assert msg.usage_metadata["input_token_details"]["cache_read"] == lc_llm.last_stats.read_tokens > 0
    # LangChain's convention: streaming=True routes invoke() through _stream.
    assert type(lc_llm)(rag=lc_llm.rag, streaming=True)._should_stream(async_api=False)
    assert lc_llm.usage_totals["calls"] == 1 and lc_llm.usage_totals["cached_tokens"] > 0


def test_langchain_model_id_tracing_and_serialization(lc_llm, rag, model_dir):
    from langchain_core.load import dumpd, load

    from langchain_kvrag import ChatKVRag

    assert lc_llm.model == str(model_dir) and lc_llm.cache_dir == str(rag.store.directory)
    ls = lc_llm._get_ls_params()
    assert ls["ls_provider"] == "kvrag" and ls["ls_model_name"] == Path(model_dir).name
    assert ChatKVRag.is_lc_serializable()
    d = dumpd(lc_llm)
    assert d["kwargs"]["model"] == str(model_dir) and "rag" not in d["kwargs"]
    again = load(d, valid_namespaces=["langchain_kvrag"], allowed_objects=[ChatKVRag])
    assert isinstance(again, ChatKVRag) and again.rag is not rag and again.rag.is_cached(TEXTS[0])
    assert again.invoke(PROMPT).content == lc_llm.invoke(PROMPT).content
    # Rebuilt by LangChain from its fields (with_config / configurable_fields): the same KVRag.
    assert ChatKVRag(**{**dict(lc_llm), "max_new_tokens": 2}).rag is rag


def test_langchain_in_memory_model_refuses_load(tmp_path):
    from langchain_core.load import dumpd, load

    from langchain_kvrag import ChatKVRag

    llm = ChatKVRag(rag=KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv"))
    d = dumpd(llm)
    assert d["kwargs"]["model"] is None and d["kwargs"]["fingerprint"] == llm.rag.fingerprint
    with pytest.raises(ValueError, match="serialized from a model built in memory"):
        load(d, valid_namespaces=["langchain_kvrag"], allowed_objects=[ChatKVRag])
