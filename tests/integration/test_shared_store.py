"""The shared tier on a real Redis (kvrag.store.redis_store, kvrag.store.tiered): round trip, the
text index, verification of every read (tampered, foreign, truncated, not kvrag's values are
misses that never crash), eviction, and a server going away and coming back. The store's
key tests run twice: on one server and on a real 3-node Redis Cluster (``cluster_url``)."""

from __future__ import annotations

import json
import logging

import pytest
from helpers.redis_servers import RedisServer, redis
from helpers.shared_entries import FP, entry, same

from kvrag.store import DiskStore
from kvrag.store.blob import checksum, serialize
from kvrag.store.redis_connection import SharedStoreDown, public_url, redact
from kvrag.store.redis_store import PART_SIZE, RedisStore
from kvrag.store.tiered import TieredStore


@pytest.fixture
def store(any_url, prefix):
    """A store on one server, then on a cluster."""
    s = RedisStore(any_url, prefix=prefix, part_size=1024)  # small parts: entries span several
    yield s
    s.close()


def test_round_trip_index_and_prefix_isolation(store, prefix):
    key, e = entry(1, t=40)  # 40 tokens x 2 x 2 x 8 x fp16 x 2 + extras: several 1 KiB parts
    assert key not in store and store.get(key, FP) is None
    store.put(key, e)
    assert key in store and store.ensure_indexed(key)
    got = store.get(key, FP)
    assert got is not None and same(got, e)
    assert store.texts(FP) == {key: e.text} and store.texts("other") == {}
    meta = store.client.hgetall(store._meta(key))
    assert int(meta[b"parts"]) > 1
    other = RedisStore(store.url, prefix=prefix + "other:")
    assert key not in other and other.texts(None) == {} and other.get(key, FP) is None
    # A replacement gets new parts; the old ones are deleted.
    old_ver = meta[b"ver"].decode()
    store.put(key, e)
    assert store.client.exists(store._part(key, old_ver, 0)) == 0
    assert same(store.get(key, FP), e)
    assert store.delete(key) and key not in store and store.texts(None) == {}


def test_redact_hides_the_password():
    assert redact("redis://:s3cret@h:6379/0") == "redis://***@h:6379/0"
    assert redact("rediss://user:s3cret@h/1") == "rediss://user:***@h/1"
    assert public_url("redis://:s3cret@h:6379/0") == "redis://h:6379/0"
    assert public_url("rediss+cluster://user:s3cret@h:7000") == "rediss+cluster://user@h:7000"
    assert public_url("unix:///r.sock?db=1&password=s3cret") == "unix:///r.sock?db=1"
    with pytest.raises(ValueError, match="redis://host"):
        RedisStore("localhost:6379")


def test_bad_urls_and_prefixes_are_clear_errors():
    with pytest.raises(ValueError, match="only database 0"):
        RedisStore("redis+cluster://127.0.0.1:7000/2")
    with pytest.raises(ValueError, match="redis\\+cluster://"):
        RedisStore("memcached://127.0.0.1:11211")
    with pytest.raises(ValueError, match="names one of its nodes"):
        RedisStore("redis+cluster:///0")
    with pytest.raises(ValueError, match="hash tags"):
        RedisStore("redis://127.0.0.1:6379/0", prefix="team{a}:")


def test_multi_part_entry_keys_share_one_slot(any_url, prefix):
    """An entry over 4 MiB (default parts): its parts and meta are in one hash slot (a
    cluster's transaction needs that), and a second store (another replica) reads it and
    lists it."""
    from redis.cluster import key_slot

    a = RedisStore(any_url, prefix=prefix)
    key, e = entry(7, t=40000)  # ~5.4 MB: two 4 MiB parts
    a.put(key, e)
    meta = a.client.hgetall(a._meta(key))
    assert int(meta[b"parts"]) == 2 and int(meta[b"size"]) > PART_SIZE
    names = [a._meta(key)] + [a._part(key, meta[b"ver"].decode(), i) for i in range(2)]
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert key_slot(a._idx.encode()) == key_slot(a._idxv.encode())
    b = RedisStore(any_url, prefix=prefix)
    assert b.texts(FP) == {key: e.text}
    assert same(b.get(key, FP), e)
    a.close()
    b.close()


def test_a_plain_url_to_a_cluster_node_says_use_redis_cluster(cluster_url, prefix):
    """redis:// at a cluster node: the keys on other nodes answer MOVED, which is reported as
    a configuration problem (the store treats it as unreachable), never taken for a value."""
    port = int(cluster_url.rsplit(":", 1)[1])
    key, e = entry(8)
    nodes = [f"{n.host}:{n.port}" for n in redis.cluster.RedisCluster(host="127.0.0.1", port=port).get_primaries()]
    assert len(nodes) == 3
    errors = []
    for addr in nodes:
        s = RedisStore(f"redis://{addr}/0", prefix=prefix)
        try:
            s.put(key, e)
        except SharedStoreDown as err:
            errors.append(str(err))
        s.close()
    assert len(errors) >= len(nodes) - 1 and all("redis+cluster://" in m for m in errors), errors


