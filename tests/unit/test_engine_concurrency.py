"""Serving one KVRag concurrently: queries from many threads and from asyncio, with ingestion
running at the same time. Tiny random-weight models; answers under concurrency must equal
the sequential (greedy) ones."""

import asyncio
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers.corpus import DOCS, prompt_for

from kvrag.engine import KVRag
from kvrag.layout.segment import Segmenter
from kvrag.precompute import Precomputer
from kvrag.testing import tiny_llama


# ---- ingestion while queries run -----------------------------------------------------------
def test_segmenter_update_since_keeps_keys_added_after_the_snapshot():
    seg = Segmenter({"k1": "alpha beta", "k2": "gamma delta"})
    since = seg.version()
    snapshot = {"k1": "alpha beta"}  # read before k3 was added, and after k2 was evicted
    seg.add("k3", "epsilon zeta")
    seg.update(snapshot, since=since)
    assert [s.key for s in seg.split("alpha beta | gamma delta | epsilon zeta") if s.key] == ["k1", "k3"]
    seg.update(snapshot)  # without since: exactly the snapshot
    assert [s.key for s in seg.split("alpha beta | epsilon zeta") if s.key] == ["k1"]


def test_chunk_stored_while_a_query_rereads_the_index_is_found_by_the_next_query(handle, tmp_path):
    # A query re-reads the store's text index; meanwhile the precompute worker stores chunk
    # B and registers it. The query's older snapshot must not unregister B: the next query
    # (before the next re-read) has to find it.
    rag = KVRag(handle, cache_dir=tmp_path / "kv", refresh_s=3600)
    rag.precompute([DOCS[0]])
    real_texts = rag.store.texts
    stored_meanwhile = []

    def texts(fingerprint):
        snapshot = real_texts(fingerprint)
        if not stored_meanwhile:
            stored_meanwhile.append(rag.precompute([DOCS[1]]))  # the worker, between read and update
        return snapshot

    rag.store.texts = texts
    assert rag.generate(prompt_for([DOCS[0]]), max_new_tokens=2).stats.chunks_hit == 1
    assert stored_meanwhile
    out = rag.generate(prompt_for([DOCS[1]]), max_new_tokens=2)
    assert out.stats.chunks_hit == 1 and out.stats.chunks_missed == 0


# ---- async ingestion must not block the event loop -------------------------------------------
def _event_loop_runs_while_ingestion_waits_for_room(rag, add):
    """``add(pc)``: a coroutine that ingests DOCS[0] and DOCS[1] through an async hook with
    ``block=True``. The precomputer's queue holds one text and has no worker yet, so the second
    submission must wait for room; meanwhile the event loop must keep serving other coroutines
    (here: the one that then starts the worker)."""
    pc = Precomputer(rag, max_queued=1, start=False)
    rescued = []
    # Only reached when the loop is blocked (the defect): nothing would ever start the worker,
    # so this watchdog does, and the test fails instead of hanging.
    watchdog = threading.Timer(20, lambda: (rescued.append(True), pc.start()))
    watchdog.start()

    async def main():
        task = asyncio.create_task(add(pc))
        while pc.progress().submitted < 1:
            await asyncio.sleep(0)
        waiting = not task.done()  # the add waits for room, and this coroutine runs meanwhile
        pc.start()
        await task
        return waiting

    try:
        waiting = asyncio.run(main())
    finally:
        watchdog.cancel()
    try:
        assert not rescued and waiting
        assert pc.wait_until_idle(60)
        assert pc.progress().computed == 2 and rag.is_cached(DOCS[1])
    finally:
        pc.shutdown(cancel_pending=True, timeout=30)


def test_async_submit_waits_for_queue_room_off_the_event_loop(rag):
    _event_loop_runs_while_ingestion_waits_for_room(rag, lambda pc: pc.asubmit_many(DOCS[:2]))


def test_langchain_async_add_waits_for_queue_room_off_the_event_loop(rag):
    from langchain_kvrag import precompute_on_add

    class Store:  # the smallest vector store the hook patches
        def add_texts(self, texts, **kwargs):
            return [str(i) for i, _ in enumerate(texts)]

        async def aadd_texts(self, texts, **kwargs):
            return self.add_texts(texts)

    _event_loop_runs_while_ingestion_waits_for_room(rag, lambda pc: precompute_on_add(Store(), pc).aadd_texts(DOCS[:2]))


def test_llamaindex_async_transform_waits_for_queue_room_off_the_event_loop(rag):
    from llama_index.core.schema import TextNode

    from llama_index.llms.kvrag import KVPrecompute

    _event_loop_runs_while_ingestion_waits_for_room(
        rag, lambda pc: KVPrecompute(pc).acall([TextNode(text=t) for t in DOCS[:2]])
    )


# ---- one model, several threads: length-dependent RoPE ---------------------------------------
def test_longrope_rotary_is_safe_to_call_from_several_threads():
    # LongRoPE picks short or long frequencies by the sequence length and HF writes them into
    # the module's shared buffer before reading them back: a thread rotating a long sequence
    # and one rotating a short one must each get their own tables (kvrag's Arch serialises it).
    from kvrag.arch import Arch

    handle = tiny_llama(
        seed=0,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
        },
    )
    Arch(handle.model)
    rotary = handle.model.model.rotary_emb
    x = torch.zeros(1)
    short, long_ = torch.arange(8)[None], torch.arange(64)[None]
    want_short, want_long = rotary(x, short)[0][0, :8], rotary(x, long_)[0][0, :8]
    assert not torch.equal(want_short, want_long)
    wrong = []

    def work(pos, want):
        for _ in range(1000):
            if not torch.equal(rotary(x, pos)[0][0, :8], want):
                wrong.append(1)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the unprotected race shows at once
    try:
        threads = [threading.Thread(target=work, args=a) for a in [(short, want_short), (long_, want_long)] * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, f"{len(wrong)} of 4000 rotary calls used another thread's frequencies"


LONGROPE = {
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 16,
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
    },
}


