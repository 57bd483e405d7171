"""DiskStore: bit-exact round trips, integrity checks on every load, LRU eviction, the text
index, stats, several processes at once, and clear errors for bad input."""

import logging
import multiprocessing as mp
import os
import sqlite3
import time

import diskcache
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from helpers.store_entries import FP_A, FP_B, assert_same, blob_files, make_entry, put  # noqa: E402

import kvrag.store.blob as blob_mod  # noqa: E402
import kvrag.store.disk as store_mod  # noqa: E402
import kvrag.store.disk_check as check_mod  # noqa: E402
from kvrag.errors import StoreError  # noqa: E402
from kvrag.store import CACHE_FORMAT_VERSION, ChunkEntry, DiskStore, make_key  # noqa: E402


@pytest.fixture
def store(tmp_path):
    s = DiskStore(tmp_path)
    yield s
    s.close()


# ---- round trip ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact(store, dtype):
    e = make_entry(dtype=dtype, T=7, text="héllo ✓ chunk\nwith lines")
    # Values whose bits a lossy path would change.
    e.keys[0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-30]).to(dtype)
    L, H, T, _ = e.keys.shape
    e.extras = {
        "a2ats.codes": torch.randint(-32768, 32767, (L, H, T), dtype=torch.int16),
        "other.idx": torch.arange(T, dtype=torch.int64) * 3,
        "scale": torch.randn(L, H).to(dtype),
    }
    key = put(store, e)
    assert key in store
    got = store.get(key, FP_A)
    assert got is not None
    assert_same(e, got)
    assert got.nbytes == e.nbytes > 0


def test_round_trip_from_a_new_store_object(tmp_path):
    e = make_entry(dtype=torch.bfloat16)
    with DiskStore(tmp_path) as s1:
        key = put(s1, e)
    with DiskStore(tmp_path) as s2:
        assert_same(e, s2.get(key, FP_A))


def test_loaded_tensors_are_views_of_the_blob_file_and_outlive_it(store, tmp_path):
    """A load maps the blob file instead of copying it: keys, values and extras are views of
    one mapping (no copy per tensor), writable without touching the stored file, and still
    valid after the file is replaced and unlinked (as a concurrent writer or an eviction does)."""
    e = make_entry(
        dtype=torch.bfloat16, T=33, extras={"a2ats.codes": torch.arange(2 * 2 * 33, dtype=torch.int16).view(2, 2, 33)}
    )
    key = put(store, e)
    got = store.get(key, FP_A)
    assert_same(e, got)
    tensors = [got.token_ids, got.keys, got.values, got.extras["a2ats.codes"]]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1  # one buffer: the mapping of the file
    (path,) = blob_files(tmp_path)
    on_disk = path.read_bytes()
    got.keys.zero_()  # copy-on-write: the stored blob is not changed
    assert path.read_bytes() == on_disk
    assert_same(e, store.get(key, FP_A))
    again = store.get(key, FP_A)
    store.put(key, make_entry(dtype=torch.bfloat16, T=33, seed=9))  # new file, the old one unlinked
    assert not path.exists()
    assert_same(e, again)


def test_pinned_read_is_bit_exact_and_falls_back_to_the_mapping_without_cuda(store):
    """get(pin_memory=True) (what the engine asks for on CUDA) gives the same bits in
    page-locked memory where CUDA is available, and the file mapping where it is not."""
    e = make_entry(dtype=torch.float16, T=40)
    key = put(store, e)
    got = store.get(key, FP_A, pin_memory=True)
    assert_same(e, got)
    assert got.keys.is_pinned() == torch.cuda.is_available()
    assert store.stats()["hits"] == 1 and store.stats()["corrupt"] == 0


def test_blob_whose_header_does_not_fit_its_data_is_corrupt(store, tmp_path, caplog):
    """A blob whose checksum holds but whose header places a tensor outside the data (a buggy
    writer) is reported corrupt and deleted, never read past its end."""
    import json

    e = make_entry(T=6)
    key = put(store, e)
    (path,) = blob_files(tmp_path)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["keys"]["shape"][2] = 600  # claims 100x the bytes it has
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    forged = len(text).to_bytes(8, "little") + text + data[8 + n :]
    store._blobs.set(key, forged, tag=blob_mod.checksum(forged))
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        assert store.get(key, FP_A) is None
    assert "does not fit" in caplog.text and key not in store
    assert store.stats()["corrupt"] == 1


