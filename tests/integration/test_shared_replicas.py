"""Replicas sharing one Redis, each replica and worker a separate
process where it matters: chunks ingested through replica A (queued, computed by a
``kvrag worker``) are served from cache on replica B's first query; a worker killed with
SIGKILL mid-job loses nothing and leaves no partial entry; Redis stopped mid-service, flushed
or evicting only costs misses."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers.corpus import DOCS as CORPUS
from helpers.corpus import prompt_for

from kvrag.engine import KVRag
from kvrag.precompute.redis_queue import GROUP, RedisQueue
from kvrag.precompute.worker import Worker
from kvrag.store.redis_store import RedisStore

DOCS = CORPUS[:3]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def _python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _worker(url, prefix, model_dir, cache_dir, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvrag",
            "worker",
            "--redis",
            url,
            "--prefix",
            prefix,
            "--model",
            model_dir,
            "--cache-dir",
            str(cache_dir),
            *extra,
        ],
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(p: subprocess.Popen, timeout=120) -> str:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    return out


REPLICA_A = """
import json, sys
from kvrag.engine import KVRag
from kvrag.frameworks import precomputer_of
from kvrag.store.redis_store import RedisStore
url, prefix, model, cache, docs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
rag = KVRag(model, cache_dir=cache, shared=RedisStore(url, prefix=prefix), precompute_via="queue")
pc = precomputer_of(rag)              # what the LlamaIndex / LangChain ingestion hooks call
keys = [f.result(60) for f in pc.submit_many(docs)]
assert rag.queue.wait(keys, timeout=90), rag.queue.progress()
print(json.dumps({"progress": rag.queue.progress(), "local_entries": rag.store.near.stats()["entries"],
                  "keys": keys}))
"""


def test_replica_b_serves_what_replica_a_queued(redis_url, prefix, model_dir, tmp_path):
    a = _python(REPLICA_A, redis_url, prefix, model_dir, str(tmp_path / "a"), json.dumps(DOCS))
    # The worker: a thread of this process (the CLI's worker runs in the next test).
    w = KVRag(model_dir, cache_dir=tmp_path / "w", shared=RedisStore(redis_url, prefix=prefix))
    stop = threading.Event()
    worker = threading.Thread(target=Worker(w, block_s=0.2).run, args=(stop,), daemon=True)
    worker.start()
    try:
        res = json.loads(_finish(a).strip().splitlines()[-1])
    finally:
        stop.set()
        worker.join(30)
    assert res["local_entries"] == 0  # replica A computed nothing itself
    assert res["progress"]["done"] == len(DOCS) and res["progress"]["queued"] == 0
    # Replica B: a fresh process state (this one), its own empty disk, the same Redis.
    b = KVRag(model_dir, cache_dir=tmp_path / "b", shared=RedisStore(redis_url, prefix=prefix))
    out = b.generate(prompt_for(DOCS), max_new_tokens=8)
    assert out.stats.chunks_hit == len(DOCS) and out.stats.chunks_missed == 0  # hit rate 100 %
    assert b.store.stats()["tiers"]["far_hits"] == len(DOCS)
    # B computed none: its chunks came from Redis (now promoted to its disk).
    b.store.flush()
    assert b.store.near.stats()["entries"] == len(DOCS)
    # The same answer as a replica that computed the chunks itself.
    ref = KVRag(model_dir, cache_dir=tmp_path / "ref")
    ref.precompute(DOCS)
    assert ref.generate(prompt_for(DOCS), max_new_tokens=8).token_ids == out.token_ids
    # A second replica queueing the same documents queues nothing (dedup).
    q = b.queue or RedisQueue.for_store(b.store.far, b.fingerprint)
    before = q.progress()["submitted"]
    q.submit(DOCS, b.ingestor)
    assert q.progress()["submitted"] == before


STALLING_WORKER = """
import sys, time, redis.client
from kvrag.engine import KVRag
from kvrag.precompute.worker import Worker
from kvrag.store.redis_store import RedisStore
url, prefix, model, cache, flag = sys.argv[1:6]
real = redis.client.Pipeline.execute
def execute(self, *a, **k):
    # The transaction that publishes an entry (its parts are written): stall here, to be killed.
    if self.transaction and any(c[0][0] == "PERSIST" for c in self.command_stack):
        open(flag, "w").close()
        time.sleep(600)
    return real(self, *a, **k)
