"""Workers serve the replicas that exist, on a real Redis: a model has several cache
fingerprints (the base model's, its KVLink-adapted copy's), each its own precompute stream.
A worker serves every one its model can produce, so a replica whose policy is not the
worker's still gets its chunks; a stream no worker serves is an error naming the command
that serves it (never a wait forever), a warning at a replica's start, a worker's log line
and a line of ``kvrag cache stats --shared``."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
from helpers.corpus import DOCS as CORPUS

from kvrag.cli import main as cli_main
from kvrag.engine import KVRag
from kvrag.model import ModelHandle
from kvrag.policies.kvlink.adapter import FORMAT_VERSION, adapter_key, save_adapter
from kvrag.precompute.redis_queue import QueueUnserved
from kvrag.precompute.worker import Worker
from kvrag.store.redis_store import RedisStore

DOCS = CORPUS[:2]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def kvlink_home(model_dir, tmp_path, monkeypatch):
    """A kvrag home holding a KVLink adapter with LoRA weights for the tiny model, found by
    default as SmolLM2's shipped one is: a replica built for ``kvlink`` runs the adapted copy
    (another cache fingerprint), one built for any other policy the base model."""
    from peft import LoraConfig, get_peft_model

    handle = ModelHandle.load(model_dir)
    out = tmp_path / "home" / "kvlink" / adapter_key(handle)
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj"])
    with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(copy.deepcopy(handle.model), cfg)
    links = handle.model.get_input_embeddings().weight.detach().float().mean(0).expand(2, 2, -1).clone()
    save_adapter(
        out, links, peft_model, {"format": FORMAT_VERSION, "base_key": adapter_key(handle), "lora": {"rank": 2}}
    )
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    return handle


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def test_a_worker_serves_replicas_of_every_policy(redis_url, prefix, model_dir, kvlink_home, tmp_path):
    """The documented minimal set-up with a model whose default runs its KVLink adapter: the
    worker's policy (kvlink, as ``auto`` is for SmolLM2) is not the replica's (cacheblend).
    One ``kvrag worker`` computes the chunks of both."""
    replica = KVRag(
        kvlink_home,
        cache_dir=tmp_path / "r",
        shared=RedisStore(redis_url, prefix=prefix),
        precompute_via="queue",
        policy="cacheblend",
    )
    adapted = KVRag(
        kvlink_home,
        cache_dir=tmp_path / "k",
        shared=RedisStore(redis_url, prefix=prefix),
        precompute_via="queue",
        policy="kvlink",
    )
    assert replica.fingerprint != adapted.fingerprint  # two streams
    worker = subprocess.Popen(
        [sys.executable, "-m", "kvrag", "worker", "--redis", redis_url, "--prefix", prefix]
        + ["--model", model_dir, "--cache-dir", str(tmp_path / "w"), "--policy", "kvlink"],
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        keys = replica.precompute(DOCS)
        assert replica.queue.wait(keys, timeout=240, no_consumer_s=120), replica.queue.stats()
        kv_keys = adapted.precompute(DOCS[:1])
        assert adapted.queue.wait(kv_keys, timeout=60), adapted.queue.stats()
    finally:
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err[-3000:]
    assert replica.queue.stream in out and adapted.queue.stream in out, out  # it said what it serves
    assert "3 job(s) done" in out, out
    for k in keys:
        assert replica.store.far.get(k, replica.fingerprint) is not None
    assert adapted.store.far.get(kv_keys[0], adapted.fingerprint) is not None
    # A clean stop leaves no live worker behind: the streams say so at once.
    assert replica.queue.live_workers() == [] and adapted.queue.live_workers() == []


def test_a_stream_no_worker_serves_is_an_error_a_warning_and_a_stats_line(
    redis_url, prefix, model_dir, kvlink_home, tmp_path, caplog, capsys
):
    """The break as it was: a worker serving only its own policy's fingerprint (``--serve
    policy``: the adapted model's) and a cacheblend replica. The replica is warned at start,
    its wait raises within its bounded no-consumer time naming the stream, the fingerprint
    and the command, the worker logs the stream it does not serve, and ``kvrag cache stats
    --shared`` lists both streams with their consumers, backlog and oldest job's age."""
    url_store = RedisStore(redis_url, prefix=prefix)
    kv = KVRag(kvlink_home, cache_dir=tmp_path / "w", shared=url_store, policy="kvlink")
    worker = Worker(kv, name="kvlink-only", block_s=0.1, heartbeat_s=0.2, unserved_check_s=0.2)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvrag.precompute.redis_queue"):
            replica = KVRag(
                kvlink_home,
                cache_dir=tmp_path / "r",
                shared=RedisStore(redis_url, prefix=prefix),
                precompute_via="queue",
                policy="cacheblend",
            )
        q = replica.queue
        start_warning = [r.getMessage() for r in caplog.records if q.stream in r.getMessage()]
        assert start_warning and "no kvrag worker serves" in start_warning[0]
        assert f"--model {model_dir}" in q.worker_command  # a command that serves it
        keys = replica.precompute(DOCS)
        t0 = time.monotonic()
        with pytest.raises(QueueUnserved) as err:
            q.wait(keys, no_consumer_s=2.0)
        assert time.monotonic() - t0 < 30
        msg = str(err.value)
        assert q.stream in msg and replica.fingerprint in msg and q.worker_command in msg
        assert "2 job(s) queued" in msg and "no worker has ever served it" in msg
        assert q.progress()["unserved"] == 1 and q.progress()["queued"] == 2  # counted; kept for a worker
        # The worker, serving the other stream, logs the one nobody serves.
        deadline = time.monotonic() + 30
        while replica.fingerprint not in worker.unserved and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.unserved.get(replica.fingerprint) == 2
        assert any(q.stream in r.getMessage() and "no live worker serves" in r.getMessage() for r in caplog.records)
        # The stats listing: every stream, its consumers, backlog and oldest job's age.
        capsys.readouterr()
        assert cli_main(["cache", "stats", "--shared", redis_url, "--prefix", prefix, "--json"]) == 0
        rec = json.loads(capsys.readouterr().out)
        streams = {s["stream"]: s for s in rec["shared"]["queues"]}
        assert set(streams) == {q.stream, worker.queue.stream}
        mine, theirs = streams[q.stream], streams[worker.queue.stream]
        assert mine["queued"] == 2 and mine["live_workers"] == [] and mine["oldest_age_s"] >= 0
        assert mine["worker_command"] == q.worker_command
        assert theirs["live_workers"] == ["kvlink-only"] and theirs["queued"] == 0 and theirs["oldest_age_s"] is None
        assert cli_main(["cache", "stats", "--shared", redis_url, "--prefix", prefix]) == 0
        text = capsys.readouterr().out
        assert f"queue     {q.stream}" in text and "1 live worker(s) (kvlink-only)" in text
        assert "2 not done (0 in a worker), oldest" in text
        assert f"NO LIVE WORKER serves these jobs: run `{q.worker_command}`" in text
    finally:
        stop.set()
        thread.join(30)
    # A worker for the base model started later computes the jobs that were kept.
    base = KVRag(
        kvlink_home, cache_dir=tmp_path / "b", shared=RedisStore(redis_url, prefix=prefix), policy="cacheblend"
    )
    late = Worker(base, block_s=0.1)
    late.run(until_idle=True)
    assert late.done == 2 and q.wait(keys, timeout=10)


def test_a_busy_worker_stays_live_through_a_long_batch(redis_url, prefix, handle, tmp_path):
    """Liveness is the worker's heartbeat thread, not its reads: a batch that takes longer
    than the replica's no-consumer limit is waited for, not reported unserved."""
    w = KVRag(handle, cache_dir=tmp_path / "w", shared=RedisStore(redis_url, prefix=prefix))
    real = w.precompute

    def slow(texts, **kw):
        time.sleep(3.0)  # longer than no_consumer_s and live_s below
        return real(texts, **kw)

    w.precompute = slow
    worker = Worker(w, block_s=0.1, heartbeat_s=0.2)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        replica = KVRag(
            handle, cache_dir=tmp_path / "r", shared=RedisStore(redis_url, prefix=prefix), precompute_via="queue"
        )
        keys = replica.precompute(DOCS)
        assert replica.queue.wait(keys, timeout=60, no_consumer_s=1.5, live_s=1.0), replica.queue.stats()
        assert replica.queue.live_workers() == [worker.name]
    finally:
        stop.set()
        thread.join(30)
    assert replica.queue.progress()["unserved"] == 0