def test_make_key_depends_on_fingerprint_and_ids():
    k = make_key(FP_A, [1, 2, 3])
    assert k == make_key(FP_A, torch.tensor([1, 2, 3]))
    assert k == make_key(FP_A, torch.tensor([1, 2, 3], dtype=torch.int32))
    assert len(k) == 64 and set(k) <= set("0123456789abcdef")  # lower-case hex sha256
    assert k != make_key(FP_B, [1, 2, 3])
    assert k != make_key(FP_A, [1, 2, 4])
    assert k != make_key(FP_A, [1, 2])
    with pytest.raises(ValueError, match="ints"):
        make_key(FP_A, [1.5, 2.0])
    with pytest.raises(ValueError, match="fingerprint"):
        make_key("", [1])


# ---- misses and wrong model ------------------------------------------------------------
def test_miss_returns_none(store):
    assert store.get(make_key(FP_A, [1, 2]), FP_A) is None
    assert make_key(FP_A, [1, 2]) not in store
    s = store.stats()
    assert (s["hits"], s["misses"], s["corrupt"]) == (0, 1, 0)


def test_a_read_the_database_refuses_is_a_miss_and_keeps_the_entry(store, monkeypatch, caplog):
    """A read the database refuses (here: its select fails) makes the query compute the chunk,
    not crash, and the sound entry stays. (A failed LRU *touch* is not a miss at all:
    tests/unit/store/test_disk_hostile.py.)"""
    key = put(store, make_entry(fp=FP_A))

    def refused(*a, **k):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store, "_fetch", refused)
    assert store.get(key, FP_A) is None and "cannot read entry" in caplog.text
    monkeypatch.undo()
    assert store.get(key, FP_A) is not None
    assert store.stats()["corrupt"] == 0


def test_wrong_fingerprint_returns_none_and_keeps_entry(store):
    e = make_entry(fp=FP_A)
    key = put(store, e)
    assert store.get(key, FP_B) is None
    assert store.stats()["wrong_model"] == 1
    assert key in store  # a sound entry of another model is not destroyed
    assert_same(e, store.get(key, FP_A))


# ---- integrity -------------------------------------------------------------------------
def _corrupt_case(store, tmp_path, damage, caplog):
    e = make_entry(T=16)
    key = put(store, e)
    other = put(store, make_entry(T=16, seed=1, text="other"))
    files = blob_files(tmp_path)
    assert len(files) == 2
    # Find the file of `key`: the one whose bytes are that entry's blob.
    target = next(
        f for f in files if e.text.encode() in f.read_bytes()[:4096] and b"other" not in f.read_bytes()[:4096]
    )
    damage(target)
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        assert store.get(key, FP_A) is None
    assert key in caplog.text and "corrupt" in caplog.text
    assert key not in store
    assert key not in store.texts(FP_A)
    s = store.stats()
    assert s["corrupt"] == 1 and s["entries"] == 1
    # The intact neighbour is untouched, and the damaged chunk can be stored again.
    assert store.get(other, FP_A) is not None
    store.put(key, e)
    assert_same(e, store.get(key, FP_A))


def test_flipped_bytes_are_detected_and_deleted(store, tmp_path, caplog):
    def flip(path):
        data = bytearray(path.read_bytes())
        for i in range(len(data) - 64, len(data) - 32):  # inside the tensor data, header intact
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))

    _corrupt_case(store, tmp_path, flip, caplog)


def test_truncated_blob_is_detected_and_deleted(store, tmp_path, caplog):
    def truncate(path):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    _corrupt_case(store, tmp_path, truncate, caplog)


def test_missing_blob_file_is_detected_and_deleted(store, tmp_path, caplog):
    _corrupt_case(store, tmp_path, lambda p: p.unlink(), caplog)