redis.client.Pipeline.execute = execute
rag = KVRag(model, cache_dir=cache, shared=RedisStore(url, prefix=prefix))
Worker(rag, batch=1, claim_idle_s=1).run()
"""


def test_kill9_worker_mid_job_loses_nothing(redis_url, prefix, model_dir, tmp_path, capsys):
    producer = KVRag(
        model_dir, cache_dir=tmp_path / "p", shared=RedisStore(redis_url, prefix=prefix), precompute_via="queue"
    )
    keys = producer.precompute(DOCS)
    flag = tmp_path / "stalled"
    doomed = _python(STALLING_WORKER, redis_url, prefix, model_dir, str(tmp_path / "w1"), str(flag))
    deadline = time.monotonic() + 90
    while not flag.exists():
        assert doomed.poll() is None, doomed.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait()
    far = producer.store.far
    # Its parts are in Redis, but no entry is visible: nothing partial is served.
    assert far.client.keys(far.prefix + "p:*")
    assert all(k not in far and far.get(k, producer.fingerprint) is None for k in keys)
    assert producer.queue.progress()["pending"] == 1
    # Visible to an operator without a model: `kvrag cache stats --shared URL`.
    from kvrag.cli import main

    assert main(["cache", "stats", "--shared", redis_url, "--prefix", prefix, "--json"]) == 0
    (queue,) = json.loads(capsys.readouterr().out)["shared"]["queues"]
    assert queue["queued"] == len(DOCS) and queue["pending"] == 1 and queue["done"] == 0
    _finish(_worker(redis_url, prefix, model_dir, tmp_path / "w2", "--until-idle", "--claim-idle", "1"))
    p = producer.queue.progress()
    assert p["done"] == len(DOCS) and p["queued"] == 0 and p["pending"] == 0 and p["failed"] == 0
    ref = KVRag(model_dir, cache_dir=tmp_path / "ref")
    ref.precompute(DOCS)
    for k in keys:
        got, want = far.get(k, producer.fingerprint), ref.store.get(k, ref.fingerprint)
        assert got is not None and (got.keys == want.keys).all() and (got.values == want.values).all()


def test_redis_stopped_during_queries(own_redis, model_dir, tmp_path, caplog):
    h = KVRag(model_dir, cache_dir=tmp_path / "ref").handle
    a = KVRag(h, cache_dir=tmp_path / "a", shared=RedisStore(own_redis.url, socket_timeout=0.5, retry_s=0.2))
    b = KVRag(
        h, cache_dir=tmp_path / "b", shared=RedisStore(own_redis.url, socket_timeout=0.5, retry_s=0.2), hot_cache=0
    )
    a.precompute(DOCS)
    prompt = prompt_for(DOCS)
    want = a.generate(prompt, policy="full_prefill", max_new_tokens=8).token_ids
    own_redis.stop()
    with caplog.at_level(logging.WARNING, logger="kvrag.store.redis_store"):
        on_a = a.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=8)
        on_b = [b.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=8) for _ in range(3)]
    assert on_a.stats.chunks_hit == len(DOCS) and on_a.token_ids == want  # near tiers serve A
    assert all(o.token_ids == want for o in on_b)  # B computes them: right answers, no error
    down = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(down) == 2  # one per replica (A and B), not one per chunk read or query
    own_redis.start()  # back, empty (no persistence): B reconnects without a restart
    time.sleep(0.3)
    a.precompute(DOCS[:1])  # on A's disk already: not re-sent
    a.store.far.put(a.chunk_key(DOCS[0]), a.store.near.get(a.chunk_key(DOCS[0]), a.fingerprint))
    b.lookup._last_refresh = -1e9
    out = b.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=8)
    assert out.stats.chunks_hit == 1 and out.token_ids == want


def test_flushed_redis_is_misses_then_recomputed(redis_url, prefix, model_dir, tmp_path):
    a = KVRag(model_dir, cache_dir=tmp_path / "a", shared=RedisStore(redis_url, prefix=prefix))
    a.precompute(DOCS)
    b = KVRag(a.handle, cache_dir=tmp_path / "b", shared=RedisStore(redis_url, prefix=prefix), refresh_s=3600)
    b.lookup.refresh()  # B lists them (read before the flush) ...
    assert len(b.segmenter) == len(DOCS)
    client = a.store.far.client
    client.delete(*client.keys(prefix + "*"))  # ... and then Redis loses them (FLUSHDB of this store's keys)
    prompt = prompt_for(DOCS)
    out = b.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=8)
    assert out.stats.chunks_hit == 0 and out.stats.chunks_missed == len(DOCS)
    assert out.token_ids == a.generate(prompt, policy="full_prefill", max_new_tokens=8).token_ids
    b.precompute(DOCS)  # recomputed on demand, shared again
    assert all(a.chunk_key(d) in a.store.far for d in DOCS)


@pytest.mark.slow
def test_example_replicas_llamaindex_over_chroma_server(model_dir, tmp_path):
    """examples/replicas.py: Redis + `chroma run` + a worker + replica A's LlamaIndex pipeline
    (queue) + replica B's query engine, each its own process (~1 min on 2 busy cores)."""
    pytest.importorskip("llama_index.llms.kvrag", reason="the LlamaIndex integration is not installed")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import replicas
    finally:
        sys.path.pop(0)
    if replicas.chroma_binary() is None:
        pytest.skip("the `chroma` CLI (installed with chromadb) is absent")
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "replicas.py"),
            "--model",
            model_dir,
            "--workdir",
            str(tmp_path),
        ],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = (json.loads(line) for line in r.stdout.splitlines() if line.startswith("{"))
    assert a["drained"] and a["computed_locally"] == 0 and a["queue"]["done"] == a["nodes"] > 0
    assert a["queue"]["failed"] == 0 and a["queue"]["queued"] == 0
    assert b["chunks_hit"] > 0 and b["chunks_missed"] == 0 and b["hit_rate"] == 1.0
    assert b["from_redis"] == b["local_entries"] > 0  # every chunk B used came through Redis


