"""LangChain integration end to end: real Chroma (langchain-chroma over a PersistentClient),
langchain-huggingface embeddings (all-MiniLM-L6-v2), LCEL chains; the chat model runs a tiny
random-weight model with SmolLM2's tokenizer (fast), and, in the ``real`` test,
SmolLM2-135M-Instruct itself."""

import asyncio
import logging
import time

import chromadb
import pytest
from chromadb.config import Settings as ChromaSettings  # noqa: E402
from helpers.corpus import hf_greedy  # noqa: E402
from helpers.streams import cancel_mid_step  # noqa: E402
from langchain_chroma import Chroma  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import ConfigurableField, RunnablePassthrough  # noqa: E402

from kvrag.engine import KVRag  # noqa: E402
from kvrag.errors import ChunkError  # noqa: E402
from langchain_kvrag import (  # noqa: E402
    ChatKVRag,
    KVPrecomputeHook,
    KVWarmingRetriever,
    precompute_on_add,
    to_kvrag_messages,
)

TEXTS = [
    "The red fox lives in the northern forest and hunts small rodents at dawn.",
    "Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres.",
    "The river Lenne flows from the Varn Mountains to the eastern sea.",
    "Queen Ilsa founded the harbour town of Brisk in the year 1204.",
]
QUESTION = "Where does the red fox live?"
PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using the context. Reply with a short answer only."),
        ("human", "Context:\n\n{context}\n\nQuestion: {question}"),
    ]
)


def format_docs(docs):
    return "\n\n".join(d.page_content for d in docs)


def rag_chain(retriever, llm):
    """The user's LCEL chain; only ``llm`` (and the ingestion hook) differ from the plain one."""
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm


def chroma(tmp_path, embed, name="docs"):
    client = chromadb.PersistentClient(
        path=str(tmp_path / "chroma"), settings=ChromaSettings(anonymized_telemetry=False)
    )
    return Chroma(client=client, collection_name=name, embedding_function=embed)


def test_add_documents_hook_then_lcel_chain_hits(tmp_path, embed, llm):
    store = precompute_on_add(chroma(tmp_path, embed), llm)
    assert isinstance(store, Chroma)
    store.add_documents([Document(page_content=t, metadata={"i": i}) for i, t in enumerate(TEXTS)])
    assert llm.precomputer.wait_until_idle(timeout=120)
    assert llm.precomputer.progress().computed == 4
    chain = rag_chain(store.as_retriever(search_kwargs={"k": 2}), llm)
    msg = chain.invoke(QUESTION)
    u = msg.usage_metadata
    assert llm.last_stats.chunks_hit == 2
    assert u["input_token_details"]["cache_read"] == llm.last_stats.read_tokens > llm.last_stats.cached_tokens > 0
    assert u["input_token_details"]["recomputed"] == llm.last_stats.recomputed_tokens
    assert u["input_tokens"] == llm.last_stats.prompt_tokens and u["output_tokens"] == 6
    assert msg.response_metadata["ttft_s"] > 0 and msg.response_metadata["finish_reason"] == "length"
    # Streaming: the chunks add up to the same message, the last one carries the usage.
    chunks = list(chain.stream(QUESTION))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.content == msg.content and total.usage_metadata == u
    assert (chain | StrOutputParser()).invoke(QUESTION) == msg.content

    async def run():
        a = await chain.ainvoke(QUESTION)
        parts = [c.content async for c in chain.astream(QUESTION)]
        return a, parts

    a, parts = asyncio.run(run())
    assert a.content == msg.content and "".join(parts) == msg.content
    assert llm.precomputer.progress().computed == 4  # queries never add work


def test_full_prefill_through_the_chain_equals_plain_generate(tmp_path, embed, llm, handle):
    store = precompute_on_add(chroma(tmp_path, embed), llm)
    store.add_texts(TEXTS)
    assert llm.precomputer.wait_until_idle(timeout=120)
    plain = ChatKVRag(rag=llm.rag, policy="full_prefill", max_new_tokens=10)
    msg = rag_chain(store.as_retriever(search_kwargs={"k": 3}), plain).invoke(QUESTION)
    gen = plain.last_generation
    assert gen.stats.cached_tokens == 0 and msg.usage_metadata["input_token_details"]["cache_read"] == 0
    assert gen.token_ids == hf_greedy(handle.model, gen.prompt_ids, len(gen.token_ids))
    rag_chain(store.as_retriever(search_kwargs={"k": 3}), llm).invoke(QUESTION)
    assert llm.last_stats.chunks_hit == 3 and llm.last_generation.prompt_ids == gen.prompt_ids