def test_blobs_tagged_with_sha256_by_older_stores_still_verify(store, tmp_path):
    """Stores written before the CRC-32 tags hold sha256 hex tags: still read, still checked."""
    import hashlib

    e = make_entry(T=16)
    key = put(store, e)
    (path,) = blob_files(tmp_path)
    data = path.read_bytes()
    assert store._current_tag(key) == blob_mod.checksum(data) and store._current_tag(key).startswith("crc32:")
    store._blobs.set(key, data, tag=hashlib.sha256(data).hexdigest())
    assert_same(e, store.get(key, FP_A))
    # The same bytes under a wrong sha256 (a damaged legacy blob) are dropped, not served.
    store._blobs.set(key, data, tag=hashlib.sha256(data + b"x").hexdigest())
    assert store.get(key, FP_A) is None and key not in store and store.stats()["corrupt"] == 1
    assert not blob_mod.checksum_matches(data, "not-a-tag") and not blob_mod.checksum_matches(data, None)


def test_old_format_version_is_not_used(store, monkeypatch):
    e = make_entry()
    monkeypatch.setattr(blob_mod, "CACHE_FORMAT_VERSION", CACHE_FORMAT_VERSION - 1)
    key = put(store, e)
    monkeypatch.setattr(blob_mod, "CACHE_FORMAT_VERSION", CACHE_FORMAT_VERSION)
    assert store.get(key, FP_A) is None
    assert key not in store and store.stats()["corrupt"] == 1
    # gc --verify drops one too, without a get.
    monkeypatch.setattr(blob_mod, "CACHE_FORMAT_VERSION", CACHE_FORMAT_VERSION - 1)
    key = put(store, e)
    monkeypatch.setattr(blob_mod, "CACHE_FORMAT_VERSION", CACHE_FORMAT_VERSION)
    assert store.gc(verify=True)["corrupt"] == 1 and key not in store


def test_newer_format_version_is_a_miss_and_kept(store, tmp_path, monkeypatch, caplog):
    """A store shared with a newer kvrag: its entries are not served, and neither get nor
    gc --verify deletes them (even with a checksum scheme this version does not know). A model
    fingerprint includes the format version, so the newer kvrag's entries carry another one."""
    FP_NEW = "fingerprint-model-a-format-next"
    e = make_entry(FP_NEW, T=16)
    monkeypatch.setattr(blob_mod, "CACHE_FORMAT_VERSION", blob_mod.PACKED_BLOB_VERSION + 1)
    key = put(store, e)
    other = put(store, make_entry(FP_NEW, T=16, seed=1, text="other"))
    monkeypatch.setattr(blob_mod, "CACHE_FORMAT_VERSION", CACHE_FORMAT_VERSION)
    path = next(f for f in blob_files(tmp_path) if b"other" not in f.read_bytes()[:4096])
    data = path.read_bytes()
    store._blobs.set(other, store._read(other)[0].numpy().tobytes(), tag="xxh64:0123456789abcdef")
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        assert store.get(key, FP_A) is None and store.get(other, FP_A) is None
    assert "newer than this kvrag" in caplog.text
    s = store.stats()
    assert (s["misses"], s["corrupt"], s["entries"]) == (2, 0, 2)
    with diskcache.Cache(str(tmp_path / "index")) as raw:
        assert raw.delete(key)
    report = store.gc(verify=True)
    assert (report["corrupt"], report["reindexed"], report["entries"]) == (0, 0, 2)
    assert key in store and other in store and path.read_bytes() == data
    assert store.stats()["corrupt"] == 0


def test_a_damaged_version_field_under_this_kvrags_fingerprint_is_corrupt(store, tmp_path):
    """One flipped byte can make a blob claim a newer format; under the fingerprint this kvrag
    asked for that can only be damage (a newer kvrag writes another fingerprint): dropped and
    recomputed, not kept forever as "left for the newer kvrag"."""
    key = put(store, make_entry(T=16))
    (path,) = blob_files(tmp_path)
    data = bytearray(path.read_bytes())
    i = data.find(b'"kvrag_format":"1"') + len(b'"kvrag_format":"')
    data[i] ^= 0x02  # "1" -> "3"
    path.write_bytes(bytes(data))
    assert store.get(key, FP_A) is None
    assert key not in store and store.stats()["corrupt"] == 1


