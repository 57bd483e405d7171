"""LlamaIndex integration end to end: real Chroma (PersistentClient), real LlamaIndex objects,
all-MiniLM-L6-v2 embeddings; the LLM is a tiny random-weight model with SmolLM2's tokenizer
(fast), and, in the ``real`` tests, SmolLM2-135M-Instruct itself."""

import asyncio
import json
import logging
import pickle
import time

import chromadb
import pytest
from chromadb.config import Settings as ChromaSettings  # noqa: E402
from helpers.corpus import hf_greedy  # noqa: E402
from helpers.streams import cancel_mid_step  # noqa: E402
from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.schema import MetadataMode, TextNode  # noqa: E402
from llama_index.vector_stores.chroma import ChromaVectorStore  # noqa: E402

from kvrag.engine import KVRag  # noqa: E402
from kvrag.errors import ChunkError  # noqa: E402
from llama_index.llms.kvrag import KVCacheWarmer, KVPrecompute, KVRagLLM, KVWarmingRetriever, node_texts  # noqa: E402

DOCS = [
    ("The red fox lives in the northern forest and hunts small rodents at dawn.", "animals.txt"),
    ("Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres.", "geography.txt"),
    ("The river Lenne flows from the Varn Mountains to the eastern sea.", "rivers.txt"),
    ("Queen Ilsa founded the harbour town of Brisk in the year 1204.", "history.txt"),
]
QUESTION = "Where does the red fox live?"


def documents(docs=DOCS):
    return [Document(text=t, metadata={"file_name": f}) for t, f in docs]


def chroma_store(tmp_path, name="docs"):
    client = chromadb.PersistentClient(
        path=str(tmp_path / "chroma"), settings=ChromaSettings(anonymized_telemetry=False)
    )
    return ChromaVectorStore(chroma_collection=client.get_or_create_collection(name))


def ingest(tmp_path, embed, docs, hook=None):
    """The user's pipeline: splitter -> (kvrag hook) -> embeddings -> Chroma."""
    vs = chroma_store(tmp_path)
    steps = [SentenceSplitter(chunk_size=128, chunk_overlap=0)] + ([hook] if hook is not None else []) + [embed]
    nodes = IngestionPipeline(transformations=steps, vector_store=vs).run(documents=docs)
    return VectorStoreIndex.from_vector_store(vs, embed_model=embed), nodes


# ---- ingestion hook + query engine -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize", "accumulate"])
def test_ingested_chunks_are_found_in_the_prompt(tmp_path, embed, llm, mode):
    index, nodes = ingest(tmp_path, embed, documents(), KVPrecompute(llm))
    assert llm.precomputer.wait_until_idle(timeout=120)
    assert llm.precomputer.progress().computed == len(nodes) == 4
    qe = index.as_query_engine(llm=llm, similarity_top_k=2, response_mode=mode)
    hits = []
    real_generate = llm.rag.generate
    llm.rag.generate = lambda *a, **k: (lambda g: hits.append(g.stats.chunks_hit) or g)(real_generate(*a, **k))
    resp = qe.query(QUESTION)
    assert str(resp) and len(resp.source_nodes) == 2
    # compact/tree_summarize: one call holding both nodes; refine/accumulate: one call per node.
    assert hits == ([2] if mode in ("compact", "tree_summarize") else [1, 1])
    # What was precomputed is exactly what the query engine rendered (metadata included).
    prompt = llm.rag.tokenizer.decode(llm.last_generation.prompt_ids)
    assert any(n.node.get_content(MetadataMode.LLM) in prompt for n in resp.source_nodes)
    assert "file_name: " in prompt


def test_full_prefill_through_the_query_engine_equals_plain_generate(tmp_path, embed, llm, handle):
    index, _ = ingest(tmp_path, embed, documents(), KVPrecompute(llm))
    assert llm.precomputer.wait_until_idle(timeout=120)
    plain = KVRagLLM(llm.rag, policy="full_prefill", max_new_tokens=10)
    str(index.as_query_engine(llm=plain, similarity_top_k=3).query(QUESTION))
    gen = plain.last_generation
    assert gen.stats.cached_tokens == 0 and gen.stats.policy == "full_prefill"
    assert gen.token_ids == hf_greedy(handle.model, gen.prompt_ids, len(gen.token_ids))
    # The same query through the cache-reusing LLM found all three retrieved chunks.
    str(index.as_query_engine(llm=llm, similarity_top_k=3).query(QUESTION))
    assert llm.last_stats.chunks_hit == 3 and llm.last_stats.cached_tokens > 0
    assert llm.last_generation.prompt_ids == gen.prompt_ids  # same prompt, same token ids


