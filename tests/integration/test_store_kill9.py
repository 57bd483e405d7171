"""The store across a ``kill -9`` mid-ingestion and a restart, from outside: a process ingesting
many chunks into a disk store (alone, with a shared Redis tier behind it, or as ``kvrag serve``
computing ``POST /v1/chunks`` in the background) is killed with SIGKILL once some entries are
written. A fresh process then finds every chunk either whole -- bit for bit what a
recomputation stores -- or a miss: never a corrupt tensor or an exception, on a read or on the
query path; ``kvrag cache gc --verify`` finds nothing corrupt; and ingesting again (or the
server restarted and sent the same chunks) completes the set. The tiny random-weight model
saved to a directory (one fingerprint in every process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers.corpus import prompt_for
from helpers.serve import kvrag_serve
from helpers.store_entries import assert_same

from kvrag.cli import main as cli_main
from kvrag.engine import KVRag
from kvrag.store import ChunkEntry, DiskStore

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Distinct chunks of ~30 tokens: enough that the writer is still busy when it is killed.
TEXTS = [
    f"Record {i}: the {c} {a} of {p} was counted {i * 37 % 1000} times in the year {1700 + i}."
    for i, (c, a, p) in enumerate(
        (c, a, p)
        for p in ("Brisk", "Aldport", "Varn", "Kelvar", "Lenne", "Arden")
        for a in ("fox", "heron", "otter", "lynx", "marten", "vole", "stoat", "hare")
        for c in ("red", "grey", "black", "white", "brown", "spotted", "pale")
    )
]
#: Entries written before the kill: the writer is past its start, mid-way through the set.
KILL_AFTER = 12
#: Seconds any wait of this module may take (the model loads of a busy 2-core machine).
WAIT_S = 60

#: The ingesting process: one ``precompute`` call per chunk (each a pass and a put), as a
#: pipeline's ingestion hook adds documents; one torch thread, as the reading process computes.
INGEST = """
import json, sys
import torch
torch.set_num_threads(1)
from kvrag.engine import KVRag
from kvrag.store.redis_store import RedisStore
model_dir, cache_dir, texts_file, url, prefix = sys.argv[1:]
shared = None if url == "-" else RedisStore(url, prefix=prefix)
rag = KVRag(model_dir, cache_dir=cache_dir, shared=shared)
for text in json.loads(open(texts_file).read()):
    rag.precompute([text])