def test_not_yet_precomputed_document_falls_back(tmp_path, embed, llm):
    store = precompute_on_add(chroma(tmp_path, embed), llm)
    store.add_texts(TEXTS)
    assert llm.precomputer.wait_until_idle(timeout=120)
    late = "The blue heron nests in the reeds along the Lenne delta."
    q = "Where does the blue heron nest?"
    with llm.precomputer.foreground():  # its precompute is still queued
        store.add_texts([late])
        assert llm.precomputer.progress().queued == 1
        ret = store.as_retriever(search_kwargs={"k": 2})
        assert late in [d.page_content for d in ret.invoke(q)]
        blend = ChatKVRag(rag=llm.rag, policy="cacheblend", policy_params={"recompute_ratio": 1.0}, max_new_tokens=8)
        full = ChatKVRag(rag=llm.rag, policy="full_prefill", max_new_tokens=8)
        a = rag_chain(ret, blend).invoke(q)
        b = rag_chain(ret, full).invoke(q)
        assert blend.last_stats.chunks_hit == 1  # the other retrieved chunk came from the cache
        assert a.content == b.content and blend.last_generation.token_ids == full.last_generation.token_ids
    assert llm.precomputer.wait_until_idle(timeout=60) and llm.rag.is_cached(late)


def test_retriever_wrapper_warms_a_legacy_collection(tmp_path, embed, llm):
    store = chroma(tmp_path, embed)
    store.add_texts(TEXTS)  # ingested before kvrag was installed: no hook
    events = []
    rag = llm.rag
    real_stream, real_precompute = rag.stream, rag.precompute

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.monotonic()
            try:
                return fn(*a, **k)
            finally:
                events.append((name, t0, time.monotonic()))

        return wrapper

    def timed_stream(*a, **k):  # a query: from the call until its generation is collected
        t0 = time.monotonic()
        s = real_stream(*a, **k)
        collect = s.generation

        def generation():
            events.append(("query", t0, time.monotonic()))
            return collect()

        s.generation = generation
        return s

    rag.stream = timed_stream
    rag.precompute = timed("precompute", real_precompute)
    chain = rag_chain(KVWarmingRetriever(store.as_retriever(search_kwargs={"k": 2}), llm), llm)
    chain.invoke(QUESTION)
    assert llm.last_stats.chunks_hit == 0
    assert llm.precomputer.wait_until_idle(timeout=120)
    (q,) = [e for e in events if e[0] == "query"]
    assert all(p[1] >= q[2] for p in events if p[0] == "precompute")  # the query was not delayed
    assert llm.precomputer.progress().computed == 2
    chain.invoke(QUESTION)
    assert llm.last_stats.chunks_hit == 2
    asyncio.run(chain.ainvoke("How tall is Mount Kelvar?"))
    assert llm.precomputer.wait_until_idle(timeout=120)
    asyncio.run(chain.ainvoke("How tall is Mount Kelvar?"))
    assert llm.last_stats.chunks_hit == 2


def test_async_update_and_detach(tmp_path, embed, llm):
    store = precompute_on_add(chroma(tmp_path, embed), llm)
    asyncio.run(store.aadd_documents([Document(page_content=TEXTS[0], id="a", metadata={"v": 1})]))
    store.update_documents(["a"], [Document(page_content=TEXTS[1], metadata={"v": 2})])
    assert llm.precomputer.wait_until_idle(timeout=120)
    assert llm.rag.is_cached(TEXTS[0]) and llm.rag.is_cached(TEXTS[1])
    KVPrecomputeHook.detach(store)
    store.add_texts([TEXTS[2]])
    assert llm.precomputer.wait_until_idle(timeout=60) and not llm.rag.is_cached(TEXTS[2])
    assert llm.precomputer.progress().submitted == 2