def test_an_entry_larger_than_the_size_limit_is_refused_and_evicts_nothing(tmp_path):
    store = DiskStore(tmp_path, size_limit=200_000)
    small = [put(store, make_entry(T=16, seed=i, text=f"t{i}")) for i in range(4)]
    big = make_entry(T=2000, L=2, H=2, D=16, seed=9, text="big")  # ~512 KB of K/V
    with pytest.raises(StoreError, match="larger than the store's size limit"):
        put(store, big)
    assert all(k in store for k in small) and store.stats()["evictions"] == 0
    assert len(store.texts(FP_A)) == 4


def test_a_truncated_blob_is_not_trusted_by_ensure_indexed(store, tmp_path):
    """Precompute asks ``ensure_indexed`` whether a chunk needs computing: a blob cut short
    (disk full, a copy interrupted) must say no, not wait for a query to find out."""
    key = put(store, make_entry(T=16))
    assert store.ensure_indexed(key)
    (path,) = blob_files(tmp_path)
    path.write_bytes(path.read_bytes()[:100])
    assert not store.ensure_indexed(key)
    assert key not in store and store.stats()["corrupt"] == 1


def test_a_damaged_database_under_an_open_store_is_a_miss_not_a_crash(store, tmp_path):
    import threading

    key = put(store, make_entry(T=16))
    for name in ("blobs", "index"):
        (tmp_path / name / diskcache.core.DBNAME).write_bytes(b"x" * 8192)
    out = {}

    def query():  # a new thread opens its own SQLite connection, which reads the damaged file
        out["entry"] = store.get(key, FP_A)
        try:
            store.texts(FP_A)
        except StoreError as e:
            out["texts"] = str(e)

    t = threading.Thread(target=query)
    t.start()
    t.join(30)
    assert out["entry"] is None and "damaged" in out["texts"]


def test_a_damaged_text_index_is_rebuilt_from_the_blobs(tmp_path):
    store = DiskStore(tmp_path)
    keys = [put(store, make_entry(T=16, seed=i, text=f"t{i}")) for i in range(3)]
    store.close()
    (tmp_path / "index" / diskcache.core.DBNAME).write_bytes(b"garbage" * 100)
    reopened = DiskStore(tmp_path)
    assert reopened.texts(FP_A) == {k: f"t{i}" for i, k in enumerate(keys)}
    assert all(reopened.get(k, FP_A) is not None for k in keys)


def test_a_damaged_blob_database_names_the_file_and_the_fix(tmp_path):
    store = DiskStore(tmp_path)
    put(store, make_entry(T=16))
    store.close()
    (tmp_path / "blobs" / diskcache.core.DBNAME).write_bytes(b"garbage" * 100)
    with pytest.raises(StoreError, match="blobs.*damaged.*delete the directory"):
        DiskStore(tmp_path)


def _open_limit(directory, start, q):
    while time.time() < start:
        pass
    q.put(DiskStore(directory).size_limit)


def test_processes_creating_a_store_at_once_all_record_the_default_limit(tmp_path):
    """Without a lock, a process could open the store between its creation and the creator's
    settings write, and record diskcache's own 1 GB default for good."""
    ctx = mp.get_context("fork")
    for trial in range(3):
        d = tmp_path / f"s{trial}"
        q = ctx.Queue()
        start = time.time() + 0.5
        procs = [ctx.Process(target=_open_limit, args=(d, start, q)) for _ in range(5)]
        for p in procs:
            p.start()
        got = [q.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(60)
        assert got == [store_mod.DEFAULT_SIZE_LIMIT] * 5
        assert DiskStore(d).size_limit == store_mod.DEFAULT_SIZE_LIMIT


def test_an_empty_directory_path_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="non-empty path"):
        DiskStore("")
    assert not any(tmp_path.iterdir())