@pytest.mark.parametrize("overrides", [{}, LONGROPE], ids=["llama", "llama-longrope"])
def test_threads_sharing_one_kvrag_get_the_sequential_answers(tmp_path, overrides):
    # Short prompts (one passage) and long ones (all of them), several policies, from 4 threads
    # at once; streams abandoned half-way in between must not disturb anyone.
    rag = KVRag(tiny_llama(seed=0, **overrides), cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    prompts = [prompt_for([d], f"Q{i}?") for i, d in enumerate(DOCS)] + [prompt_for(DOCS, "Where?")]
    calls = [(p, pol) for p in prompts for pol in ("cacheblend", "naive_reuse", "full_prefill")]
    want = {c: rag.generate(c[0], policy=c[1], max_new_tokens=8).token_ids for c in calls}

    def run(c):
        abandoned = rag.stream(c[0], policy=c[1], max_new_tokens=8)
        next(abandoned)  # left unfinished: a client that went away
        s = rag.stream(c[0], policy=c[1], max_new_tokens=8)
        text = "".join(s)
        g = rag.generate(c[0], policy=c[1], max_new_tokens=8)
        assert text == g.text
        return c, s.token_ids, g.token_ids

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(run, calls))
    finally:
        sys.setswitchinterval(interval)
    assert [(c, a, b) for c, a, b in got if a != want[c] or b != want[c]] == []


# ---- a cancelled async request stops generating ----------------------------------------------
def _llamaindex_complete(rag):
    from llama_index.llms.kvrag import KVRagLLM

    llm = KVRagLLM(rag, max_new_tokens=64, set_tokenizer=False)
    return llm, lambda: llm.acomplete(prompt_for(DOCS[:2]))


def _llamaindex_chat(rag):
    from llama_index.core.base.llms.types import ChatMessage

    from llama_index.llms.kvrag import KVRagLLM

    llm = KVRagLLM(rag, max_new_tokens=64, set_tokenizer=False)
    return llm, lambda: llm.achat([ChatMessage(role="user", content=prompt_for(DOCS[:2]))])


def _langchain_ainvoke(rag):
    from langchain_core.messages import HumanMessage

    from langchain_kvrag import ChatKVRag

    llm = ChatKVRag(rag=rag, max_new_tokens=64)
    return llm, lambda: llm.ainvoke([HumanMessage(prompt_for(DOCS[:2]))])


@pytest.mark.parametrize(
    "make", [_llamaindex_complete, _llamaindex_chat, _langchain_ainvoke], ids=["acomplete", "achat", "ainvoke"]
)
def test_cancelled_async_call_stops_generating_and_leaves_the_foreground(rag, monkeypatch, make):
    # A client disconnects while its (non-streaming) answer is generated: the task is cancelled
    # while the second decode step runs in the worker thread. The generation must stop after
    # that step (not decode up to max_new_tokens in the background) and the query must leave
    # the precomputer's foreground at once, so ingestion resumes.
    from helpers.streams import GatedStream

    llm, call = make(rag)
    rag.precompute(DOCS[:2])
    pc = Precomputer.for_rag(rag)
    entered, release, closed = threading.Event(), threading.Event(), threading.Event()
    streams = []
    real_stream = rag.stream

    class Gated(GatedStream):
        def close(self):
            self.inner.close()
            closed.set()

    def gated(*a, **k):
        streams.append(Gated(real_stream(*a, **k), entered, release))
        return streams[-1]

    monkeypatch.setattr(rag, "stream", gated)

    async def run():
        task = asyncio.create_task(call())
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        foreground = pc._foreground
        release.set()  # before asyncio.run ends: it waits for its executor's threads
        return foreground

    try:
        assert asyncio.run(run()) == 0
        # Only a failing run waits this long: the step in flight returns at once after release.
        assert closed.wait(15), "the cancelled generation was not closed"
        assert streams[0].calls == 2 and len(streams[0].inner.token_ids) < 64
    finally:
        release.set()
        pc.shutdown(cancel_pending=True, timeout=30)


def test_queries_hold_back_the_precomputer_that_replaced_a_shut_down_one(rag):
    # An LLM's precomputer is shut down (redeploy of the ingestion side) and a hook built on
    # the KVRag creates the new shared one: the LLM's queries must hold back that one, not
    # the dead one they knew.
    from llama_index.llms.kvrag import KVRagLLM

    llm = KVRagLLM(rag, max_new_tokens=2, set_tokenizer=False)
    llm.precomputer.shutdown()
    fresh = Precomputer.for_rag(rag)  # what KVPrecompute(rag) / KVCacheWarmer(rag) resolve to
    seen = []
    real_fuse = rag._fuse  # the prefill itself (the model's work)

    def fuse(*a, **k):
        seen.append(fresh._foreground)
        return real_fuse(*a, **k)

    rag._fuse = fuse
    try:
        llm.complete(prompt_for(DOCS[:1]))
        assert seen == [1]
    finally:
        fresh.shutdown(cancel_pending=True, timeout=30)