def test_in_memory_store_add_documents_schedules_each_text_once(embed, llm):
    """LangChain's InMemoryVectorStore has its own add_documents / aadd_documents (not going
    through add_texts) and its add_texts calls add_documents: every path schedules, once."""
    from langchain_core.vectorstores import InMemoryVectorStore

    store = precompute_on_add(InMemoryVectorStore(embed), llm)
    store.add_documents([Document(page_content=TEXTS[0])])
    asyncio.run(store.aadd_documents([Document(page_content=TEXTS[1])]))
    store.add_texts(iter([TEXTS[2]]))  # a one-shot iterable reaches the store whole
    asyncio.run(store.aadd_texts([TEXTS[3]]))
    assert llm.precomputer.wait_until_idle(timeout=120)
    assert all(llm.rag.is_cached(t) for t in TEXTS)
    assert llm.precomputer.progress().submitted == 4
    assert sorted(d.page_content for d in store.similarity_search(QUESTION, k=4)) == sorted(TEXTS)


def test_chains_that_strip_or_cut_documents_still_hit(embed, llm):
    """Loaders leave whitespace around page_content; a chain that strips it, or cuts long
    documents to a budget, no longer holds the stored text whole. The chunks are still served,
    for the tokens the prompt shares with them (counted in ``chunks_partial``)."""
    from langchain_core.vectorstores import InMemoryVectorStore

    store = precompute_on_add(InMemoryVectorStore(embed), llm)
    store.add_documents([Document(page_content=f"\n\n{t}\n  \n") for t in TEXTS])
    assert llm.precomputer.wait_until_idle(timeout=120)
    retriever = store.as_retriever(search_kwargs={"k": 3})
    for fmt in (
        lambda docs: "\n\n".join(d.page_content.strip() for d in docs),
        lambda docs: "\n\n".join(d.page_content.strip()[:64] for d in docs),
    ):
        chain = {"context": retriever | fmt, "question": RunnablePassthrough()} | PROMPT | llm
        msg = chain.invoke(QUESTION)
        s = msg.response_metadata["kvrag_stats"]
        assert s["chunks_hit"] == 3 and s["chunks_partial"] == 3 and s["chunks_unaligned"] == 0
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0


def test_stop_given_as_one_string_is_one_stop_string(llm):
    """``stop="ab"`` is the string "ab", not the letters "a" and "b" (``list("ab")``)."""
    full = llm.invoke("Hi", max_new_tokens=8).content
    assert len(full) >= 4
    word = full[1:4]  # a stop string whose letters occur earlier than it does
    assert full.index(word) == 1
    expect = llm.invoke("Hi", max_new_tokens=8, stop=[word]).content
    assert expect == full[:1]
    assert llm.invoke("Hi", max_new_tokens=8, stop=word).content == expect
    assert llm.bind(stop=word).invoke("Hi", max_new_tokens=8).content == expect
    assert ChatKVRag(rag=llm.rag, stop=[word], max_new_tokens=8).invoke("Hi").content == expect


def test_token_counts_are_the_models(llm):
    tok = llm.rag.tokenizer
    text = "The red fox lives in the northern forest."
    assert llm.get_token_ids(text) == tok.encode(text, add_special_tokens=False)
    assert llm.get_num_tokens(text) == len(tok.encode(text, add_special_tokens=False)) > 0
    msgs = [SystemMessage(content="Be brief."), HumanMessage(content=text)]
    llm.invoke(msgs)
    assert llm.get_num_tokens_from_messages(msgs) == llm.last_stats.prompt_tokens


def test_hooks_outlive_a_shut_down_precomputer(tmp_path, embed, llm):
    store = precompute_on_add(chroma(tmp_path, embed), llm)
    warm = KVWarmingRetriever(store.as_retriever(search_kwargs={"k": 1}), llm)
    first = llm.precomputer
    first.shutdown()
    store.add_texts(TEXTS[:2])  # the hook follows the model to its new live precomputer
    live = llm.precomputer
    assert live is not first and not live.closed and warm.precomputer is live
    assert live.wait_until_idle(timeout=120) and live.progress().computed == 2
    assert llm.rag.is_cached(TEXTS[0]) and llm.rag.is_cached(TEXTS[1])


def test_empty_duplicate_and_odd_documents(tmp_path, embed, llm, caplog):
    odd = (
        "Caf\u00e9 na\u00efve \u2014 \U0001f680 rocket, \u200bzero width, "
        "\u05e9\u05dc\u05d5\u05dd, e\u0301 and a NUL\x00."
    )
    store = precompute_on_add(chroma(tmp_path, embed), llm)
    with caplog.at_level(logging.WARNING, logger="kvrag.precompute"):
        store.add_texts(TEXTS + TEXTS[:2] + ["", "  \n", odd])
    assert any("cannot be cached" in r.getMessage() for r in caplog.records)
    assert llm.precomputer.wait_until_idle(timeout=120)
    p = llm.precomputer.progress()
    assert p.computed == 5 and p.rejected == 2 and p.failed == 0
    assert p.deduplicated + p.already_cached == 2
    rag_chain(store.as_retriever(search_kwargs={"k": 1}), llm).invoke("Which rocket emoji?")
    assert llm.last_stats.chunks_hit == 1