def test_gc_verify_finds_corrupt_blob_without_a_get(store, tmp_path):
    put(store, make_entry(T=16))
    (path,) = blob_files(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    report = store.gc(verify=True)
    assert report["corrupt"] == 1 and report["entries"] == 0
    assert store.texts(FP_A) == {}


def test_gc_verify_repairs_lost_files_and_old_unreferenced_files(store, tmp_path):
    kept = put(store, make_entry(T=16, text="kept"))
    lost = put(store, make_entry(T=16, seed=1, text="lost"))
    (lost_file,) = [f for f in blob_files(tmp_path) if b"lost" in f.read_bytes()[:4096]]
    lost_file.unlink()
    # Files no row points at: one left by a writer that died long ago, one just written.
    stale = tmp_path / "blobs" / "ab" / "cd" / "0123456789abcdef0123456789.val"
    fresh = tmp_path / "blobs" / "ef" / "01" / "fedcba98765432100123456789.val"
    for f in (stale, fresh):
        f.parent.mkdir(parents=True)
        f.write_bytes(b"x" * 100)
    old = os.stat(stale).st_mtime - 2 * check_mod.ORPHAN_GRACE_S
    os.utime(stale, (old, old))
    report = store.gc(verify=True)
    assert report["check_warnings"] == 2 and report["entries"] == 1 and report["corrupt"] == 0
    assert lost not in store and store.texts(FP_A) == {kept: "kept"}
    assert not stale.exists() and not stale.parent.exists()
    assert fresh.exists()  # possibly a concurrent write that has not committed its row yet
    assert store.get(kept, FP_A) is not None
    assert store.gc(verify=True)["check_warnings"] == 0


def _writer_paused_before_commit(directory: str, file_written, may_commit) -> None:
    """put() one entry, stopping after diskcache has written the blob file and before it
    commits the row pointing at it."""
    s = DiskStore(directory)
    disk = s._blobs.disk
    store_file = disk.store

    def store_then_wait(*args, **kwargs):
        result = store_file(*args, **kwargs)
        file_written.set()
        assert may_commit.wait(60)
        return result

    disk.store = store_then_wait
    put(s, make_entry(T=16, text="written during gc"))
    s.close()


def test_gc_verify_keeps_the_file_of_a_write_in_progress(tmp_path):
    """gc --verify in one process must not delete the blob file another process has written
    and is about to commit (diskcache's check(fix=True) did: the entry was then lost)."""
    DiskStore(tmp_path).close()
    ctx = mp.get_context("spawn")
    file_written, may_commit = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_writer_paused_before_commit, args=(str(tmp_path), file_written, may_commit))
    p.start()
    try:
        assert file_written.wait(60)
        (path,) = blob_files(tmp_path)
        with DiskStore(tmp_path) as s:
            assert s.stats()["entries"] == 0  # no row yet
            s.gc(verify=True)
            assert path.exists()
    finally:
        may_commit.set()
        p.join(60)
    assert p.exitcode == 0
    e = make_entry(T=16, text="written during gc")
    with DiskStore(tmp_path) as s:
        assert_same(e, s.get(make_key(FP_A, e.token_ids), FP_A))
        assert s.stats()["corrupt"] == 0