def test_whitespace_edged_node_is_precomputed_once_and_served_in_both_forms(tmp_path, embed, llm):
    # No metadata shown: LlamaIndex renders the text as is (with metadata it strips the end).
    node = TextNode(text="\n  The grey owl hunts over the Lenne marshes at night, mostly voles and frogs.  \n")
    rendered = node.get_content(MetadataMode.LLM)
    assert rendered != rendered.strip()
    KVPrecompute(llm)([node])
    assert llm.precomputer.wait_until_idle(timeout=120)
    # One form per node (the stripped one the response modes render), not two.
    assert llm.precomputer.progress().computed == 1 and llm.rag.is_cached(rendered.strip())
    n = len(llm.rag.chunk_ids(rendered.strip()))
    # compact renders it stripped: served whole.
    index = VectorStoreIndex(nodes=[node], embed_model=embed)
    index.as_query_engine(llm=llm, similarity_top_k=1).query("What does the grey owl hunt?")
    assert llm.last_stats.chunks_hit == 1 and llm.last_stats.cached_tokens == n
    # A prompt holding the text as rendered contains the stripped form: served too, the edge
    # token that merges with the whitespace computed.
    llm.complete(f"Context:{rendered}Question: what does the grey owl hunt?")
    assert llm.last_stats.chunks_hit == 1 and llm.last_stats.cached_tokens >= n - 2


def test_chunk_not_yet_precomputed_falls_back(tmp_path, embed, llm):
    index, _ = ingest(tmp_path, embed, documents(), KVPrecompute(llm))
    assert llm.precomputer.wait_until_idle(timeout=120)
    # A late document: ingested, its precompute held back by a running "query".
    late = Document(
        text="The blue heron nests in the reeds along the Lenne delta.", metadata={"file_name": "birds.txt"}
    )
    with llm.precomputer.foreground():
        index.insert_nodes(KVPrecompute(llm)(SentenceSplitter(chunk_size=128, chunk_overlap=0)([late])))
        assert llm.precomputer.progress().queued == 1
        q = "Where does the blue heron nest?"
        blend = KVRagLLM(llm.rag, policy="cacheblend", policy_params={"recompute_ratio": 1.0}, max_new_tokens=8)
        full = KVRagLLM(llm.rag, policy="full_prefill", max_new_tokens=8)
        r_blend = index.as_query_engine(llm=blend, similarity_top_k=2).query(q)
        index.as_query_engine(llm=full, similarity_top_k=2).query(q)
        texts = [n.node.get_content(MetadataMode.LLM) for n in r_blend.source_nodes]
        assert any("heron" in t for t in texts)
        # The late chunk is computed as plain text; the other one comes from the cache, and
        # with every cached token recomputed the answer is the exact one.
        assert blend.last_stats.chunks_hit == 1
        assert blend.last_generation.token_ids == full.last_generation.token_ids
        # Nothing cached at all: the exact full-prefill path, whatever the policy.
        naive = KVRagLLM(llm.rag, policy="naive_reuse", max_new_tokens=8)
        naive.complete("Passage: " + late.text + "\nWhere does the heron nest?")
        full.complete("Passage: " + late.text + "\nWhere does the heron nest?")
        assert naive.last_stats.chunks_hit == 0
        assert naive.last_generation.token_ids == full.last_generation.token_ids
    assert llm.precomputer.wait_until_idle(timeout=60)
    assert llm.rag.is_cached(texts[[("heron" in t) for t in texts].index(True)])