def test_document_larger_than_the_context_is_rejected_clearly(tmp_path, embed, llm):
    big = " ".join(f"Sentence {i} of a very long report about the northern forest." for i in range(700))
    store = precompute_on_add(chroma(tmp_path, embed), llm)
    store.add_texts([big])  # the vector store keeps it; the precompute reports why not
    assert llm.precomputer.wait_until_idle(timeout=60)
    (f,) = llm.precomputer.failures()
    assert isinstance(f.error, ChunkError) and "split the document into smaller chunks" in str(f.error)
    # Splitting it first (what a text splitter does) caches every piece.
    pieces = [big[i : i + 2000] for i in range(0, len(big), 2000)]
    store.add_texts(pieces)
    assert llm.precomputer.wait_until_idle(timeout=300)
    assert all(llm.rag.is_cached(p) for p in pieces)
    # A prompt that cannot fit is a clear error from the model, not a silent truncation.
    with pytest.raises(ValueError, match="exceeds the model context"):
        llm.invoke([HumanMessage(content=big)])


def test_unwritable_store_is_a_clear_error_and_nothing_is_lost(tmp_path, embed, handle, llm, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot create DiskStore directory"):
        ChatKVRag(model=None, rag=KVRag(handle, cache_dir=blocker / "kv"))
    real_put = llm.rag.store.put
    monkeypatch.setattr(
        llm.rag.store, "put", lambda *a, **k: (_ for _ in ()).throw(OSError(30, "Read-only file system"))
    )
    store = precompute_on_add(chroma(tmp_path, embed), llm)
    store.add_texts(TEXTS)  # the vector store is not affected
    assert llm.precomputer.wait_until_idle(timeout=120)
    assert len(store.similarity_search(QUESTION, k=4)) == 4
    assert sorted(f.text for f in llm.precomputer.failures()) == sorted(TEXTS)
    chain = rag_chain(store.as_retriever(search_kwargs={"k": 2}), llm)
    chain.invoke(QUESTION)
    assert llm.last_stats.chunks_hit == 0
    monkeypatch.setattr(llm.rag.store, "put", real_put)
    llm.precomputer.retry_failed()
    assert llm.precomputer.wait_until_idle(timeout=120)
    chain.invoke(QUESTION)
    assert llm.last_stats.chunks_hit == 2


def test_messages_and_misuse(llm):
    out = llm.invoke([SystemMessage(content="Be brief."), HumanMessage(content=[{"type": "text", "text": "Hi"}])])
    assert out.usage_metadata["output_tokens"] == 6
    prompt = llm.rag.tokenizer.decode(llm.last_generation.prompt_ids)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt and "<|im_start|>user\nHi<|im_end|>" in prompt
    with pytest.raises(ValueError, match="text only"):
        llm.invoke([HumanMessage(content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])])
    with pytest.raises(ValueError, match="unknown policy"):
        ChatKVRag(rag=llm.rag, policy="nope")
    with pytest.raises(TypeError, match="needs a target"):
        KVWarmingRetriever(retriever=None)
    with pytest.raises(TypeError, match="expected a LangChain VectorStore"):
        precompute_on_add(object(), llm)
    # Per-call overrides: another policy, a stop string from LangChain's `stop`.
    over = llm.invoke("Hi", policy="naive_reuse", max_new_tokens=3)
    assert over.response_metadata["policy"] == "naive_reuse" and over.usage_metadata["output_tokens"] <= 3
    # Options of the wrong type are named, not iterated or converted into something else.
    for kw, err, msg in [
        (dict(stop=5), TypeError, "stop must be"),
        (dict(stop=b"x"), TypeError, "stop must be"),
        (dict(stop={"a": 1}), TypeError, "stop must be"),
        (dict(policy_params=[1]), TypeError, "policy_params must be a dict"),
    ]:
        with pytest.raises(err, match=msg):
            llm.invoke("Hi", **kw)
    with pytest.raises(NotImplementedError, match="does not support tools"):
        llm.bind_tools([])


