"""Precomputer: background queue + worker on a tiny random-weight model (real SmolLM2 tokenizer)."""

import logging
import threading
import time

import pytest
import torch
from helpers.corpus import DOCS, prompt_for

from kvrag.checks import validate_chunk_text
from kvrag.engine import KVRag
from kvrag.errors import ChunkError
from kvrag.precompute import Precomputer, PrecomputerClosedError, QueueFullError
from kvrag.store import DiskStore, make_key


@pytest.fixture
def rag(handle, tmp_path):
    return KVRag(handle, cache_dir=tmp_path / "kv", policy="naive_reuse")


@pytest.fixture
def pc(rag):
    p = Precomputer(rag, batch_tokens=64)
    yield p
    p.shutdown(cancel_pending=True, timeout=10)


def test_submit_returns_at_once_and_queries_hit(rag, pc, monkeypatch):
    threads = []
    real = rag.precompute

    def spy(*a, **kw):
        threads.append(threading.get_ident())
        return real(*a, **kw)

    monkeypatch.setattr(rag, "precompute", spy)
    futs = [pc.submit(d) for d in DOCS]
    assert pc.wait_until_idle(timeout=60)
    # The model work ran, and never on the caller's thread.
    assert threads and threading.get_ident() not in threads
    keys = [f.result(timeout=1) for f in futs]
    assert keys == [rag.chunk_key(d) for d in DOCS]
    assert all(k in rag.store for k in keys)
    p = pc.progress()
    assert (
        p.computed == 4 and p.failed == 0 and p.idle and p.tokens_computed == sum(len(rag.chunk_ids(d)) for d in DOCS)
    )
    # The segmenter was updated in-process: the next query finds every chunk.
    out = rag.generate(prompt_for(DOCS), max_new_tokens=2)
    assert out.stats.chunks_hit == 4


def test_dedup_by_text_and_store(rag, pc):
    with pc.foreground():  # hold the worker so the duplicates meet the queued job
        a = pc.submit(DOCS[0])
        b = pc.submit(DOCS[0])
        pc.submit(DOCS[1])
        assert a is b
    assert pc.wait_until_idle(timeout=60)
    assert a.result() == rag.chunk_key(DOCS[0])
    pc.submit(DOCS[0])  # already stored: nothing computed again
    assert pc.wait_until_idle(timeout=60)
    p = pc.progress()
    assert (p.submitted, p.deduplicated, p.computed, p.already_cached) == (3, 1, 2, 1)


def test_packs_respect_batch_tokens_and_report_progress(rag, monkeypatch):
    packs, seen = [], []
    real = rag.precompute

    def spy(texts, **kw):
        packs.append([len(rag.chunk_ids(t)) for t in texts])
        return real(texts, **kw)

    monkeypatch.setattr(rag, "precompute", spy)
    lens = [len(rag.chunk_ids(d)) for d in DOCS]
    budget = max(lens) + 1  # any two chunks overflow it
    pc = Precomputer(rag, batch_tokens=budget, on_progress=seen.append, start=False)
    for d in DOCS:
        pc.submit(d)
    pc.start()
    assert pc.wait_until_idle(timeout=60)
    pc.shutdown()
    assert sorted(n for p in packs for n in p) == sorted(lens)
    assert all(sum(p) <= budget for p in packs) and len(packs) == 4
    assert seen and seen[-1].computed == 4