def test_streaming_and_async(tmp_path, embed, llm):
    index, _ = ingest(tmp_path, embed, documents(), KVPrecompute(llm))
    assert llm.precomputer.wait_until_idle(timeout=120)
    ref = str(index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION))
    streamed = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True).query(QUESTION)
    assert "".join(streamed.response_gen) == ref
    assert llm.last_stats.chunks_hit == 2 and llm.last_stats.ttft_s > 0

    async def run():
        r = await index.as_query_engine(llm=llm, similarity_top_k=2).aquery(QUESTION)
        msgs = [ChatMessage(role=MessageRole.USER, content="Say hi.")]
        chat = await llm.achat(msgs)
        comp = await llm.acomplete("Say hi.")
        parts = [c.delta async for c in await llm.astream_chat(msgs)]
        cparts = [c async for c in await llm.astream_complete("Say hi.")]
        return str(r), chat, comp, parts, cparts

    aref, chat, comp, parts, cparts = asyncio.run(run())
    assert aref == ref
    assert "".join(parts) == chat.message.content == comp.text  # chat(user msg) == complete(prompt)
    assert cparts[-1].text == comp.text and cparts[-1].additional_kwargs["completion_tokens"] == 6
    assert chat.additional_kwargs["kvrag_stats"]["policy"] == "cacheblend"
    sync = llm.stream_chat([ChatMessage(role=MessageRole.USER, content="Say hi.")])
    assert "".join(c.delta for c in sync) == chat.message.content


def test_retriever_hook_warms_a_legacy_collection(tmp_path, embed, llm):
    """Ingested without the ingestion hook: the first query misses (and is not slowed by
    the precompute it schedules), the second one hits."""
    index, _ = ingest(tmp_path, embed, documents(), hook=None)
    assert llm.precomputer.progress().submitted == 0
    events = []
    rag = llm.rag
    real_generate, real_precompute = rag.generate, rag.precompute

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.monotonic()
            try:
                return fn(*a, **k)
            finally:
                events.append((name, t0, time.monotonic()))

        return wrapper

    rag.generate = timed("query", real_generate)
    rag.precompute = timed("precompute", real_precompute)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2, node_postprocessors=[KVCacheWarmer(llm)])
    qe.query(QUESTION)
    assert llm.last_stats.chunks_hit == 0
    assert llm.precomputer.wait_until_idle(timeout=120)
    assert llm.precomputer.progress().computed == 2
    (q,) = [e for e in events if e[0] == "query"]
    assert all(p[1] >= q[2] for p in events if p[0] == "precompute")  # only after the query
    qe.query(QUESTION)
    assert llm.last_stats.chunks_hit == 2
    qe.query(QUESTION)
    assert llm.precomputer.progress().computed == 2  # cached ones are not computed again
    # The retriever wrapper does the same for a query engine built from a retriever.
    other = "How tall is Mount Kelvar?"
    rqe = RetrieverQueryEngine.from_args(KVWarmingRetriever(index.as_retriever(similarity_top_k=2), llm), llm=llm)
    rqe.query(other)
    first = llm.last_stats.chunks_hit
    assert llm.precomputer.wait_until_idle(timeout=120)
    rqe.query(other)
    assert llm.last_stats.chunks_hit == 2 and first < 2


# ---- bad input -------------------------------------------------------------------------------------
def test_empty_duplicate_and_odd_documents(tmp_path, embed, llm, caplog):
    odd = (
        "Caf\u00e9 na\u00efve \u2014 \U0001f680 rocket, \u200bzero width, "
        "\u05e9\u05dc\u05d5\u05dd, e\u0301 and a NUL\x00."
    )
    docs = documents() + documents()[:2] + [Document(text=""), Document(text="   \n "), Document(text=odd)]
    with caplog.at_level(logging.WARNING):
        index, nodes = ingest(tmp_path, embed, docs, KVPrecompute(llm))
    assert llm.precomputer.wait_until_idle(timeout=120)
    p = llm.precomputer.progress()
    texts, skipped = node_texts(nodes)
    # One node per document: the 7 with text are kept, the blank ones (if the splitter made
    # nodes of them at all) are counted as skipped.
    assert len(texts) == 7 and texts[-1] == odd.strip()
    assert skipped == sum(1 for n in nodes if not n.get_content(metadata_mode=MetadataMode.LLM).strip())
    assert p.computed == 5 and p.failed == 0  # 4 unique docs + the odd one, once each
    assert p.deduplicated + p.already_cached == 2
    qe = index.as_query_engine(llm=llm, similarity_top_k=1)
    qe.query("Which rocket emoji?")
    assert llm.last_stats.chunks_hit == 1