print("all stored", flush=True)
"""


def _wait_for(pred, what: str, seconds: float = WAIT_S, proc: subprocess.Popen | None = None):
    end = time.monotonic() + seconds
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}")
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill_once_written(proc: subprocess.Popen, store_dir: Path) -> int:
    """SIGKILL ``proc`` once ``store_dir`` holds ``KILL_AFTER`` entries (wherever it is then:
    mid-pass, mid-file, mid-transaction); the entries counted at the kill."""
    with DiskStore(store_dir) as s:
        _wait_for(lambda: s.stats()["entries"] >= KILL_AFTER, f"{KILL_AFTER} entries", proc=proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        seen = s.stats()["entries"]
    assert proc.returncode == -signal.SIGKILL
    return seen


def _cache_cli(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert cli_main(["cache", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """Chunk text -> its entry as a process that computes it alone stores it (computed on
    first use, one ``precompute`` call per chunk as the writers make them)."""
    rag = KVRag(model_dir, cache_dir=tmp_path_factory.mktemp("reference"))
    entries: dict = {}

    def entry_of(text: str):
        if text not in entries:
            (key,) = rag.precompute([text])
            entries[text] = rag.store.get(key, rag.fingerprint)
        return entries[text]

    return entry_of


def same_chunk(want: ChunkEntry, got: ChunkEntry) -> None:
    """``got`` is ``want``'s chunk, its K/V equal to fp16 rounding: a chunk computed in a pack
    with others (the server's background precompute) differs from one computed alone in the
    last bits of a few values, not more."""
    assert (got.fingerprint, got.text, got.token_ids.tolist()) == (want.fingerprint, want.text, want.token_ids.tolist())
    for w, g in [(want.keys, got.keys), (want.values, got.values)]:
        assert g.dtype == w.dtype and g.shape == w.shape and bool(g.isfinite().all())
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)


def check_after_kill(rag: KVRag, reference, exact: bool = True, at_least: int = KILL_AFTER) -> set[str]:
    """Every chunk of ``TEXTS`` through ``rag`` (a fresh process's view of the killed writer's
    store): whole and equal to the reference (bit for bit if ``exact``, else ``same_chunk``),
    or a miss, and ``at_least`` whole; a prompt holding some of each is answered. The texts
    found whole."""
    whole = set()
    for text in TEXTS:
        got = rag.store.get(rag.chunk_key(text), rag.fingerprint)
        if got is not None:
            (assert_same if exact else same_chunk)(reference(text), got)
            whole.add(text)
    stats = rag.store.stats()
    assert stats["corrupt"] == 0 and stats.get("wrong_model", 0) == 0
    # What the index lists is stored whole (a writer killed between its blob and its index
    # row leaves a stored chunk unlisted: found by re-ingestion, never the other way round).
    listed = set(rag.store.texts(rag.fingerprint).values())
    assert listed <= whole and at_least <= len(whole) < len(TEXTS)
    # The query path over the same store: the listed chunks are served, the missing one computed.
    missing = next(t for t in TEXTS if t not in whole)
    served = sorted(listed)[:2]
    g = rag.generate(prompt_for([*served, missing]), max_new_tokens=2, temperature=0.0)
    assert g.stats.chunks_hit == len(served) and g.stats.cached_tokens > 0
    return whole


def complete(rag: KVRag) -> None:
    """Ingest every chunk again through ``rag``: the set is complete and listed."""
    keys = rag.precompute(TEXTS)
    assert all(rag.store.get(k, rag.fingerprint) is not None for k in keys)
    assert set(rag.store.texts(rag.fingerprint).values()) == set(TEXTS)
    rag.store.close()


def _ingest(tmp_path: Path, model_dir: str, store_dir: Path, url: str = "-", prefix: str = "-") -> subprocess.Popen:
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(TEXTS))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", INGEST, model_dir, str(store_dir), str(texts), url, prefix]
    # Output to a file: a pipe nobody reads could fill and stall the writer before the kill.
    log = open(tmp_path / "ingest.log", "w")  # noqa: SIM115 - closed with the process below
    try:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def test_a_store_killed_mid_ingestion_holds_whole_entries_or_misses_and_reingestion_completes_it(
    model_dir, tmp_path, reference, capsys
):
    store_dir = tmp_path / "kv"
    writer = _ingest(tmp_path, model_dir, store_dir)
    _kill_once_written(writer, store_dir)
    rag = KVRag(model_dir, cache_dir=store_dir)  # the store as the killed writer left it
    whole = check_after_kill(rag, reference)
    # gc --verify repairs what a kill leaves (an unlisted blob, a file no row points at) and
    # finds nothing corrupt: its entries are the whole ones.
    report = _cache_cli(capsys, "gc", "--verify", str(store_dir))
    assert report["corrupt"] == 0 and report["entries"] == len(whole)
    complete(rag)
    report = _cache_cli(capsys, "gc", "--verify", str(store_dir))
    assert report["corrupt"] == 0 and report["entries"] == len(TEXTS)
    assert _cache_cli(capsys, "stats", str(store_dir))["entries"] == len(TEXTS)


def test_a_store_with_a_shared_redis_tier_killed_mid_ingestion_serves_whole_entries_or_misses(
    model_dir, tmp_path, reference, redis_url, prefix, capsys
):
    from kvrag.store.redis_store import RedisStore

    store_dir = tmp_path / "kv"
    writer = _ingest(tmp_path, model_dir, store_dir, redis_url, prefix)
    _kill_once_written(writer, store_dir)
    # A replica with a local store of its own: everything it reads comes from Redis.
    replica_dir = tmp_path / "replica"
    rag = KVRag(model_dir, cache_dir=replica_dir, shared=RedisStore(redis_url, prefix=prefix))
    # The kill may fall between the local write of the last entry counted and its Redis write.
    whole = check_after_kill(rag, reference, at_least=KILL_AFTER - 1)
    assert rag.store.stats()["shared"]["corrupt"] == 0
    # The killed writer's disk store is as whole as Redis (it is written first).
    with DiskStore(store_dir) as s:
        assert s.stats()["entries"] >= len(whole)
    complete(rag)
    # Another replica finds the whole set in Redis.
    assert _cache_cli(capsys, "stats", "--shared", redis_url, "--prefix", prefix)["shared"]["listed"] == len(TEXTS)
    fresh = KVRag(model_dir, cache_dir=tmp_path / "fresh", shared=RedisStore(redis_url, prefix=prefix))
    assert all(fresh.store.get(fresh.chunk_key(t), fresh.fingerprint) is not None for t in TEXTS)
    assert fresh.store.stats()["shared"]["corrupt"] == 0
    fresh.store.close()


def test_kvrag_serve_killed_mid_background_precompute_restarts_on_its_store_and_completes_it(
    model_dir, tmp_path, reference, capsys
):
    store_dir = tmp_path / "kv"
    with kvrag_serve(model_dir, str(store_dir)) as (p, url):
        r = httpx.post(url + "/v1/chunks", json={"texts": TEXTS}, timeout=WAIT_S)
        assert r.status_code == 200 and {d["status"] for d in r.json()["data"]} == {"queued"}
        keys = [d["key"] for d in r.json()["data"]]
        _kill_once_written(p, store_dir)
    rag = KVRag(model_dir, cache_dir=store_dir)
    assert [rag.chunk_key(t) for t in TEXTS] == keys  # one fingerprint in both processes
    whole = check_after_kill(rag, reference, exact=False)
    rag.store.close()
    report = _cache_cli(capsys, "gc", "--verify", str(store_dir))
    assert report["corrupt"] == 0 and report["entries"] == len(whole)
    # Restarted on the same store and sent the same chunks: the whole ones are stored, the
    # others computed; then a prompt over them is served from the cache.
    with kvrag_serve(model_dir, str(store_dir)) as (p, url):
        r = httpx.post(url + "/v1/chunks", json={"texts": TEXTS}, timeout=WAIT_S)
        status = {t: d["status"] for t, d in zip(TEXTS, r.json()["data"])}
        assert {t for t, s in status.items() if s == "stored"} == whole
        assert {s for t, s in status.items() if t not in whole} == {"queued"}

        with DiskStore(store_dir) as s:  # polled on disk: no request competes with the server's work
            _wait_for(lambda: s.stats()["entries"] == len(TEXTS), "every chunk stored", proc=p)
        r = httpx.post(url + "/v1/chunks", json={"texts": TEXTS}, timeout=WAIT_S)
        assert {d["status"] for d in r.json()["data"]} == {"stored"}
        assert httpx.get(f"{url}/v1/chunks/{keys[-1]}", timeout=WAIT_S).json()["stored"]
        body = {"prompt": prompt_for(TEXTS[:3]), "max_tokens": 2, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    report = _cache_cli(capsys, "gc", "--verify", str(store_dir))
    assert report["corrupt"] == 0 and report["entries"] == len(TEXTS)