def test_back_pressure(rag):
    pc = Precomputer(rag, max_queued=2, start=False)
    pc.submit(DOCS[0])
    pc.submit(DOCS[1])
    with pytest.raises(QueueFullError, match="full"):
        pc.submit(DOCS[2], block=False)
    t0 = time.perf_counter()
    with pytest.raises(QueueFullError, match="after 0.2s"):
        pc.submit(DOCS[2], timeout=0.2)
    assert time.perf_counter() - t0 >= 0.2  # it waited for room (the clock only moves forward)
    assert pc.progress().dropped == 2 and pc.progress().queued == 2
    # Ingestion hooks' mode: a full queue drops and counts each text, the rest are tried.
    with pytest.raises(QueueFullError):
        pc.submit_many([DOCS[2], DOCS[0]], block=False)
    assert pc.submit_many([DOCS[2], DOCS[0], "extra text"], block=False, skip_full=True)[::2] == [None, None]
    assert pc.progress().dropped == 5 and pc.progress().queued == 2
    # A blocked submit goes through as soon as the worker makes room.
    done = []
    th = threading.Thread(target=lambda: done.append(pc.submit(DOCS[2])))
    th.start()
    time.sleep(0.2)
    assert not done  # still blocked
    pc.start()
    th.join(30)
    assert done
    assert pc.wait_until_idle(timeout=60)
    assert pc.progress().computed == 3
    pc.shutdown()


def test_bad_input_is_rejected_clearly(rag, pc, caplog):
    with pytest.raises(ChunkError, match="empty"):
        pc.submit("   \n")
    with pytest.raises(ChunkError, match="decode bytes first"):
        pc.submit(b"bytes are not text")
    with pytest.raises(ChunkError, match="unpaired surrogate"):
        pc.submit("bad \udcff byte")
    assert pc.progress().rejected == 3
    assert pc.submit_many(["", DOCS[0]], skip_invalid=True)[0] is None
    # Too long for the model (context 4096): found by the worker, logged, counted, kept.
    huge = "lorem ipsum dolor " * 3000
    with caplog.at_level(logging.ERROR, logger="kvrag.precompute"):
        fut = pc.submit(huge)
        assert pc.wait_until_idle(timeout=60)
    with pytest.raises(ChunkError, match="exceeds the model context"):
        fut.result()
    assert pc.progress().failed == 1
    (f,) = pc.failures()
    assert f.text == huge and not f.retryable and "exceeds" in f.message
    assert any("exceeds the model context" in r.getMessage() for r in caplog.records)


def test_odd_unicode_is_cached_and_found(rag, pc):
    odd = [
        "Caf\u00e9 cre\u0300me, na\u00efve \u2014 \U0001f680 emoji and \u200bzero-width space.",
        "\u05e9\u05dc\u05d5\u05dd right-to-left text with a \ufeffBOM and a NUL\x00 char.",
        "e\u0301 decomposed accent vs \u00e9 composed; CJK \u6f22\u5b57; math \U0001d4b3.",
    ]
    pc.submit_many(odd)
    assert pc.wait_until_idle(timeout=60)
    assert pc.progress().computed == 3
    out = rag.generate(prompt_for(odd, "Which emoji?"), max_new_tokens=2)
    assert out.stats.chunks_hit == 3


def test_store_failure_is_surfaced_and_retryable(rag, pc, monkeypatch, caplog):
    real_put = rag.store.put

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rag.store, "put", broken)
    with caplog.at_level(logging.ERROR, logger="kvrag.precompute"):
        futs = pc.submit_many(DOCS[:3])
        assert pc.wait_until_idle(timeout=60)
    for f in futs:
        with pytest.raises(OSError, match="No space"):
            f.result()
    p = pc.progress()
    assert p.failed == 3 and p.computed == 0
    assert sorted(f.text for f in pc.failures()) == sorted(DOCS[:3])  # nothing lost
    assert all(f.retryable for f in pc.failures())
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 3
    # The query path is unaffected: nothing cached, the prompt is computed in full.
    assert rag.generate(prompt_for(DOCS), max_new_tokens=2).stats.chunks_hit == 0
    monkeypatch.setattr(rag.store, "put", real_put)
    pc.retry_failed()
    assert pc.wait_until_idle(timeout=60)
    assert pc.progress().computed == 3 and not pc.failures()
    assert all(rag.is_cached(d) for d in DOCS[:3])