# ---- eviction --------------------------------------------------------------------------
def test_lru_eviction_keeps_recently_used(tmp_path):
    big = dict(T=64, L=2, H=2, D=64)  # 128 KiB of K/V per entry
    entries = {n: make_entry(seed=i, text=f"chunk {n}", **big) for i, n in enumerate("ABCD")}
    blob = entries["A"].nbytes
    base = DiskStore(tmp_path / "probe").stats()["bytes"]  # empty SQLite file
    # Room for three entries, not four.
    s = DiskStore(tmp_path / "s", size_limit=base + 3 * blob + blob // 2)
    keys = {n: put(s, entries[n]) for n in "ABC"}
    assert all(k in s for k in keys.values()) and s.stats()["evictions"] == 0
    assert s.get(keys["A"], FP_A) is not None  # A is now more recent than B and C
    keys["D"] = put(s, entries["D"])
    assert keys["B"] not in s  # least recently used
    for n in "ACD":
        assert_same(entries[n], s.get(keys[n], FP_A))
    st = s.stats()
    assert st["evictions"] == 1 and st["entries"] == 3 and st["bytes"] <= st["size_limit"]
    assert set(s.texts(FP_A)) == {keys[n] for n in "ACD"}
    s.close()


def test_entry_larger_than_limit_is_not_kept(tmp_path, caplog):
    # The entry alone is under the limit, with the store's own SQLite file it is over.
    base = DiskStore(tmp_path / "probe").stats()["bytes"]
    s = DiskStore(tmp_path / "s", size_limit=base + 1024)
    e = make_entry(T=16, D=16)
    assert 1024 < (e.keys.numel() + e.values.numel()) * 4 < base
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        key = put(s, e)
    assert key not in s and "leaves no room for it" in caplog.text
    assert s.texts(FP_A) == {}


# ---- text index ------------------------------------------------------------------------
def test_texts_per_fingerprint_and_gc(store, tmp_path):
    a1 = put(store, make_entry(fp=FP_A, text="alpha one", seed=1))
    a2 = put(store, make_entry(fp=FP_A, text="alpha two", seed=2))
    b1 = put(store, make_entry(fp=FP_B, text="beta one", seed=3))
    assert store.texts(FP_A) == {a1: "alpha one", a2: "alpha two"}
    assert store.texts(FP_B) == {b1: "beta one"}
    assert store.texts("unknown") == {}

    assert store.delete(a2) is True
    assert store.delete(a2) is False
    assert store.texts(FP_A) == {a1: "alpha one"}

    # A blob removed behind the store's back (eviction by another process, a crash):
    # texts() stops listing it at once, gc() removes the stale index entry.
    with diskcache.Cache(str(tmp_path / "blobs")) as raw:
        assert raw.delete(a1)
    assert store.texts(FP_A) == {}
    assert store.gc()["index_dropped"] == 1

    # A writer that died between the blob and the index write: gc() re-indexes the blob.
    with diskcache.Cache(str(tmp_path / "index")) as raw:
        assert raw.delete(b1)
    assert store.texts(FP_B) == {}
    report = store.gc()
    assert report["reindexed"] == 1 and report["index_dropped"] == 0
    assert store.texts(FP_B) == {b1: "beta one"}

    store.clear()
    assert store.texts(FP_B) == {} and store.stats()["entries"] == 0


def test_stats_fields(store):
    k1 = put(store, make_entry(seed=1))
    put(store, make_entry(seed=2))
    assert store.get(k1, FP_A) is not None
    assert store.get(k1, FP_A) is not None
    assert store.get(make_key(FP_A, [9]), FP_A) is None
    s = store.stats()
    assert s["entries"] == 2 and s["bytes"] > 2 * make_entry().nbytes
    assert s["size_limit"] == 16 * 2**30
    assert (s["hits"], s["misses"]) == (2, 1)
    assert s["hit_rate"] == pytest.approx(2 / 3)
    assert s["corrupt"] == 0 and s["wrong_model"] == 0 and s["evictions"] == 0


# ---- several processes -----------------------------------------------------------------
SHARED_IDS = [11, 22, 33, 44]
N_WRITES = 25


def _versioned_entry(wid: int, i: int) -> ChunkEntry:
    """A valid entry whose every part says who wrote it: a torn mix would be detected."""
    tag = float(wid * 1000 + i)
    T = len(SHARED_IDS)
    return ChunkEntry(
        fingerprint=FP_A,
        text=f"writer {wid} version {i}",
        token_ids=torch.tensor(SHARED_IDS),
        keys=torch.full((2, 2, T, 16), tag),
        values=torch.full((2, 2, T, 16), -tag),
        extras={"codes": torch.full((2, 2, T), wid * 1000 + i, dtype=torch.int32)},
    )


def _check_versioned(e: ChunkEntry) -> None:
    wid, i = int(e.text.split()[1]), int(e.text.split()[3])
    assert_same(_versioned_entry(wid, i), e)


def _writer(directory: str, wid: int) -> None:
    s = DiskStore(directory)
    shared = make_key(FP_A, SHARED_IDS)
    for i in range(N_WRITES):
        s.put(shared, _versioned_entry(wid, i))
        own = make_entry(text=f"own {wid} {i}", seed=100 * wid + i)
        put(s, own)
        got = s.get(shared, FP_A)
        assert got is not None
        _check_versioned(got)
    assert s.stats()["corrupt"] == 0
    s.close()


def test_two_processes_writing_at_once(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w)) for w in (1, 2)]
    for p in procs:
        p.start()
    s = DiskStore(tmp_path)
    shared = make_key(FP_A, SHARED_IDS)
    seen = 0
    while any(p.is_alive() for p in procs):  # read while they write
        got = s.get(shared, FP_A)
        if got is not None:
            _check_versioned(got)
            seen += 1
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert seen > 0  # the reads above overlapped the writes
    final = s.get(shared, FP_A)  # one writer's last version, whole
    assert final is not None and final.text.endswith(f"version {N_WRITES - 1}")
    _check_versioned(final)
    assert s.stats()["corrupt"] == 0

    final = s.get(shared, FP_A)
    _check_versioned(final)
    # The text index agrees with the blob that won the race.
    texts = s.texts(FP_A)
    assert texts[shared] == final.text
    # One valid entry per key: the shared one plus every writer's own chunks.
    assert len(texts) == 1 + 2 * N_WRITES == s.stats()["entries"]
    for w in (1, 2):
        for i in range(N_WRITES):
            own = make_entry(text=f"own {w} {i}", seed=100 * w + i)
            assert_same(own, s.get(make_key(FP_A, own.token_ids), FP_A))
    assert len(blob_files(tmp_path)) == 1 + 2 * N_WRITES  # replaced versions were cleaned up
    assert s.gc(verify=True)["corrupt"] == 0
    s.close()