def _tamper_cases(store, key, e):
    """(name, action) pairs that each damage the stored entry under ``key`` differently."""
    c = store.client
    meta = {k.decode(): v.decode() for k, v in c.hgetall(store._meta(key)).items()}
    part0 = store._part(key, meta["ver"], 0)

    def flip():
        b = bytearray(c.get(part0))
        b[len(b) // 2] ^= 0xFF
        c.set(part0, bytes(b))

    def other_key_value():
        k2, e2 = entry(99, t=40)
        store.put(k2, e2)
        m2 = c.hgetall(store._meta(k2))
        for i in range(int(m2[b"parts"])):
            c.set(store._part(key, "copied", i), c.get(store._part(k2, m2[b"ver"].decode(), i)))
        c.hset(store._meta(key), mapping={**{k.decode(): v for k, v in m2.items()}, "ver": "copied"})

    def foreign_fp():  # a sound entry of another model, stored under this key
        data = serialize(entry(1, t=40, fp="another-model")[1], e.token_ids)
        c.set(store._part(key, "foreign", 0), data)
        c.hset(
            store._meta(key),
            mapping={"ver": "foreign", "tag": checksum(data), "size": len(data), "part_size": len(data), "parts": 1},
        )

    def crafted_header():  # its own valid checksum, but the header claims more bytes than exist
        data = bytearray(serialize(e, e.token_ids))
        n = int.from_bytes(data[:8], "little")
        header = json.loads(bytes(data[8 : 8 + n]))
        header["keys"]["shape"] = [2, 2, 4000, 8]
        hb = json.dumps(header).encode()
        data = len(hb).to_bytes(8, "little") + hb + bytes(data[8 + n :])
        c.set(store._part(key, "crafted", 0), data)
        c.hset(
            store._meta(key),
            mapping={"ver": "crafted", "tag": checksum(data), "size": len(data), "part_size": len(data), "parts": 1},
        )

    def not_kvrag_string():
        c.delete(store._meta(key))
        c.set(store._meta(key), b"\x80\x04pickle?")

    def not_kvrag_hash():
        c.hset(store._meta(key), mapping={"ver": "x", "parts": "1000000000", "size": "5", "tag": "t"})

    def truncated():  # the last part cut short
        last = store._part(key, meta["ver"], int(meta["parts"]) - 1)
        c.set(last, c.get(last)[:-3])

    def garbage_part():
        c.set(part0, b"\x00" * len(c.get(part0)))

    return [
        ("flipped bytes", flip),
        ("another key's value", other_key_value),
        ("foreign fingerprint", foreign_fp),
        ("crafted header", crafted_header),
        ("non-kvrag string", not_kvrag_string),
        ("non-kvrag hash", not_kvrag_hash),
        ("truncated part", truncated),
        ("garbage part", garbage_part),
    ]


def test_tampered_entries_are_never_served(store, caplog):
    key, e = entry(1, t=40)
    store.put(key, e)
    for _i, (name, _) in enumerate(_tamper_cases(store, key, e)):
        store.put(key, e)
        assert same(store.get(key, FP), e)
        action = dict(_tamper_cases(store, key, e))[name]
        action()
        with caplog.at_level(logging.WARNING):
            got = store.get(key, FP)  # never raises
        assert got is None, name
        # Nothing of it lingers as servable, and a clean put repairs it.
        assert store.get(key, FP) is None, name
    store.put(key, e)
    assert same(store.get(key, FP), e)
    assert store.stats()["corrupt"] >= 4


def test_evicted_part_is_a_miss_and_unlisted(store):
    key, e = entry(2, t=40)
    store.put(key, e)
    ver = store.client.hget(store._meta(key), "ver").decode()
    store.client.delete(store._part(key, ver, 1))  # what allkeys-lru may do to one part
    assert not store.ensure_indexed(key)
    assert store.get(key, FP) is None
    assert key not in store.texts(FP)


def test_tiered_write_through_read_through_promotion(store, tmp_path):
    near = DiskStore(tmp_path / "a")
    tiered = TieredStore(near, store)
    key, e = entry(3)
    tiered.put(key, e)
    assert key in near and key in store
    # Replica B: its own empty disk, the same Redis.
    b = TieredStore(DiskStore(tmp_path / "b"), RedisStore(store.url, prefix=store.prefix))
    assert b.texts(FP) == {key: e.text}
    assert key not in b.near
    assert same(b.get(key, FP), e)
    b.flush()
    assert key in b.near and same(b.near.get(key, FP), e)
    assert b.stats()["tiers"]["far_hits"] == 1
    b.close()
    tiered.close()


def test_redis_down_then_back(own_redis, tmp_path, caplog):
    far = RedisStore(own_redis.url, socket_timeout=0.5, retry_s=0.2)
    tiered = TieredStore(DiskStore(tmp_path / "d"), far)
    key, e = entry(4)
    tiered.put(key, e)
    k2, e2 = entry(5)
    own_redis.stop()
    with caplog.at_level(logging.WARNING, logger="kvrag.store.redis_store"):
        assert same(tiered.get(key, FP), e)  # the near tier serves it
        tiered.put(k2, e2)  # stored locally, no error
        assert tiered.near.get(k2, FP) is not None
        for _ in range(5):
            assert far.get(key, FP) is None  # a miss, not an exception
        assert key in tiered.texts(FP)  # what was listed last (+ near)
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    own_redis.start()  # an empty server on the same port
    import time

    time.sleep(0.3)
    far.put(k2, e2)  # reconnects without a new client
    assert same(far.get(k2, FP), e2)
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    tiered.close()


def test_eviction_under_maxmemory_is_misses_only(tmp_path):
    server = RedisServer(maxmemory="3mb").start()
    try:
        far = RedisStore(server.url, part_size=64 * 1024)
        keys = []
        for i in range(40):  # ~200 KiB each: far more than 3 MB in all
            key, e = entry(100 + i, t=1600)
            far.put(key, e)
            keys.append((key, e))
        # Newest first: reading an entry takes output-buffer memory, which under maxmemory
        # evicts others; the oldest-first order could leave none to serve (seen once).
        keys.reverse()
        served = [far.get(k, FP) for k, _ in keys]
        assert any(s is None for s in served) and any(s is not None for s in served)
        for (_k, e), s in zip(keys, served):
            assert s is None or same(s, e)
        assert len(far.texts(FP)) <= 40
        assert far.stats()["maxmemory_policy"] == "allkeys-lru"
        far.close()
    finally:
        server.close()


def test_concurrent_writers_of_one_key_leave_one_whole_version(store):
    import threading

    key, e = entry(6, t=40)
    stores = [RedisStore(store.url, prefix=store.prefix, part_size=1024) for _ in range(3)]

    def hammer(s):
        for _ in range(15):
            s.put(key, e)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    meta = store.client.hgetall(store._meta(key))
    parts = list(store.client.scan_iter(match=store.prefix + "p:*"))  # on every node of a cluster
    assert len(parts) == int(meta[b"parts"])  # the replaced versions' parts are all gone
    assert all(p.decode().split(":")[-2] == meta[b"ver"].decode() for p in parts)
    assert same(store.get(key, FP), e)


def test_bad_shared_options_fail_before_the_model_load(tmp_path):
    from kvrag.engine import KVRag

    missing = str(tmp_path / "no-such-model")  # loading it would raise ModelLoadError
    with pytest.raises(ValueError, match="redis://host"):
        KVRag(missing, cache_dir=tmp_path / "kv", shared="localhost:6379")
    with pytest.raises(ValueError, match="needs a shared store"):
        KVRag(missing, cache_dir=tmp_path / "kv", precompute_via="queue")
    with pytest.raises(ValueError, match="precompute_via"):
        KVRag(missing, cache_dir=tmp_path / "kv", shared="redis://127.0.0.1:6379/0", precompute_via="remote")


def test_a_local_kvrag_never_imports_redis(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from kvrag.engine import KVRag; from kvrag.testing import tiny_llama; "
        f"KVRag(tiny_llama(), cache_dir={str(tmp_path / 'kv')!r}); "
        "assert 'redis' not in sys.modules, 'redis imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_framework_wrappers_over_a_kvrag_with_a_shared_tier(redis_url, prefix, tmp_path):
    """The LLM wrappers record the local store's directory (what they serialize) also when a
    shared tier stands in front of it."""
    from kvrag import KVRag
    from kvrag.testing import tiny_llama
    from langchain_kvrag import ChatKVRag
    from llama_index.llms.kvrag import KVRagLLM

    rag = KVRag(
        tiny_llama(seed=0), cache_dir=tmp_path / "kv", shared=RedisStore(redis_url, prefix=prefix), policy="naive_reuse"
    )
    assert isinstance(rag.store, TieredStore) and rag.cache_dir == tmp_path / "kv"
    assert KVRagLLM(rag, set_tokenizer=False).cache_dir == str(tmp_path / "kv")
    assert ChatKVRag(rag=rag).cache_dir == str(tmp_path / "kv")


def test_wrappers_serialize_the_shared_url_never_its_password(tmp_path, monkeypatch):
    """A round trip of the LlamaIndex and LangChain wrappers keeps the shared tier (URL, prefix,
    precompute_via) with the password removed; loaded again, the password comes from
    $KVRAG_REDIS_PASSWORD and the rebuilt KVRag reads the shared tier (a Redis that requires it)."""
    from langchain_core.load import dumpd, load

    from kvrag import KVRag
    from kvrag.testing import tiny_llama
    from langchain_kvrag import ChatKVRag
    from llama_index.llms.kvrag import KVRagLLM

    model_dir = tmp_path / "model"
    h = tiny_llama(seed=0)
    h.model.save_pretrained(model_dir)
    h.tokenizer.save_pretrained(model_dir)
    server = RedisServer(password="s3cret-pw").start()
    try:
        url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
        rag = KVRag(str(model_dir), cache_dir=tmp_path / "kv", shared=RedisStore(url, prefix="team-a:"))
        rag.precompute(["A chunk that replica one stored in the shared tier."])
        key = rag.chunk_key("A chunk that replica one stored in the shared tier.")
        want = {"shared": f"redis://127.0.0.1:{server.port}/0", "shared_prefix": "team-a:", "precompute_via": "local"}
        d = KVRagLLM(rag, set_tokenizer=False).to_dict()
        lc = dumpd(ChatKVRag(rag=rag))
        assert {k: d[k] for k in want} == want and {k: lc["kwargs"][k] for k in want} == want
        assert "s3cret" not in json.dumps(d) and "s3cret" not in json.dumps(lc)
        monkeypatch.setenv("KVRAG_REDIS_PASSWORD", "s3cret-pw")
        again = KVRagLLM.from_dict(d, cache_dir=str(tmp_path / "kv-b"), set_tokenizer=False)  # an empty disk
        assert again.rag.store.far.prefix == "team-a:" and key in again.rag.store.far  # authenticated
        lc["kwargs"]["cache_dir"] = str(tmp_path / "kv-c")
        chat = load(lc, valid_namespaces=["langchain_kvrag"], allowed_objects=[ChatKVRag])
        assert chat.shared == want["shared"] and key in chat.rag.store.far
        with pytest.raises(ValueError, match="either an existing `rag`"):
            KVRagLLM(rag, shared="redis://elsewhere:6379/0")
        # Built from settings with the password in the URL: recorded without it.
        built = ChatKVRag(model=str(model_dir), cache_dir=str(tmp_path / "kv-d"), shared=url, shared_prefix="team-a:")
        assert built.shared == want["shared"] and key in built.rag.store.far
    finally:
        server.close()


def test_cache_push_copies_what_the_shared_tier_lacks(redis_url, prefix, tmp_path, capsys):
    """`kvrag cache push`: a local store's entries the shared tier lacks are copied up, read
    verified (a corrupt local blob is counted, never pushed); a second push finds them all
    present; the shared tier down is a clear error, not a traceback."""
    from kvrag.cli import main

    local = DiskStore(tmp_path / "kv")
    # Two models; 600 tokens, so each blob is a file of its own (not a value inside SQLite).
    entries = dict(entry(s, t=600, fp=FP if s < 3 else "fp-other") for s in range(4))
    for k, e in entries.items():
        local.put(k, e)
    local.close()
    shared = RedisStore(redis_url, prefix=prefix)
    key0 = next(iter(entries))
    shared.put(key0, entries[key0])  # already there: not sent again
    bad = list(entries)[1]  # flip bytes inside one local blob's tensor data
    path = next(
        f
        for f in (tmp_path / "kv").rglob("*")
        if f.is_file() and entries[bad].text.encode() + b'"' in f.read_bytes()[:4096]
    )
    data = bytearray(path.read_bytes())
    data[-40:-8] = bytes(x ^ 0xFF for x in data[-40:-8])
    path.write_bytes(bytes(data))
    assert main(["cache", "push", str(tmp_path / "kv"), "--shared", redis_url, "--prefix", prefix, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert (rec["pushed"], rec["present"], rec["unreadable"], rec["listed"]) == (2, 1, 1, 4)
    for k, e in entries.items():
        if k != bad:
            assert same(shared.get(k, e.fingerprint), e)
    assert bad not in shared
    assert main(["cache", "push", str(tmp_path / "kv"), "--shared", redis_url, "--prefix", prefix, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pushed"] == 0
    assert main(["cache", "push", str(tmp_path / "kv"), "--shared", "redis://127.0.0.1:1/0"]) == 2
    assert "unreachable" in capsys.readouterr().err