def test_worker_publishes_a_chunk_it_only_has_on_its_own_disk(redis_url, prefix, model_dir, tmp_path):
    """Redis lost the chunks (flushed, or a new prefix) while a worker's disk still has them:
    its jobs copy them up rather than being left pending for ever."""
    local = KVRag(model_dir, cache_dir=tmp_path / "w")
    local.precompute(DOCS)  # on the worker's disk only
    w = KVRag(local.handle, cache_dir=tmp_path / "w", shared=RedisStore(redis_url, prefix=prefix))
    producer = KVRag(
        local.handle, cache_dir=tmp_path / "p", shared=RedisStore(redis_url, prefix=prefix), precompute_via="queue"
    )
    keys = producer.precompute(DOCS)
    stop = threading.Event()
    t = threading.Thread(target=Worker(w, block_s=0.2).run, args=(stop,), daemon=True)
    t.start()
    try:
        assert producer.queue.wait(keys, timeout=30), producer.queue.progress()
    finally:
        stop.set()
        t.join(30)
    assert producer.queue.progress()["done"] == len(DOCS)
    for k in keys:
        got, want = producer.store.far.get(k, producer.fingerprint), local.store.get(k, local.fingerprint)
        assert got is not None and (got.keys == want.keys).all()


def test_queue_submit_work_dedup_and_takeover(any_url, prefix, model_dir, tmp_path):
    """The queue on one server and on a real Redis Cluster: jobs are queued once (dedup),
    a worker computes them into the shared store and acknowledges them (one transaction over
    the stream, its counters and the claim: one slot), and a job a dead consumer read is taken
    over (XAUTOCLAIM)."""
    w = KVRag(model_dir, cache_dir=tmp_path / "w", shared=RedisStore(any_url, prefix=prefix))
    producer = KVRag(
        w.handle, cache_dir=tmp_path / "p", shared=RedisStore(any_url, prefix=prefix), precompute_via="queue"
    )
    q = producer.queue
    keys = producer.precompute(DOCS[:2])
    assert q.submit(DOCS[:2], producer.ingestor) == keys  # claimed already: not queued again
    assert q.progress()["queued"] == 2 and q.progress()["submitted"] == 2
    worker = Worker(w, block_s=0.1)
    for _ in range(20):
        if worker.step() and worker.done == 2:
            break
    p = q.progress()
    assert p["done"] == 2 and p["queued"] == 0 and p["pending"] == 0
    assert all(producer.store.far.get(k, producer.fingerprint) is not None for k in keys)
    assert not q.client.exists(q.claim_prefix + keys[0])  # the claim is released with the job
    q.submit(DOCS[:2], producer.ingestor)  # stored now: nothing queued
    assert q.progress()["submitted"] == 2
    # A consumer reads the third job and dies: another worker takes it over.
    (key3,) = q.submit(DOCS[2:3], producer.ingestor)
    assert q.client.xreadgroup(GROUP, "dead", {q.stream: ">"}, count=1)
    assert q.progress()["pending"] == 1
    taker = Worker(w, block_s=0.1, claim_idle_s=0)
    assert taker.step() == 1
    assert q.progress()["pending"] == 0 and q.progress()["done"] == 3 and key3 in producer.store.far


def test_chunks_stored_locally_during_an_outage_are_pushed_up_later(own_redis, model_dir, tmp_path, caplog):
    """Redis down while replica A precomputes: the chunks go to A's disk only. Redis comes back
    (empty: no persistence); once A sees it again they are pushed up in the background, and a
    second replica with an empty disk reads them from Redis."""
    a = KVRag(model_dir, cache_dir=tmp_path / "a", shared=RedisStore(own_redis.url, socket_timeout=0.5, retry_s=0.2))
    own_redis.stop()
    keys = a.precompute(DOCS[:2])
    tiers = a.store.stats()["tiers"]
    assert tiers["far_write_failures"] == 2 and tiers["unsynced"] == 2
    own_redis.start()
    time.sleep(0.3)  # past retry_s
    with caplog.at_level(logging.WARNING):
        a.lookup.refresh()  # any command reaching Redis: here the index refresh of the query path
        a.store.flush()
    tiers = a.store.stats()["tiers"]
    assert tiers["pushed_after_outage"] == 2 and tiers["unsynced"] == 0
    assert any("pushed 2 chunk" in r.getMessage() for r in caplog.records)
    b = KVRag(a.handle, cache_dir=tmp_path / "b", shared=RedisStore(own_redis.url))
    assert set(b.store.far.texts(b.fingerprint)) == set(keys)
    for k in keys:
        assert b.store.get(k, b.fingerprint) is not None
    assert b.store.stats()["tiers"]["far_hits"] == 2