# ---- bad input -------------------------------------------------------------------------
def test_put_rejects_empty_and_inconsistent_entries(store):
    key = "k"
    with pytest.raises(ValueError, match="T == 0"):
        store.put(key, make_entry(T=0))
    e = make_entry(T=4)
    e.values = e.values[:, :, :3]
    with pytest.raises(ValueError, match="shape mismatch"):
        store.put(key, e)
    e = make_entry(T=4)
    e.token_ids = e.token_ids[:3]
    with pytest.raises(ValueError, match="3 token ids but keys/values hold T=4"):
        store.put(key, e)
    e = make_entry(T=4)
    e.keys, e.values = e.keys[0], e.values[0]
    with pytest.raises(ValueError, match=r"\[L, Hkv, T, D\]"):
        store.put(key, e)
    e = make_entry(T=4)
    e.token_ids = e.token_ids.float()
    with pytest.raises(ValueError, match="integers"):
        store.put(key, e)
    with pytest.raises(ValueError, match="key"):
        store.put("", make_entry())
    assert store.stats()["entries"] == 0


def test_unusable_directory_gives_clear_error(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="DiskStore directory") as ei:
        DiskStore(blocker / "store")
    assert str(blocker / "store") in str(ei.value)
    with pytest.raises(OSError, match="DiskStore directory"):
        DiskStore(blocker)  # a file where the directory should be


def test_bad_size_limit(tmp_path):
    with pytest.raises(ValueError, match="size_limit"):
        DiskStore(tmp_path, size_limit=0)


def test_size_limit_is_recorded_in_the_store(tmp_path):
    d = tmp_path / "s"
    with DiskStore(d) as s:
        assert s.size_limit == 16 * 2**30  # a new store without a limit
    with DiskStore(d, size_limit=40 * 2**30) as s:
        assert s.size_limit == 40 * 2**30
    # Opened again without a limit (another process, `kvrag cache gc/stats`): the recorded
    # 40 GiB, not a smaller default that would evict a store configured larger.
    with DiskStore(d) as s:
        assert s.size_limit == s.stats()["size_limit"] == 40 * 2**30
    with DiskStore(d, size_limit=2**20) as s:
        pass
    with DiskStore(d) as s:
        assert s.size_limit == 2**20
