"""The shared tier and its queue under a hostile or failing Redis, each case against a real
server: crafted metas and parts (bounded reads: a miss, counted corrupt, deleted), a crafted
or wrong-typed index, error replies (WRONGTYPE, OOM, READONLY, NOGROUP, a REPLICAOF) that must
never escape ``generate``/``precompute``/``stats`` nor stop a ``Worker``, an oversized job
refused before it is tokenized, and a flushed Redis restored by re-ingestion. Then the
generation options and local-store checks that the same fault audit found."""

from __future__ import annotations

import logging
import resource
import threading
import time

import pytest
import torch
from helpers.corpus import DOCS as CORPUS
from helpers.corpus import prompt_for
from helpers.redis_servers import RedisServer, free_port, redis
from helpers.shared_entries import FP, entry, same

from kvrag.engine import KVRag
from kvrag.errors import ChunkError, StoreError
from kvrag.precompute.worker import Worker
from kvrag.store import DiskStore
from kvrag.store.redis_store import RedisStore
from kvrag.testing import tiny_llama

DOCS = CORPUS[:3]


@pytest.fixture(scope="module")
def handle():
    return tiny_llama(seed=0)


def _rss_mb() -> float:
    """This process's peak RSS so far, in MB (Linux: ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _store(url, prefix, **kw) -> RedisStore:
    return RedisStore(url, prefix=prefix, part_size=1024, **kw)


# ---- bounded reads -------------------------------------------------------------------------
def test_meta_declaring_a_huge_entry_is_not_fetched_counted_corrupt_and_deleted(redis_url, prefix):
    store = _store(redis_url, prefix, max_entry_bytes=2**24)
    key, e = entry(1, t=40)
    store.put(key, e)
    c = store.client
    # size 16 GiB in 16 M parts of 1 KiB: followed, one GET per declared part exhausts memory.
    c.hset(store._meta(key), mapping={"size": 2**34, "part_size": 1024, "parts": 2**24})
    before = _rss_mb()
    assert store.get(key, FP) is None
    assert _rss_mb() - before < 100
    assert store.stats()["corrupt"] == 1
    assert not c.exists(store._meta(key)) and key not in store.texts(FP)  # kvrag's key: deleted
    # size and part_size disagreeing with parts, or part_size 2^31: the same.
    for fields in ({"parts": 3}, {"part_size": 2**31, "parts": 1}, {"size": 2**31}):
        store.put(key, e)
        c.hset(store._meta(key), mapping=fields)
        assert store.get(key, FP) is None and not c.exists(store._meta(key))
    assert store.stats()["corrupt"] == 4


def test_meta_declaring_many_parts_that_do_not_exist_costs_one_batch(redis_url, prefix):
    """Within the entry bound but with no parts behind it (2^14 declared): the read stops at
    the first batch, the meta is removed (a miss, like an evicted entry)."""
    store = _store(redis_url, prefix, max_entry_bytes=2**24)
    key, e = entry(2)
    store.put(key, e)
    c = store.client
    c.hset(store._meta(key), mapping={"ver": "abc", "size": 2**24, "part_size": 1024, "parts": 2**14})
    sent = []
    real = type(c).pipeline

    def counting(self, *a, **k):
        p = real(self, *a, **k)
        sent.append(p)
        return p

    type(c).pipeline = counting
    try:
        assert store.get(key, FP) is None
        assert not store.ensure_indexed(key)
    finally:
        type(c).pipeline = real
    assert max(len(p.command_stack) for p in sent) <= 1024  # never 16k commands in one go
    assert not c.exists(store._meta(key))


def test_cut_short_or_overlong_part_is_corrupt_deleted_and_replaced(redis_url, prefix, handle, tmp_path):
    a = KVRag(handle, cache_dir=tmp_path / "a", shared=_store(redis_url, prefix))
    a.precompute(DOCS)
    far: RedisStore = a.store.far
    k0, k1 = (a.chunk_key(d) for d in DOCS[:2])
    c = far.client
    meta = {k.decode(): v.decode() for k, v in c.hgetall(far._meta(k0)).items()}
    part = far._part(k0, meta["ver"], 0)
    c.set(part, c.get(part)[:100])  # cut short
    meta1 = {k.decode(): v.decode() for k, v in c.hgetall(far._meta(k1)).items()}
    part1 = far._part(k1, meta1["ver"], 0)
    c.append(part1, b"trailing bytes")  # too long
    assert far.get(k0, a.fingerprint) is None and far.get(k1, a.fingerprint) is None
    assert far.stats()["corrupt"] == 2
    assert not c.exists(far._meta(k0)) and not c.exists(far._meta(k1))
    # Cut short again, now found by precompute (ensure_indexed): replaced from A's disk, not skipped.
    a.precompute(DOCS)
    meta = {k.decode(): v.decode() for k, v in c.hgetall(far._meta(k0)).items()}
    c.set(far._part(k0, meta["ver"], 0), b"x")
    a.precompute(DOCS)
    assert a.store.stats()["tiers"]["restored"] >= 3
    fresh = KVRag(handle, cache_dir=tmp_path / "fresh", shared=_store(redis_url, prefix))
    out = fresh.generate(prompt_for(DOCS), policy="cacheblend", recompute_ratio=1.0, max_new_tokens=4)
    assert out.stats.chunks_hit == len(DOCS)


def test_non_string_part_never_breaks_precompute(redis_url, prefix, handle, tmp_path):
    a = KVRag(handle, cache_dir=tmp_path / "a", shared=_store(redis_url, prefix))
    a.precompute(DOCS[:1])
    far, k = a.store.far, a.chunk_key(DOCS[0])
    c = far.client
    ver = c.hget(far._meta(k), "ver").decode()
    c.delete(far._part(k, ver, 0))
    c.hset(far._part(k, ver, 0), "not", "a string")
    b = KVRag(handle, cache_dir=tmp_path / "b", shared=_store(redis_url, prefix))
    assert b.store.far.get(k, b.fingerprint) is None  # a miss ...
    c.delete(far._part(k, ver, 0))
    c.hset(far._meta(k), "ver", ver)
    c.hset(far._part(k, ver, 0), "not", "a string")
    b.precompute(DOCS[:1])  # ... and precompute does not raise: computed and stored again
    assert b.store.far.get(k, b.fingerprint) is not None


# ---- the text index ------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["index_as_string", "version_as_hash", "version_not_a_number"])
def test_wrong_typed_index_key_breaks_no_query(redis_url, prefix, handle, tmp_path, which, caplog):
    a = KVRag(handle, cache_dir=tmp_path / "a", shared=_store(redis_url, prefix))
    a.precompute(DOCS)
    far = a.store.far
    c = far.client
    if which == "index_as_string":
        c.delete(far._idx)
        c.set(far._idx, "x")
    elif which == "version_as_hash":
        c.delete(far._idxv)
        c.hset(far._idxv, "a", "b")
    else:
        c.set(far._idxv, "not a number")
    b = KVRag(handle, cache_dir=tmp_path / "b", shared=_store(redis_url, prefix))
    prompt = prompt_for(DOCS)
    with caplog.at_level(logging.WARNING, logger="kvrag.store.redis_store"):
        out = b.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=4)
        stats = b.store.stats()
    assert out.token_ids == a.generate(prompt, policy="full_prefill", max_new_tokens=4).token_ids
    assert "corrupt" in stats["shared"]
    # The foreign value was replaced: a new chunk is listed, and re-ingestion lists the old
    # ones again, for every replica.
    a.precompute(CORPUS[3:4] + DOCS)
    assert set(_store(redis_url, prefix).texts(a.fingerprint)) == {a.chunk_key(d) for d in CORPUS[:4]}


def test_index_over_its_bounds_keeps_the_last_listing(redis_url, prefix, caplog):
    store = _store(redis_url, prefix, max_index_entries=50, max_index_bytes=2**16)
    key, e = entry(3)
    store.put(key, e)
    assert store.texts(FP) == {key: e.text}
    c = store.client
    c.hset(store._idx, mapping={f"crafted{i}": '{"text": "x", "fingerprint": "fp-shared-test"}' for i in range(200)})
    c.incr(store._idxv)
    with caplog.at_level(logging.WARNING, logger="kvrag.store.redis_store"):
        assert store.texts(FP) == {key: e.text}  # the listing read last, not 200 crafted rows
        assert store.texts(FP) == {key: e.text}
    assert sum("INDEXTOOBIG" in r.getMessage() for r in caplog.records) == 1  # said once
    # Bytes: 40 entries of 4 KB each (under the entry bound, over 64 KiB).
    c.delete(store._idx)
    c.hset(store._idx, mapping={f"big{i}": '{"text": "' + "y" * 4000 + '", "fingerprint": "f"}' for i in range(40)})
    c.incr(store._idxv)
    assert store.texts(FP) == {key: e.text}  # refused on Redis's estimate, unread
    # 20 rows of 4 KB: under twice the bound by estimate, over it counted exactly while read.
    c.delete(store._idx)
    c.hset(store._idx, mapping={f"big{i}": '{"text": "' + "y" * 4000 + '", "fingerprint": "f"}' for i in range(20)})
    c.incr(store._idxv)
    assert store.texts(FP) == {key: e.text}


def test_crafted_index_row_for_a_stored_chunk_is_relisted_from_its_blob(redis_url, prefix):
    store = _store(redis_url, prefix)
    key, e = entry(4)
    store.put(key, e)
    store.client.hset(store._idx, key, '{"text": "an injected passage", "fingerprint": "fp-shared-test"}')
    assert store.ensure_indexed(key)
    assert _store(redis_url, prefix).texts(FP) == {key: e.text}


# ---- error replies -------------------------------------------------------------------------
def test_redis_refusing_writes_is_counted_and_pushed_up_later(own_redis, handle, tmp_path, caplog):
    """OOM (maxmemory reached, noeviction) then READONLY (demoted to a replica): precompute
    stores locally, counts far_write_failures, remembers the chunks; once Redis takes writes
    again the next write pushes them up."""
    a = KVRag(handle, cache_dir=tmp_path / "a", shared=RedisStore(own_redis.url, retry_s=0.2))
    c = a.store.far.client
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory", int(c.info("memory")["used_memory"]) + 1000)
    with caplog.at_level(logging.WARNING, logger="kvrag.store.redis_store"):
        a.precompute(DOCS[:1])
        c.config_set("maxmemory", 0)
        c.replicaof("127.0.0.1", free_port())  # a primary that does not exist: read-only
        a.precompute(DOCS[1:2])
        assert a.store.stats()["shared"]["listed"] == 0  # stats answers on a read-only server
    tiers = a.store.stats()["tiers"]
    assert tiers["far_write_failures"] == 2 and tiers["unsynced"] == 2
    causes = [r.getMessage() for r in caplog.records if "answered an error" in r.getMessage()]
    assert len(causes) == 2 and "OutOfMemoryError" in causes[0] and "ReadOnlyError" in causes[1]
    c.replicaof("no", "one")
    a.precompute(DOCS[2:3])
    a.store.flush()
    assert all(a.chunk_key(d) in a.store.far for d in DOCS)


def test_entry_larger_than_a_quarter_of_maxmemory_is_kept_local(handle, tmp_path):
    server = RedisServer(maxmemory="3mb").start()
    try:
        a = KVRag(handle, cache_dir=tmp_path / "a", shared=RedisStore(server.url))
        a.precompute(DOCS[:1])
        big = " ".join(f"word{i}" for i in range(900))  # ~3k tokens x 512 B: over 768 KiB
        a.precompute([big])
        tiers = a.store.stats()["tiers"]
        assert tiers["far_write_failures"] == 1
        assert a.chunk_key(big) not in a.store.far and a.chunk_key(big) in a.store.near
        assert a.store.far.texts(a.fingerprint) == {a.chunk_key(DOCS[0]): DOCS[0]}  # index not evicted
    finally:
        server.close()


# ---- the worker ----------------------------------------------------------------------------
def _wait(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_worker_survives_every_error_reply_and_eviction(own_redis, handle, tmp_path):
    """The audit's seven cases, one after the other, against one running worker: REPLICAOF,
    the stream evicted (NOGROUP), WRONGTYPE on the counters, the failures, the stream list and
    the stream itself, and OOM. It never exits, and after each it computes a new job."""
    w = KVRag(handle, cache_dir=tmp_path / "w", shared=RedisStore(own_redis.url, retry_s=0.1))
    producer = KVRag(
        handle, cache_dir=tmp_path / "p", shared=RedisStore(own_redis.url, retry_s=0.1), precompute_via="queue"
    )
    q = producer.queue
    c = q.client
    worker = Worker(w, block_s=0.1, retry_s=0.05, max_retry_s=0.2)
    stop = threading.Event()
    t = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    t.start()
    texts = iter(f"Passage number {i} about the faults of a shared cache server." for i in range(20))

    def job_done():
        text = next(texts)
        for _ in range(100):  # submit itself may meet the fault: it raises, never hangs
            try:
                (key,) = q.submit([text], producer.ingestor)
                break
            except StoreError:
                time.sleep(0.1)
        return _wait(lambda: producer.store.far.ensure_indexed(key))

    def fault(cmds, heal=None):
        for cmd in cmds:
            cmd()
        time.sleep(0.5)  # the worker meets it
        assert t.is_alive()
        if heal:
            heal()
        assert job_done(), q.progress()

    try:
        assert job_done()
        fault([lambda: c.replicaof("127.0.0.1", free_port())], lambda: c.replicaof("no", "one"))
        fault([lambda: c.delete(q.stream)])  # evicted: NOGROUP until the group is re-created
        for name in (q.counts_key, q.failed_key, q.streams_index):
            fault([lambda n=name: c.delete(n), lambda n=name: c.set(n, "x")])
        fault([lambda: c.delete(q.stream), lambda: c.set(q.stream, "x")])
        fault(
            [lambda: c.config_set("maxmemory-policy", "noeviction"), lambda: c.config_set("maxmemory", 1)],
            lambda: c.config_set("maxmemory", 0),
        )
        assert t.is_alive() and worker.errors >= 5
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()


def test_oversized_job_is_refused_unread_and_its_batch_mates_stored(redis_url, prefix, handle, tmp_path, monkeypatch):
    import kvrag.precompute.ingest

    w = KVRag(handle, cache_dir=tmp_path / "w", shared=_store(redis_url, prefix))
    producer = KVRag(handle, cache_dir=tmp_path / "p", shared=_store(redis_url, prefix), precompute_via="queue")
    q = producer.queue
    q.ensure_group()
    huge = b"a" * (4 * w.ingestor.max_chars + 1)  # past the context in bytes alone
    long_ = "b " * (w.ingestor.max_chars // 2 + 1)  # past it in characters
    tokenized = []
    real = kvrag.precompute.ingest.spell_chunk
    monkeypatch.setattr(
        kvrag.precompute.ingest, "spell_chunk", lambda h, text, nl: tokenized.append(len(text)) or real(h, text, nl)
    )
    q.client.xadd(q.stream, {"key": "0" * 64, "text": huge})
    q.client.xadd(q.stream, {"key": "1" * 64, "text": long_.encode()})
    keys = q.submit(DOCS, producer.ingestor)  # three valid batch-mates, in the same batch
    worker = Worker(w, block_s=0.1, batch=8)
    assert worker.step() == len(DOCS)
    assert max(tokenized) < w.ingestor.max_chars  # neither long text was ever tokenized
    assert set(q.failures()) == {"0" * 64, "1" * 64} and "cannot fit" in q.failures()["0" * 64]
    assert all(k in producer.store.far for k in keys)
    assert q.progress()["queued"] == 0 and q.progress()["pending"] == 0  # acknowledged, not redelivered
    with pytest.raises(ChunkError, match="characters"):
        w.ingestor.chunk_ids(long_)


# ---- a flushed Redis restored by re-ingestion ---------------------------------------------
def test_reingestion_restores_a_flushed_shared_tier_without_recompute(redis_url, prefix, handle, tmp_path, monkeypatch):
    import kvrag.precompute.ingest

    a = KVRag(handle, cache_dir=tmp_path / "a", shared=_store(redis_url, prefix))
    a.precompute(DOCS)
    c = a.store.far.client
    c.delete(*c.keys(prefix + "*"))  # the shared tier lost everything
    computed = []
    real = kvrag.precompute.ingest.compute_chunk_kv
    monkeypatch.setattr(
        kvrag.precompute.ingest, "compute_chunk_kv", lambda *x, **k: computed.append(1) or real(*x, **k)
    )
    a.precompute(DOCS)  # through the replica whose disk holds them
    assert computed == [] and a.store.stats()["tiers"]["restored"] == len(DOCS)
    fresh = KVRag(handle, cache_dir=tmp_path / "fresh", shared=_store(redis_url, prefix))
    out = fresh.generate(prompt_for(DOCS), policy="cacheblend", recompute_ratio=1.0, max_new_tokens=4)
    assert out.stats.chunks_hit == len(DOCS) and computed == []


# ---- generation options and the local store -----------------------------------------------
def test_generation_options_are_checked_before_the_prefill(handle, tmp_path):
    rag = KVRag(tiny_llama(seed=0, max_position_embeddings=64), cache_dir=tmp_path / "s")
    with pytest.raises(ValueError, match="temperature"):
        rag.generate("Hello there", temperature=5e-324)
    with pytest.raises(ValueError, match="temperature"):
        rag.generate("Hello there", temperature=1e300)
    out = rag.generate("Hello there", temperature=1e-6, max_new_tokens=3, seed=1)  # near-greedy, finite
    assert len(out.token_ids) == 3
    prompt = " ".join(["word"] * 50)
    n = len(rag.handle.encode(prompt))
    # A length asked for that does not fit is refused; one left unsaid is cut to the room left.
    with pytest.raises(ValueError, match="context exceeded"):
        rag.generate(prompt, max_new_tokens=10**30)
    out = rag.generate(prompt)
    assert 0 < len(out.token_ids) <= 64 - n
    full = next(p for k in range(40, 80) if len(rag.handle.encode(p := " ".join(["word"] * k))) == 64)
    with pytest.raises(ValueError, match="no room"):
        rag.generate(full)
    with pytest.raises(ValueError, match="context exceeded"):
        rag.generate(full, max_new_tokens=5)


def test_gc_verify_drops_a_blob_file_swapped_for_another_length(tmp_path):
    store = DiskStore(tmp_path / "s")
    k1, e1 = entry(5, t=7)
    k2, e2 = entry(6, t=30)
    store.put(k1, e1)
    store.put(k2, e2)
    rows = dict(store._blobs._sql("SELECT key, filename FROM Cache").fetchall())
    root = store._blobs.directory
    with open(f"{root}/{rows[k2]}", "rb") as f:
        other = f.read()
    with open(f"{root}/{rows[k1]}", "wb") as f:
        f.write(other)  # a valid blob of another key and length
    assert store.gc(verify=True)["corrupt"] == 1
    assert k1 not in store and same(store.get(k2, FP), e2)


def test_permission_error_names_the_store_and_the_fix(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "s")
    key, e = entry(7)

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", "6b")

    monkeypatch.setattr(DiskStore, "_set", staticmethod(denied))
    with pytest.raises(StoreError, match="permission denied") as info:
        store.put(key, e)
    assert str(tmp_path / "s") in str(info.value) and "writable" in str(info.value)


def test_a_single_entry_round_trip_still_holds(redis_url, prefix):
    store = _store(redis_url, prefix, max_entry_bytes=2**20)
    key, e = entry(8, t=60)
    store.put(key, e)
    assert store.ensure_indexed(key) and same(store.get(key, FP), e)
    assert torch.equal(store.get(key, FP).keys, e.keys)


def test_cache_stats_shared_reports_wrong_typed_keys_without_a_traceback(redis_url, prefix):
    from kvrag.cli.cache import shared_stats
    from kvrag.precompute.redis_queue import streams_key

    c = redis.Redis.from_url(redis_url)
    c.set(prefix + "{idx}", "x")
    c.set(streams_key(prefix), "x")
    out = shared_stats(redis_url, prefix)
    assert out["listed"] is None and "WRONGTYPE" in out["queues_error"]
    assert out.get("reachable", True)  # the server answered: not reported as down