def test_hooks_outlive_a_shut_down_precomputer(tmp_path, embed, llm):
    hook, warmer = KVPrecompute(llm), KVCacheWarmer(llm)
    first = llm.precomputer
    first.shutdown()
    # The hooks follow the LLM to its new live precomputer instead of failing on the closed one.
    _, nodes = ingest(tmp_path, embed, documents()[:2], hook)
    live = llm.precomputer
    assert live is not first and not live.closed and hook.precomputer is live and warmer.precomputer is live
    assert live.wait_until_idle(timeout=120) and live.progress().computed == 2
    texts, _ = node_texts(nodes)
    assert texts and all(llm.rag.is_cached(t) for t in texts)
    # An explicit Precomputer stays the caller's: shut down, the hook reports it.
    from kvrag.precompute import Precomputer, PrecomputerClosedError

    own = Precomputer(llm.rag)
    own_hook = KVPrecompute(own)
    own.shutdown()
    with pytest.raises(PrecomputerClosedError):
        own_hook([TextNode(text="A node for a closed precomputer.")])


def test_document_larger_than_the_context(tmp_path, embed, llm, caplog):
    big = " ".join(f"Sentence {i} of a very long report about the northern forest." for i in range(700))
    with pytest.raises(ChunkError, match="exceeds the model context"):
        llm.rag.chunk_ids(big)  # the whole document does not fit the (tiny) model's 4096 tokens
    # Split by the pipeline: every chunk fits and is precomputed.
    index, nodes = ingest(tmp_path, embed, [Document(text=big)], KVPrecompute(llm))
    assert llm.precomputer.wait_until_idle(timeout=300)
    assert llm.precomputer.progress().computed == len(nodes) > 10
    # Not split: the node is rejected by the precompute with a clear, counted, logged error,
    # while the vector store still gets it.
    node = TextNode(text=big * 2)
    with caplog.at_level(logging.ERROR, logger="kvrag.precompute"):
        KVPrecompute(llm)([node])
        assert llm.precomputer.wait_until_idle(timeout=60)
    (f,) = llm.precomputer.failures()
    assert isinstance(f.error, ChunkError) and "exceeds the model context" in str(f.error)
    assert any("split the document" in r.getMessage() for r in caplog.records)


def test_unwritable_store_is_a_clear_error_and_nothing_is_lost(tmp_path, embed, handle, llm, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot create DiskStore directory"):
        KVRagLLM(KVRag(handle, cache_dir=blocker / "kv"))
    # The store fails while ingesting: ingestion still completes, the failures are surfaced
    # with their texts, queries still answer, and a retry after the fix caches everything.
    real_put = llm.rag.store.put
    monkeypatch.setattr(
        llm.rag.store, "put", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "Read-only file system"))
    )
    index, nodes = ingest(tmp_path, embed, documents(), KVPrecompute(llm))
    assert llm.precomputer.wait_until_idle(timeout=120)
    assert len(index.as_retriever(similarity_top_k=4).retrieve(QUESTION)) == 4
    fails = llm.precomputer.failures()
    assert len(fails) == 4 and all("Read-only" in f.message for f in fails)
    assert {f.text for f in fails} == {n.get_content(MetadataMode.LLM) for n in nodes}
    index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    # Answered by plain prefill: nothing cached, every prompt token computed.
    s = llm.last_stats
    assert s.chunks_hit == 0 and s.cached_tokens == 0 and s.computed_tokens == s.prompt_tokens > 0
    monkeypatch.setattr(llm.rag.store, "put", real_put)
    llm.precomputer.retry_failed()
    assert llm.precomputer.wait_until_idle(timeout=120)
    index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    assert llm.last_stats.chunks_hit == 2


def test_prompts_are_sized_with_the_models_tokenizer(handle, tmp_path, monkeypatch):
    """LlamaIndex packs nodes into ``context_window`` tokens counted by its global tokenizer
    (tiktoken): KVRagLLM makes it the model's own, unless the user chose one."""
    import llama_index.core as core
    from llama_index.core import Settings

    from llama_index.llms.kvrag import base

    monkeypatch.setattr(core, "global_tokenizer", None)
    monkeypatch.setattr(base, "_installed_tokenizer", None)
    text = "Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres."
    rag = KVRag(handle, cache_dir=tmp_path / "kv")
    KVRagLLM(rag, set_tokenizer=False)
    assert core.global_tokenizer is None
    tiktoken_count = len(Settings.tokenizer(text))  # installs LlamaIndex's lazy default
    assert core.global_tokenizer is not None and tiktoken_count != len(handle.encode(text))
    KVRagLLM(rag)
    assert Settings.tokenizer(text) == handle.encode(text)
    mine = str.split
    Settings.tokenizer = mine
    KVRagLLM(rag)
    assert core.global_tokenizer is mine