def test_worker_survives_a_failing_pack(rag, pc, monkeypatch):
    real = rag.precompute
    calls = {"n": 0}

    def flaky(texts, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(texts, **kw)

    monkeypatch.setattr(rag, "precompute", flaky)
    f1 = pc.submit(DOCS[0])
    assert pc.wait_until_idle(timeout=60)
    with pytest.raises(RuntimeError, match="boom"):
        f1.result()
    f2 = pc.submit(DOCS[1])
    assert pc.wait_until_idle(timeout=60)
    assert f2.result() == rag.chunk_key(DOCS[1])


def test_one_bad_chunk_does_not_sink_its_pack(rag, monkeypatch):
    real = rag.precompute

    def picky(texts, **kw):
        if DOCS[1] in texts:
            raise ValueError("cannot store this one")
        return real(texts, **kw)

    monkeypatch.setattr(rag, "precompute", picky)
    pc = Precomputer(rag, batch_tokens=10_000, start=False)
    futs = pc.submit_many(DOCS)
    pc.start()
    assert pc.wait_until_idle(timeout=60)
    pc.shutdown()
    assert [f.exception() is None for f in futs] == [True, False, True, True]
    assert pc.progress().computed == 3 and pc.progress().failed == 1


def test_foreground_defers_new_packs(rag):
    pc = Precomputer(rag, max_defer_s=600)
    with pc.foreground():
        pc.submit(DOCS[0])
        time.sleep(0.4)
        assert pc.progress().queued == 1 and pc.progress().computed == 0
    # Far below max_defer_s: only leaving the foreground can have released the pack.
    assert pc.wait_until_idle(timeout=20)
    assert pc.progress().computed == 1
    pc.shutdown()
    # A stream of queries cannot starve ingestion: after max_defer_s a pack runs anyway.
    pc2 = Precomputer(rag, max_defer_s=0.2)
    with pc2.foreground():
        pc2.submit(DOCS[1])
        assert pc2.wait_until_idle(timeout=60)
    pc2.shutdown()


def test_shutdown_drains_acknowledged_work(rag):
    pc = Precomputer(rag, batch_tokens=32)
    futs = pc.submit_many(DOCS)
    assert pc.shutdown() == []  # waits for everything queued
    assert all(f.result(timeout=0) for f in futs)
    assert all(rag.is_cached(d) for d in DOCS)
    with pytest.raises(PrecomputerClosedError):
        pc.submit("Another document entirely.")
    assert pc.wait_until_idle(timeout=1)


def test_shutdown_cancel_hands_back_pending(rag):
    pc = Precomputer(rag, start=False)
    futs = pc.submit_many(DOCS)
    left = pc.shutdown(cancel_pending=True)
    assert left == DOCS  # handed back, in order: nothing silently dropped
    assert all(f.cancelled() for f in futs)
    assert not any(rag.is_cached(d) for d in DOCS)


def test_wait_until_idle_never_hangs_without_worker(rag):
    pc = Precomputer(rag, start=False)
    assert pc.wait_until_idle(timeout=0.1)  # nothing queued: idle
    pc.submit(DOCS[0])
    with pytest.raises(RuntimeError, match="no precompute worker"):
        pc.wait_until_idle(timeout=1)
    pc.shutdown(cancel_pending=True)


def test_shared_instance_and_resolution(rag):
    from kvrag.frameworks import precomputer_of

    a = Precomputer.for_rag(rag)
    assert Precomputer.for_rag(rag) is a
    assert precomputer_of(rag) is a and precomputer_of(a) is a

    class Adapter:
        precomputer = a

    assert precomputer_of(Adapter()) is a
    with pytest.raises(TypeError, match="expected a Precomputer"):
        precomputer_of(object())
    a.shutdown()
    b = Precomputer.for_rag(rag)  # a closed one is replaced
    assert b is not a and not b.closed
    b.shutdown()


def test_queries_stay_exact_while_the_worker_runs(rag):
    """The worker's forward passes share the model with a query; neither corrupts the other."""
    rag.precompute(DOCS[:2])
    prompt = prompt_for(DOCS[:2])
    ref = rag.generate(prompt, policy="full_prefill", max_new_tokens=6)
    reuse = rag.generate(prompt, max_new_tokens=6)
    pc = Precomputer(rag, batch_tokens=16, defer_to_queries=False)
    pc.submit_many([f"Filler passage number {i} about nothing in particular." for i in range(30)])
    for _ in range(2):
        assert rag.generate(prompt, policy="full_prefill", max_new_tokens=6).token_ids == ref.token_ids
        assert rag.generate(prompt, max_new_tokens=6).token_ids == reuse.token_ids
    assert pc.wait_until_idle(timeout=120)
    pc.shutdown()
    stored = [f"Filler passage number {i} about nothing in particular." for i in range(30)]
    # What the worker stored is exactly what a synchronous precompute stores.
    k = rag.chunk_key(stored[7])
    e = rag.store.get(k, rag.fingerprint)
    ref_rag = KVRag(rag.handle, cache_dir=rag.store.directory.parent / "ref", policy="naive_reuse")
    ref_rag.precompute([stored[7]])
    e2 = ref_rag.store.get(k, rag.fingerprint)
    torch.testing.assert_close(e.keys.float(), e2.keys.float(), atol=2e-3, rtol=2e-3)


def test_num_threads_applies_to_the_worker_only(rag):
    before = torch.get_num_threads()
    seen = {}
    pc = Precomputer(rag, num_threads=1, on_progress=lambda p: seen.setdefault("n", torch.get_num_threads()))
    pc.submit(DOCS[0])
    assert pc.wait_until_idle(timeout=60)
    pc.shutdown()
    assert seen["n"] == 1
    assert torch.get_num_threads() == before
    fresh = {}
    t = threading.Thread(target=lambda: fresh.setdefault("n", torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh["n"] == before  # threads created later keep the default too


def test_validate_chunk_text():
    assert validate_chunk_text("ok") == "ok"
    with pytest.raises(ChunkError, match="must be a str, got int"):
        validate_chunk_text(3)


def test_constructor_rejects_bad_arguments(rag):
    with pytest.raises(ValueError, match="batch_tokens"):
        Precomputer(rag, batch_tokens=0, start=False)
    with pytest.raises(ValueError, match="num_threads"):
        Precomputer(rag, num_threads=0, start=False)
    with pytest.raises(TypeError, match="needs a KVRag"):
        Precomputer(object(), start=False)


def test_same_key_from_two_workers_is_computed_once(rag, monkeypatch):
    calls = []
    real = rag.precompute
    monkeypatch.setattr(rag, "precompute", lambda texts, **kw: (calls.extend(texts), real(texts, **kw))[1])
    pc = Precomputer(rag, workers=2, batch_tokens=16, start=False)
    futs = pc.submit_many(DOCS + DOCS[::-1])  # duplicates by text: merged at submit
    pc.start()
    assert pc.wait_until_idle(timeout=60)
    pc.shutdown()
    assert sorted(calls) == sorted(DOCS)
    assert {f.result() for f in futs} == {make_key(rag.fingerprint, rag.chunk_ids(d)) for d in DOCS}


# ---- kvrag cache stats|gc|clear -------------------------------------------------------------
def _cli(argv, capsys):
    from kvrag.cli import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_cache_stats_gc_clear(rag, capsys):
    import json

    rag.precompute(DOCS)
    d = str(rag.store.directory)
    code, out, _ = _cli(["cache", "stats", "--cache-dir", d, "--json"], capsys)
    st = json.loads(out)
    assert code == 0 and st["entries"] == 4 and st["bytes"] > 0
    code, out, _ = _cli(["cache", "stats", "--cache-dir", d], capsys)
    assert code == 0 and "entries     4" in out
    # gc down to a limit that holds about two entries evicts the rest.
    per_entry = st["bytes"] // 4
    code, out, _ = _cli(
        ["cache", "gc", "--cache-dir", d, "--size-limit", str(per_entry * 2 + per_entry // 2), "--verify", "--json"],
        capsys,
    )
    res = json.loads(out)
    assert code == 0 and res["evicted"] >= 2 and res["entries"] == 4 - res["evicted"] and res["corrupt"] == 0
    # That limit is now the store's: stats shows it and a gc without --size-limit keeps it.
    limit = per_entry * 2 + per_entry // 2
    assert json.loads(_cli(["cache", "stats", "--cache-dir", d, "--json"], capsys)[1])["size_limit"] == limit
    code, out, _ = _cli(["cache", "gc", "--cache-dir", d, "--json"], capsys)
    assert code == 0 and json.loads(out)["size_limit"] == limit and json.loads(out)["evicted"] == 0
    code, _, err = _cli(["cache", "clear", "--cache-dir", d], capsys)  # stdin is not a tty under pytest
    assert code == 2 and "without --yes" in err
    code, out, _ = _cli(["cache", "clear", "--cache-dir", d, "--yes"], capsys)
    assert code == 0 and "cleared" in out
    assert json.loads(_cli(["cache", "stats", "--cache-dir", d, "--json"], capsys)[1])["entries"] == 0


def test_cli_cache_errors_are_clear(tmp_path, capsys):
    code, _, err = _cli(["cache", "stats", "--cache-dir", str(tmp_path / "missing")], capsys)
    assert code == 2 and "no KV store at" in err
    assert not (tmp_path / "missing").exists()  # stats never creates a store
    (tmp_path / "plain").mkdir()
    code, _, err = _cli(["cache", "gc", "--cache-dir", str(tmp_path / "plain")], capsys)
    assert code == 2 and "not a kvrag KV store" in err
    code, _, err = _cli(["cache", "gc", "--cache-dir", str(tmp_path / "plain"), "--size-limit", "lots"], capsys)
    assert code == 2 and "bad size" in err


def test_parse_size():
    from kvrag.cli.cache import MAX_SIZE, parse_size

    assert parse_size("512M") == 512 * 2**20 and parse_size("1.5G") == int(1.5 * 2**30) and parse_size("10") == 10
    with pytest.raises(ValueError):
        parse_size("-1G")
    # An upper bound: the limit is an SQLite INTEGER (signed 64-bit); no OverflowError either.
    assert parse_size(str(2**63 - 1)) == MAX_SIZE == 2**63 - 1
    for huge in (str(2**63), "99999999999999999999999T", "1" + "0" * 400):
        with pytest.raises(ValueError, match="too large"):
            parse_size(huge)


def _store(tmp_path):

    d = tmp_path / "store"
    DiskStore(d).close()
    return str(d)


def test_cli_cache_gc_huge_size_limit_is_a_clear_error(tmp_path, capsys):
    code, _, err = _cli(
        ["cache", "gc", "--cache-dir", _store(tmp_path), "--size-limit", "99999999999999999999999T"], capsys
    )
    assert code == 2 and err.startswith("kvrag: error: ") and "too large" in err and "Traceback" not in err


def test_cli_cache_gc_prints_check_warnings(tmp_path, capsys):
    d = _store(tmp_path)
    code, out, _ = _cli(["cache", "gc", "--cache-dir", d], capsys)
    assert code == 0 and "check warnings   0 (not checked: use --verify)" in out
    code, out, _ = _cli(["cache", "gc", "--cache-dir", d, "--verify"], capsys)
    assert code == 0 and "check warnings   0\n" in out


@pytest.mark.parametrize("answer", [EOFError, KeyboardInterrupt, "n"])
def test_cli_cache_clear_eof_or_interrupt_at_the_prompt_is_a_no(rag, capsys, monkeypatch, answer):
    import builtins

    rag.precompute(DOCS[:1])
    d = str(rag.store.directory)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)

    def reply(prompt=""):
        if isinstance(answer, str):
            return answer
        raise answer

    monkeypatch.setattr(builtins, "input", reply)
    code, out, err = _cli(["cache", "clear", "--cache-dir", d], capsys)
    assert code == 1 and "aborted" in out and "Traceback" not in err
    assert rag.store.stats()["entries"] == 1  # nothing deleted


def test_defer_s_holds_work_until_the_query_ends(rag):
    pc = Precomputer(rag)
    pc.submit(DOCS[0], defer_s=600)  # a retriever hook, just before the LLM call
    time.sleep(0.3)
    assert pc.progress().queued == 1  # held although no query is running yet
    with pc.foreground():  # the LLM call
        time.sleep(0.2)
        assert pc.progress().queued == 1
    assert pc.wait_until_idle(timeout=20)  # released when the query ended, not after 600 s
    pc.submit(DOCS[1], defer_s=0.2)  # no query follows: the hold expires by itself
    assert pc.wait_until_idle(timeout=30)
    assert pc.progress().computed == 2
    pc.shutdown()


def test_a_hold_no_query_comes_for_is_lifted_by_wait_until_idle_and_shutdown(rag):
    """Retrieval-only use (a search endpoint, retrieval evaluation): the hook's hold waits for
    an LLM call that never comes. Waiting for idle, shutting down or exiting must not wait it out."""
    pc = Precomputer(rag)
    pc.submit(DOCS[0], defer_s=600)
    time.sleep(0.3)
    assert pc.progress().queued == 1  # held
    assert pc.wait_until_idle(timeout=20)  # lifted, not 600 s
    pc.submit(DOCS[1], defer_s=600)
    time.sleep(0.3)
    assert pc.progress().queued == 1
    t0 = time.monotonic()
    assert pc.shutdown(timeout=20) == []  # drains: the hold is lifted, nothing handed back
    assert time.monotonic() - t0 < 20 and pc.progress().computed == 2


# ---- shutdown / exit: nothing acknowledged dies with the daemon workers ----------------------
_CHILD = """
import json, sys, threading, time
import torch
torch.set_num_threads(1)
from kvrag.engine import KVRag
from kvrag.precompute import Precomputer
from kvrag.testing import tiny_llama
cfg = json.loads(sys.argv[2])
rag = KVRag(tiny_llama(seed=0), cache_dir=sys.argv[1], policy="naive_reuse")
texts = cfg["texts"]
real = rag.precompute
entered = threading.Event()
def slow(batch, **kw):  # each pack takes a while: the process exits with work left
    entered.set()
    time.sleep(cfg["slow_s"])
    return real(batch, **kw)
rag.precompute = slow
"""


def _run_child(rag, body, **cfg):
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _CHILD + body, str(rag.store.directory), json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_shutdown_nowait_still_drains_before_exit(rag):
    body = """
pc = Precomputer(rag, batch_tokens=8)  # one text per pack
pc.submit_many(texts)
print("returned", pc.shutdown(wait=False))
"""
    r = _run_child(rag, body, texts=DOCS, slow_s=0.3)
    assert "returned []" in r.stdout
    assert [rag.is_cached(d) for d in DOCS] == [True] * 4  # the exit hook waited for the queue
    assert set(rag.store.texts(rag.fingerprint).values()) == set(DOCS)


def test_shutdown_timeout_finishes_the_pack_in_flight_before_exit(rag):
    import json

    # DOCS[0] is computed, DOCS[1] overflows the pack (carried: in flight too), DOCS[2:] wait.
    budget = max(len(rag.chunk_ids(d)) for d in DOCS[:2]) + 1
    body = """
pc = Precomputer(rag, batch_tokens=cfg["budget"], start=False)
futs = pc.submit_many(texts)
pc.start()
assert entered.wait(30)
left = pc.shutdown(timeout=0.05)
print("LEFT", json.dumps(left), pc.progress().in_flight)
"""
    r = _run_child(rag, body, texts=DOCS, slow_s=1.0, budget=budget)
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("LEFT ")]
    left, in_flight = line[5:].rsplit(" ", 1)
    assert json.loads(left) == DOCS[2:] and in_flight == "2"  # queued texts handed back
    # ... and the in-flight ones were neither handed back nor lost: stored before exit.
    assert [rag.is_cached(d) for d in DOCS] == [True, True, False, False]


def test_exit_without_drain_still_finishes_the_pack_in_flight(rag):
    budget = max(len(rag.chunk_ids(d)) for d in DOCS[:2]) + 1
    body = """
pc = Precomputer(rag, batch_tokens=cfg["budget"], drain_on_exit=False, start=False)
pc.submit_many(texts)
pc.start()
assert entered.wait(30)
"""
    r = _run_child(rag, body, texts=DOCS, slow_s=1.0, budget=budget)
    assert [rag.is_cached(d) for d in DOCS] == [True, True, False, False]
    assert "2 queued chunk(s) were not precomputed at exit" in r.stderr  # dropped, not silently


# ---- bad arguments ------------------------------------------------------------------------
def test_submit_many_rejects_a_single_text(rag):
    pc = Precomputer(rag, start=False)
    for bad in ("Kelvar", b"Kelvar", bytearray(b"Kelvar")):
        with pytest.raises(TypeError, match=f"iterable of texts, got a single {type(bad).__name__}"):
            pc.submit_many(bad, skip_invalid=True)
    with pytest.raises(TypeError, match="iterable of texts, got int"):
        pc.submit_many(3)
    assert pc.progress().submitted == 0 and pc.progress().queued == 0  # nothing queued
    with pytest.raises(ChunkError, match="got list: submit\\(\\) takes one text; use submit_many"):
        pc.submit(DOCS[:2])
    with pytest.raises(ChunkError, match="must be a str, got int"):
        pc.submit(3)
    assert pc.progress().rejected == 2
    assert len(pc.submit_many(iter(DOCS[:2]))) == 2  # any iterable of texts is fine
    pc.shutdown(cancel_pending=True)


# ---- a writer killed between the blob and the text-index write -----------------------------------
def test_resubmit_relists_a_chunk_missing_from_the_text_index(rag, monkeypatch, caplog):
    def killed(*a, **k):  # what `kill -9` between DiskStore.put's two writes leaves behind
        raise SystemExit("killed")

    monkeypatch.setattr(rag.store._index, "set", killed)
    with pytest.raises(SystemExit):
        rag.precompute([DOCS[0]])
    monkeypatch.undo()
    key = rag.chunk_key(DOCS[0])
    assert key in rag.store and key not in rag.store.texts(rag.fingerprint)
    other = KVRag(rag.handle, cache_dir=rag.store.directory, policy="naive_reuse")  # another process
    assert other.generate(prompt_for(DOCS[:1]), max_new_tokens=1).stats.chunks_hit == 0

    pc = Precomputer(rag)  # the ingestion job runs again
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        assert pc.submit(DOCS[0]).result(timeout=60) == key
        assert pc.submit(DOCS[1]).result(timeout=60) == rag.chunk_key(DOCS[1])
    pc.shutdown()
    p = pc.progress()
    assert (p.already_cached, p.computed, p.failed) == (1, 1, 0)  # re-listed, not recomputed
    assert rag.store.texts(rag.fingerprint) == {key: DOCS[0], rag.chunk_key(DOCS[1]): DOCS[1]}
    assert any("not listed in the text index" in r.getMessage() for r in caplog.records)
    fresh = KVRag(rag.handle, cache_dir=rag.store.directory, policy="naive_reuse")
    assert fresh.generate(prompt_for(DOCS[:2]), max_new_tokens=1).stats.chunks_hit == 2

    # KVRag.precompute re-lists such a chunk the same way, without recomputing it.
    monkeypatch.setattr(rag.store._index, "set", killed)
    with pytest.raises(SystemExit):
        rag.precompute([DOCS[2]])
    monkeypatch.undo()
    key2 = rag.chunk_key(DOCS[2])
    assert key2 not in rag.store.texts(rag.fingerprint)
    monkeypatch.setattr("kvrag.precompute.ingest.compute_chunk_kv", lambda *a, **k: pytest.fail("recomputed"))
    assert rag.precompute([DOCS[2]]) == [key2]
    assert rag.store.texts(rag.fingerprint)[key2] == DOCS[2]