def test_structured_output_parses_into_the_schema(llm):
    """``with_structured_output`` as LangChain's RAG tutorial uses it (query analysis into a
    pydantic model): the answer is held to the schema while it is generated, so it parses."""
    from typing import Literal

    from pydantic import BaseModel

    class Place(BaseModel):
        page: int

    class Search(BaseModel):
        section: Literal["beginning", "middle", "end"]
        where: Place  # a nested model: its own object in the schema's $defs

    roomy = ChatKVRag(rag=llm.rag, max_new_tokens=30)
    got = roomy.with_structured_output(Search).invoke("Which part of the book tells of the fox?")
    assert isinstance(got, Search) and got.section in ("beginning", "middle", "end") and isinstance(got.where.page, int)
    as_dict = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    assert isinstance(roomy.with_structured_output(as_dict).invoke("Yes?")["ok"], bool)
    raw = roomy.with_structured_output(Search, include_raw=True).invoke("Which part?")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Search)
    assert Search.model_validate_json(raw["raw"].content) == raw["parsed"]
    assert raw["raw"].response_metadata["finish_reason"] == "stop"  # the document was complete
    # Cut by the token budget: the parse fails, and include_raw says so instead of raising.
    cut = ChatKVRag(rag=llm.rag, max_new_tokens=2).with_structured_output(Search, include_raw=True).invoke("Part?")
    assert cut["parsed"] is None and cut["parsing_error"] is not None
    with pytest.raises(ValueError, match="method"):
        llm.with_structured_output(Search, method="xml")


def test_llm_cache_keys_on_the_generation_settings(llm):
    """LangChain's LLM cache keys on the model's identifying params: two models differing in
    what they generate must not share a cached answer."""
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import set_llm_cache

    rag = llm.rag
    variants = [
        dict(max_new_tokens=2),
        dict(max_new_tokens=12),
        dict(max_new_tokens=12, temperature=1.0, seed=7),
        dict(max_new_tokens=12, stop=["x"]),
        dict(max_new_tokens=12, top_k=5, temperature=1.0, seed=7),
    ]
    keys = {ChatKVRag(rag=rag, **kw)._get_llm_string() for kw in variants}
    assert len(keys) == len(variants)
    set_llm_cache(InMemoryCache())
    try:
        short = ChatKVRag(rag=rag, max_new_tokens=2).invoke("Tell me a story")
        long = ChatKVRag(rag=rag, max_new_tokens=12).invoke("Tell me a story")
        assert short.usage_metadata["output_tokens"] == 2 and long.usage_metadata["output_tokens"] == 12
        again = ChatKVRag(rag=rag, max_new_tokens=2).invoke("Tell me a story")
        assert again.content == short.content  # the cache still serves equal settings
    finally:
        set_llm_cache(None)


# ---- streaming lifecycle, finish reason, options ----------------------------------------------------
def test_an_unfinished_stream_does_not_hold_back_precompute(llm):
    """The query is in the foreground only while the model computes: a stream read partly and
    kept (not exhausted, not collected) lets background precompute run."""
    pc = llm.precomputer
    it = llm.stream("Hi")
    next(it)
    pc.submit(TEXTS[0])
    assert pc.wait_until_idle(timeout=10)  # was held back for max_defer_s (30 s) per pack
    assert llm.rag.is_cached(TEXTS[0])
    assert list(it)[-1].usage_metadata["output_tokens"] == 6  # the stream still completes normally


def test_cancelling_an_async_stream_mid_step(llm, monkeypatch):
    """astream cancelled while a step runs in the executor: CancelledError, and the generator
    is closed once that step returns (no further step, the query leaves the foreground)."""

    async def open_stream():
        return llm.astream("Hi")

    cancel_mid_step(llm.rag, monkeypatch, open_stream, llm.precomputer)