def test_api_misuse_is_reported(llm):
    with pytest.raises(TypeError, match="needs a target"):
        KVPrecompute()
    with pytest.raises(ValueError, match="unknown policy"):
        KVRagLLM(llm.rag, policy="nope")
    with pytest.raises(ValueError, match="either an existing `rag`"):
        KVRagLLM(llm.rag, cache_dir="x")
    with pytest.raises(TypeError, match="num_workers=None"):
        pickle.dumps(KVPrecompute(llm))
    with pytest.raises(ValueError, match="text only"):
        llm.chat([ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="hi"), ImageBlock(url="http://x/y.png")])])
    assert llm.metadata.is_chat_model and llm.metadata.context_window == llm.rag.handle.max_context


def test_documents_before_the_splitter_are_flagged(llm, caplog):
    with caplog.at_level(logging.WARNING, logger="kvrag.llama_index"):
        KVPrecompute(llm)(documents())
    assert any("after the node parser" in r.getMessage() for r in caplog.records)


def test_ingestion_returns_at_once_and_queries_run_meanwhile(tmp_path, embed, llm):
    """The transform only queues: with the worker held, 34 nodes go through it at once, and
    a query answers (plain prefill for what is not cached yet) while they wait."""
    many = [Document(text=f"Filler report number {i}: nothing happened in sector {i} today.") for i in range(30)]
    nodes = SentenceSplitter(chunk_size=128, chunk_overlap=0)(documents() + many)
    hook = KVPrecompute(llm)
    with llm.precomputer.foreground():
        hook(nodes)  # returns with all 34 queued and none computed: it did no model work
        assert llm.precomputer.progress().queued == 34 and llm.precomputer.progress().computed == 0
        index = VectorStoreIndex(nodes, storage_context=None, embed_model=embed)
        index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
        assert llm.last_stats.chunks_hit == 0
    assert llm.precomputer.wait_until_idle(timeout=300)
    assert llm.precomputer.progress().computed == 34
    index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    assert llm.last_stats.chunks_hit == 2


# ---- streaming lifecycle, policy settings ------------------------------------------------------------
@pytest.mark.parametrize("api", ["astream_complete", "astream_chat"])
def test_cancelling_an_async_stream_mid_step(llm, monkeypatch, api):
    """A client that disconnects while a step runs in the worker thread: the task ends with
    CancelledError (not "generator already executing"), and the generator is closed as soon as
    that step returns (no further step runs, the query leaves the foreground)."""
    arg = "Say hi." if api == "astream_complete" else [ChatMessage(role=MessageRole.USER, content="Say hi.")]
    cancel_mid_step(llm.rag, monkeypatch, lambda: getattr(llm, api)(arg), llm.precomputer)


@pytest.mark.parametrize("api", ["stream_complete", "stream_chat"])
def test_an_unfinished_stream_does_not_hold_back_precompute(llm, api):
    """The query is in the foreground only while the model computes: a stream read partly and
    kept (not exhausted, not collected) lets background precompute run."""
    pc = llm.precomputer
    arg = "Say hi." if api == "stream_complete" else [ChatMessage(role=MessageRole.USER, content="Say hi.")]
    it = getattr(llm, api)(arg)
    next(it)
    pc.submit(DOCS[0][0])
    assert pc.wait_until_idle(timeout=10)  # was held back for max_defer_s (30 s) per pack
    assert llm.rag.is_cached(DOCS[0][0])
    rest = list(it)  # the stream still completes normally
    assert rest[-1].additional_kwargs["completion_tokens"] == 6 and rest[-1].additional_kwargs["finish_reason"]


def _context_prompt(rag, texts):
    body = "\n\n".join(texts)
    return rag.render([{"role": "user", "content": f"Context:\n\n{body}\n\nQuestion: {QUESTION}"}])