def test_finish_reason_is_recorded_not_guessed(llm):
    """EOS or a stop string on the last allowed token is "stop", not "length"."""
    full = llm.invoke("Hi")
    toks = llm.last_generation.token_ids
    assert len(toks) == 6 and full.response_metadata["finish_reason"] == "length"
    assert llm.last_generation.finish_reason == "length"
    # A stop string completed by the last allowed token.
    last = llm.rag.tokenizer.decode(toks[-1:]).strip()
    assert last and last not in full.content[: -len(last) - 1]
    msg = llm.invoke("Hi", stop=[last])
    assert msg.usage_metadata["output_tokens"] == 6 and msg.response_metadata["finish_reason"] == "stop"
    chunks = list(llm.stream("Hi", stop=[last]))
    assert chunks[-1].response_metadata["finish_reason"] == "stop"
    # An EOS token as the last allowed token.
    assert toks[-1] not in toks[:-1]
    llm.rag.eos = set(llm.rag.eos) | {toks[-1]}
    msg = llm.invoke("Hi")
    assert msg.usage_metadata["output_tokens"] == 6 and msg.response_metadata["finish_reason"] == "stop"
    # Fewer tokens than allowed: stopped.
    assert llm.invoke("Hi", max_new_tokens=7).response_metadata["finish_reason"] == "stop"


def test_max_tokens_is_max_new_tokens(llm):
    assert llm.bind(max_tokens=3).invoke("Hi").usage_metadata["output_tokens"] == 3
    assert llm.invoke("Hi", max_tokens=2).usage_metadata["output_tokens"] == 2
    own = ChatKVRag(rag=llm.rag, max_tokens=3)
    assert own.max_new_tokens == 3 == own.max_tokens and own.invoke("Hi").usage_metadata["output_tokens"] == 3
    assert llm._get_ls_params()["ls_max_tokens"] == 6
    with pytest.raises(ValueError, match="disagree"):
        ChatKVRag(rag=llm.rag, max_tokens=3, max_new_tokens=4)


def test_policy_settings_are_not_lost(llm, handle, tmp_path):
    llm.rag.precompute(TEXTS)
    msgs = [HumanMessage(content="Context:\n\n" + "\n\n".join(TEXTS) + f"\n\nQuestion: {QUESTION}")]
    # Flat policy parameters, as KVRag takes them, at construction and per call.
    flat = ChatKVRag(rag=llm.rag, recompute_ratio=1.0, max_new_tokens=1)
    assert flat.policy == "cacheblend" and flat.policy_params["recompute_ratio"] == 1.0
    flat.invoke(msgs)
    assert flat.last_stats.cached_tokens > 0 and flat.last_stats.recomputed_tokens == flat.last_stats.cached_tokens
    llm.invoke(msgs, recompute_ratio=1.0, max_new_tokens=1)
    assert llm.last_stats.recomputed_tokens == llm.last_stats.cached_tokens > 0
    # A typo is an error naming it, not a silent default.
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['recompute_ratoi'\].*recompute_ratio"):
        ChatKVRag(rag=llm.rag, recompute_ratoi=1.0)
    with pytest.raises(ValueError, match="naive_reuse"):
        ChatKVRag(rag=llm.rag, policy="naive_reuse", recompute_ratio=1.0)
    # No policy given: the wrapped KVRag's own policy and parameters.
    for kw, policy in (
        ({"policy": "naive_reuse"}, "naive_reuse"),
        ({"policy": "cacheblend", "recompute_ratio": 1.0}, "cacheblend"),
        ({"policy": "kvlink"}, "kvlink"),
    ):
        rag = KVRag(handle, cache_dir=tmp_path / "kv", **kw)
        inherited = ChatKVRag(rag=rag, max_new_tokens=1)
        assert inherited.policy == policy
        inherited.invoke(msgs)
        s = inherited.last_stats
        assert s.policy == policy and s.cached_tokens > 0
        prompt = rag.render(to_kvrag_messages(msgs))
        assert s.recomputed_tokens == rag.generate(prompt, max_new_tokens=1).stats.recomputed_tokens
        if policy == "cacheblend":
            assert s.recomputed_tokens == s.cached_tokens
    assert (
        ChatKVRag(rag=KVRag(handle, cache_dir=tmp_path / "kv", policy="naive_reuse"), policy="cacheblend").policy_params
        == {}
    )