def test_policy_settings_are_not_lost(llm, handle, tmp_path):
    texts = [t for t, _ in DOCS]
    llm.rag.precompute(texts)
    prompt = _context_prompt(llm.rag, texts)
    # Flat policy parameters, as KVRag takes them, at construction and per call.
    flat = KVRagLLM(llm.rag, recompute_ratio=1.0, max_new_tokens=1)
    assert flat.policy == "cacheblend" and flat.policy_params["recompute_ratio"] == 1.0
    flat.complete(prompt, formatted=True)
    assert flat.last_stats.cached_tokens > 0 and flat.last_stats.recomputed_tokens == flat.last_stats.cached_tokens
    llm.complete(prompt, formatted=True, recompute_ratio=1.0)
    assert llm.last_stats.recomputed_tokens == llm.last_stats.cached_tokens > 0
    # OpenAI's sampling adjustments per call, as KVRag.generate takes them.
    fox = llm.rag.tokenizer.encode(" fox", add_special_tokens=False)[0]
    forced = llm.complete(prompt, formatted=True, max_new_tokens=3, logit_bias={fox: 100.0}, presence_penalty=0.5)
    assert forced.text == " fox" * 3
    verdict = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    structured = llm.complete(prompt, formatted=True, max_new_tokens=20, json_schema=verdict)
    assert structured.additional_kwargs["finish_reason"] == "stop" and isinstance(
        json.loads(structured.text)["ok"], bool
    )
    # A typo is an error naming it, not a silent default.
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['recompute_ratoi'\].*recompute_ratio"):
        KVRagLLM(llm.rag, recompute_ratoi=1.0)
    with pytest.raises(ValueError, match="naive_reuse"):
        KVRagLLM(llm.rag, policy="naive_reuse", recompute_ratio=1.0)
    # max_tokens, the usual name, is max_new_tokens.
    assert KVRagLLM(llm.rag, max_tokens=3).max_new_tokens == 3
    # No policy given: the wrapped KVRag's own policy and parameters.
    for kw, policy in (
        ({"policy": "naive_reuse"}, "naive_reuse"),
        ({"policy": "cacheblend", "recompute_ratio": 1.0}, "cacheblend"),
        ({"policy": "kvlink"}, "kvlink"),
    ):
        rag = KVRag(handle, cache_dir=tmp_path / "kv", **kw)
        inherited = KVRagLLM(rag, max_new_tokens=1)
        assert inherited.policy == policy
        inherited.complete(prompt, formatted=True)
        s = inherited.last_stats
        assert s.policy == policy and s.cached_tokens > 0
        assert s.recomputed_tokens == rag.generate(prompt, max_new_tokens=1).stats.recomputed_tokens
        if policy == "cacheblend":
            assert s.recomputed_tokens == s.cached_tokens
    # An explicit policy is the LLM's own (with its defaults), whatever the KVRag's.
    assert (
        KVRagLLM(KVRag(handle, cache_dir=tmp_path / "kv", policy="naive_reuse"), policy="cacheblend").policy_params
        == {}
    )


# ---- the real model ---------------------------------------------------------------------------------
@pytest.mark.real
def test_real_smollm2_llamaindex_end_to_end(tmp_path, embed, smollm2):
    llm = KVRagLLM(KVRag(smollm2, cache_dir=tmp_path / "kv"), max_new_tokens=16, stop=["\n"])
    try:
        index, nodes = ingest(tmp_path, embed, documents()[:3], KVPrecompute(llm))
        assert llm.precomputer.wait_until_idle(timeout=300)
        assert llm.precomputer.progress().computed == 3
        qe = index.as_query_engine(llm=llm, similarity_top_k=2)
        answer = str(qe.query(QUESTION))
        s = llm.last_stats
        assert s.chunks_hit == 2 and s.cached_tokens > 0 and s.recomputed_tokens < s.cached_tokens
        plain = KVRagLLM(llm.rag, policy="full_prefill", max_new_tokens=16)
        full_answer = str(index.as_query_engine(llm=plain, similarity_top_k=2).query(QUESTION))
        gen = plain.last_generation
        # The KVRag's own model: the default policy may run an adapted copy (SmolLM2: KVLink's).
        assert gen.token_ids == hf_greedy(llm.rag.handle.model, gen.prompt_ids, len(gen.token_ids))
        assert "forest" in full_answer.lower() and "forest" in answer.lower()
        # A chunk ingested but not precomputed yet: answered by plain prefill of that chunk.
        with llm.precomputer.foreground():
            late = Document(text="The blue heron nests in the reeds along the Lenne delta.")
            index.insert_nodes(KVPrecompute(llm)(SentenceSplitter(chunk_size=128, chunk_overlap=0)([late])))
            r = str(index.as_query_engine(llm=llm, similarity_top_k=1).query("Where does the blue heron nest?"))
            assert llm.last_stats.chunks_hit == 0 and "reed" in r.lower()
    finally:
        llm.precomputer.shutdown(cancel_pending=True, timeout=60)