def test_configurable_fields_rebuild_the_same_model(llm, handle, tmp_path, monkeypatch):
    """LangChain rebuilds a configurable model from all its fields: the KVRag a ChatKVRag built
    from ``cache_dir`` comes back with that ``cache_dir`` (the same model, not a conflict), and
    the parameters a wrapper inherited from its KVRag do not bar another policy."""
    llm.rag.precompute(TEXTS)
    msgs = [HumanMessage(content="Context:\n\n" + "\n\n".join(TEXTS) + f"\n\nQuestion: {QUESTION}")]
    # Inherited cacheblend parameters (recompute_ratio, check_layers, ...) vs full_prefill.
    by_policy = llm.configurable_fields(policy=ConfigurableField(id="policy"))
    out = by_policy.with_config(configurable={"policy": "full_prefill"}).invoke(msgs)
    assert out.response_metadata["policy"] == "full_prefill"
    assert out.usage_metadata["input_token_details"]["cache_read"] == 0
    # Parameters the user set still belong to their policy (integrations.md).
    own = ChatKVRag(rag=llm.rag, recompute_ratio=0.3).configurable_fields(policy=ConfigurableField(id="p"))
    with pytest.raises(ValueError, match="recompute_ratio"):
        own.with_config(configurable={"p": "full_prefill"}).invoke(msgs)

    import langchain_kvrag.chat_models as cm

    class TinyKVRag(KVRag):  # what ChatKVRag(cache_dir=...) builds, on the tiny model
        def __init__(self, model, **kw):
            super().__init__(handle, **kw)

    monkeypatch.setattr(cm, "KVRag", TinyKVRag)
    built = ChatKVRag(cache_dir=str(tmp_path / "kv"), max_new_tokens=4)
    conf = built.configurable_fields(max_new_tokens=ConfigurableField(id="n"), cache_dir=ConfigurableField(id="dir"))
    out = conf.with_config(configurable={"n": 2}).invoke(msgs)
    assert out.usage_metadata["output_tokens"] == 2 and out.usage_metadata["input_token_details"]["cache_read"] > 0
    with pytest.raises(ValueError, match="not configurable"):  # another store is another KVRag
        conf.with_config(configurable={"dir": str(tmp_path / "other")}).invoke(msgs)


def test_from_documents_store_is_backfilled(tmp_path, embed, llm):
    """``Chroma.from_documents`` adds its documents before any hook exists: ``backfill=True``
    schedules what the store already holds (paged), and new additions are hooked as usual."""
    client = chromadb.PersistentClient(
        path=str(tmp_path / "chroma"), settings=ChromaSettings(anonymized_telemetry=False)
    )
    store = Chroma.from_documents(
        [Document(page_content=t) for t in TEXTS[:3]], embed, client=client, collection_name="docs"
    )
    hook = KVPrecomputeHook(llm)
    assert hook.backfill(store, page_size=2) == 3  # two pages
    assert llm.precomputer.wait_until_idle(timeout=120) and all(llm.rag.is_cached(t) for t in TEXTS[:3])
    store = precompute_on_add(store, llm, backfill=True)  # already cached: found, not recomputed
    store.add_texts([TEXTS[3]])
    assert llm.precomputer.wait_until_idle(timeout=120) and llm.rag.is_cached(TEXTS[3])
    p = llm.precomputer.progress()
    assert p.computed == 4 and p.already_cached + p.deduplicated == 3
    from langchain_core.vectorstores import InMemoryVectorStore

    with pytest.raises(TypeError, match="KVWarmingRetriever"):
        precompute_on_add(InMemoryVectorStore(embed), llm, backfill=True)


# ---- the real model ---------------------------------------------------------------------------------
@pytest.mark.real
def test_real_smollm2_langchain_end_to_end(tmp_path, embed, smollm2):
    llm = ChatKVRag(rag=KVRag(smollm2, cache_dir=tmp_path / "kv"), max_new_tokens=16, stop=["\n"])
    try:
        store = precompute_on_add(chroma(tmp_path, embed), llm)
        store.add_texts(TEXTS[:3])
        assert llm.precomputer.wait_until_idle(timeout=300)
        chain = rag_chain(store.as_retriever(search_kwargs={"k": 2}), llm)
        msg = chain.invoke(QUESTION)
        assert llm.last_stats.chunks_hit == 2 and msg.usage_metadata["input_token_details"]["cache_read"] > 0
        plain = ChatKVRag(rag=llm.rag, policy="full_prefill", max_new_tokens=16)
        ref = rag_chain(store.as_retriever(search_kwargs={"k": 2}), plain).invoke(QUESTION)
        gen = plain.last_generation
        # The KVRag's own model: the default policy may run an adapted copy (SmolLM2: KVLink's).
        assert gen.token_ids == hf_greedy(llm.rag.handle.model, gen.prompt_ids, len(gen.token_ids))
        assert "forest" in ref.content.lower() and "forest" in msg.content.lower()
    finally:
        llm.precomputer.shutdown(cancel_pending=True, timeout=60)
