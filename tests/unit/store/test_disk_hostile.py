"""A store directory is data, never code: crafted rows, headers, special files and
texts give misses, never code execution, a file touched outside the store, a hang or an
exception on the query path; a full disk or a held lock is reported as what it is."""

import json
import os
import pickle
import sqlite3
import subprocess
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from helpers.store_entries import FP_A, blob_files, make_entry, put  # noqa: E402

import kvrag.store.blob as blob_mod  # noqa: E402
from kvrag.cli import main as cli_main  # noqa: E402
from kvrag.errors import StoreError  # noqa: E402
from kvrag.store import DiskStore  # noqa: E402


class _Plant:
    """Unpickling this creates ``path`` (open(path, "w")): proof that a pickle ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _sql(db: Path, statement: str, args=()):
    con = sqlite3.connect(str(db), isolation_level=None)
    try:
        return con.execute(statement, args).fetchall()
    finally:
        con.close()


def _blob_row(directory: Path, key: str, **columns):
    sets = ", ".join(f"{c} = ?" for c in columns)
    _sql(directory / "blobs" / "cache.db", f"UPDATE Cache SET {sets} WHERE key = ?", (*columns.values(), key))


def _replace_blob(directory: Path, key: str, data: bytes) -> None:
    """Rewrite the blob file under ``key`` with ``data``, its row's size and tag to match:
    what an attacker who can write the store does (the checksum is no secret)."""
    (path,) = blob_files(directory)
    path.write_bytes(data)
    _blob_row(directory, key, size=len(data), tag=blob_mod.checksum(data))


@pytest.fixture
def store(tmp_path):
    s = DiskStore(tmp_path / "store")
    yield s
    s.close()


# ---- 1. rows: no pickle runs, no path leaves the store -------------------------------
def test_a_pickled_value_row_is_a_miss_and_never_unpickled(store, tmp_path):
    marker = tmp_path / "pwned"
    key = put(store, make_entry())
    _blob_row(store.directory, key, mode=4, filename=None, value=pickle.dumps(_Plant(marker)))
    assert store.get(key, FP_A) is None
    assert not marker.exists()
    # And from a file: diskcache unpickles a MODE_PICKLE row's file too.
    key2 = put(store, make_entry(seed=1, text="second"))
    name = _sql(store.directory / "blobs" / "cache.db", "SELECT filename FROM Cache WHERE key = ?", (key2,))[0][0]
    (store.directory / "blobs" / name).write_bytes(pickle.dumps(_Plant(marker)))
    _blob_row(store.directory, key2, mode=4)
    assert store.get(key2, FP_A) is None
    store.gc(verify=True)  # reads every row too
    assert not marker.exists() and len(store._blobs) == 0  # both crafted rows dropped


def test_a_pickled_key_in_the_text_index_is_skipped_and_never_unpickled(store, tmp_path):
    marker = tmp_path / "pwned"
    key = put(store, make_entry(text="listed"))
    _sql(
        store.directory / "index" / "cache.db",
        "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, "
        "filename, value) VALUES (?, 0, 0, NULL, 0, 0, NULL, 0, 1, NULL, ?)",
        (pickle.dumps(_Plant(marker)), json.dumps({"text": "x", "fingerprint": FP_A})),
    )
    _sql(
        store.directory / "blobs" / "cache.db",
        "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, "
        "filename, value) VALUES (?, 0, 0, NULL, 0, 0, NULL, 0, 1, NULL, ?)",
        (pickle.dumps(_Plant(marker)), b"x"),
    )
    assert store.texts(FP_A) == {key: "listed"}
    store.gc(verify=True)
    assert DiskStore(store.directory).texts(FP_A) == {key: "listed"}  # reopening re-indexes the blobs
    assert not marker.exists()


@pytest.mark.parametrize("outside_name", ["../../outside/victim.val", "ABSOLUTE"])
def test_a_file_name_outside_the_store_is_neither_read_nor_deleted(store, tmp_path, outside_name):
    victim = tmp_path / "outside" / "victim.val"
    victim.parent.mkdir()
    key = put(store, make_entry())
    (own,) = blob_files(store.directory)
    victim.write_bytes(own.read_bytes())  # a valid blob for this key: reading it would be a hit
    name = str(victim) if outside_name == "ABSOLUTE" else outside_name
    _blob_row(store.directory, key, filename=name)
    assert store.get(key, FP_A) is None
    assert key not in store  # the row is dropped as broken...
    store.gc(verify=True)
    assert victim.read_bytes() == own.read_bytes()  # ...the file it named is untouched
    assert victim.parent.is_dir()


def test_a_blob_replaced_by_a_symlink_is_a_miss_and_its_target_survives(store, tmp_path):
    target = tmp_path / "outside.val"
    key = put(store, make_entry())
    (own,) = blob_files(store.directory)
    target.write_bytes(own.read_bytes())
    own.unlink()
    own.symlink_to(target)
    assert store.get(key, FP_A) is None
    store.gc(verify=True)
    assert target.read_bytes()  # never deleted through the link


def test_crafted_settings_are_removed_not_obeyed(tmp_path):
    d = tmp_path / "store"
    DiskStore(d).close()
    db = d / "blobs" / "cache.db"
    # diskcache would setattr the Disk's directory and run PRAGMA temp_store_directory.
    _sql(db, "INSERT INTO Settings VALUES ('disk__directory', ?)", (str(tmp_path / "elsewhere"),))
    _sql(db, "INSERT INTO Settings VALUES ('sqlite_temp_store_directory', ?)", (str(tmp_path),))
    _sql(db, "UPDATE Settings SET value = 'lots' WHERE key = 'size_limit'")
    with DiskStore(d) as s:
        key = put(s, make_entry())
        assert s.get(key, FP_A) is not None
        assert s.size_limit > 0
    keys = {k for (k,) in _sql(db, "SELECT key FROM Settings")}
    assert not {"disk__directory", "sqlite_temp_store_directory"} & keys
    assert not (tmp_path / "elsewhere").exists()


def test_a_database_file_that_is_a_symlink_is_refused(tmp_path):
    d = tmp_path / "store"
    elsewhere = tmp_path / "someone_elses.db"
    sqlite3.connect(str(elsewhere)).close()
    before = elsewhere.read_bytes()
    (d / "blobs").mkdir(parents=True)
    (d / "blobs" / "cache.db").symlink_to(elsewhere)
    with pytest.raises(StoreError, match="symbolic link"):
        DiskStore(d)
    assert elsewhere.read_bytes() == before


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_not_created(tmp_path):
    d = tmp_path / "store"
    d.mkdir()
    (d / ".kvstore.lock").symlink_to(tmp_path / "created_elsewhere")
    with pytest.raises(StoreError, match="lock file"):
        DiskStore(d)
    assert not (tmp_path / "created_elsewhere").exists()


# ---- 2. crafted headers and special files ---------------------------------------------
def _blob_with_header(header_json: bytes, data: bytes = b"") -> bytes:
    return len(header_json).to_bytes(8, "little") + header_json + data


META = {"kvrag_format": "1", "fingerprint": FP_A, "text": "t", "n_tokens": "1"}


@pytest.mark.parametrize(
    "header",
    [
        # 1e400 is inf as a float: int(inf) raised OverflowError.
        b'{"__metadata__": %s, "token_ids": {"dtype": "I64", "shape": [1e400], "data_offsets": [0, 8]}}',
        b'{"__metadata__": %s, "token_ids": {"dtype": "I64", "shape": [1], "data_offsets": [0, Infinity]}}',
        b'{"__metadata__": %s, "token_ids": {"dtype": "I64", "shape": [1], "data_offsets": [0, NaN]}}',
        # The header is parsed before the checksum: this raised RecursionError.
        b'{"__metadata__": %s, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"__metadata__": %s, "token_ids": {"dtype": "I64", "shape": [true], "data_offsets": [0, 8]}}',
        b'{"__metadata__": %s, "token_ids": {"dtype": ["I64"], "shape": [1], "data_offsets": [0, 8]}}',
    ],
    ids=["1e400", "Infinity", "NaN", "nested", "bool-shape", "list-dtype"],
)
def test_a_crafted_header_is_corrupt_for_get_gc_and_the_cli(store, header, capsys):
    key = put(store, make_entry())
    _replace_blob(store.directory, key, _blob_with_header(header % json.dumps(META).encode(), b"\0" * 8))
    store.ensure_indexed(key)  # precompute's check: a header it cannot read is dropped, no exception
    store.texts(FP_A)
    assert store.get(key, FP_A) is None and key not in store and store.stats()["corrupt"] == 1
    key = put(store, make_entry())
    _replace_blob(store.directory, key, _blob_with_header(header % json.dumps(META).encode(), b"\0" * 8))
    store.close()
    assert cli_main(["cache", "gc", "--verify", "--cache-dir", str(store.directory)]) == 0
    assert "corrupt deleted  1" in capsys.readouterr().out


def test_a_header_length_beyond_the_bound_is_corrupt_without_reading_it():
    data = (blob_mod.MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b" " * (blob_mod.MAX_HEADER_BYTES + 1)
    with pytest.raises(blob_mod.Corrupt, match="header length"):
        blob_mod.read_header(data)


def test_a_blob_replaced_by_a_link_to_dev_zero_is_a_miss(store):
    key = put(store, make_entry())
    (own,) = blob_files(store.directory)
    own.unlink()
    own.symlink_to("/dev/zero")
    assert store.get(key, FP_A) is None
    assert not store.ensure_indexed(key)


def _within(seconds: float, fn, *args):
    """fn(*args) in a thread; fails (instead of hanging the suite) if it has not returned."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} hung"
    return out.get("r")


def test_a_blob_replaced_by_a_fifo_never_hangs(store):
    key = put(store, make_entry())
    (own,) = blob_files(store.directory)
    own.unlink()
    os.mkfifo(own)
    assert _within(20, store.get, key, FP_A) is None
    key = put(store, make_entry(seed=1))
    (own,) = [f for f in blob_files(store.directory) if f.is_file()]
    own.unlink()
    os.mkfifo(own)
    assert _within(20, store.ensure_indexed, key) is False
    _within(20, lambda: store.gc(verify=True))


# ---- 3. the text index -----------------------------------------------------------------
def test_put_refuses_a_blank_text(store):
    with pytest.raises(ValueError, match="non-whitespace"):
        put(store, make_entry(text=" \n\t "))
    assert len(store._blobs) == 0


@pytest.mark.parametrize("bad", [None, 7, " \n", ["a list"]])
def test_one_bad_text_index_row_is_skipped_and_repaired(store, bad):
    good = put(store, make_entry(text="good"))
    key = put(store, make_entry(seed=1, text="repairable"))
    store._index.set(key, json.dumps({"text": bad, "fingerprint": FP_A, "n_tokens": 5}))
    assert store.texts(FP_A) == {good: "good"}
    assert store.gc()["reindexed"] == 1
    assert store.texts(FP_A) == {good: "good", key: "repairable"}
    store._index.set(key, "not json {")
    assert store.ensure_indexed(key)  # what precompute calls for a text already stored
    assert store.texts(FP_A)[key] == "repairable"


# ---- 4. errors that tell the truth ------------------------------------------------------
@pytest.fixture
def held_lock(store):
    """A second connection holding the blob database's write lock."""
    con = sqlite3.connect(str(store.directory / "blobs" / "cache.db"), isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
    yield
    con.execute("ROLLBACK")
    con.close()


def test_a_locked_store_is_reported_as_locked_and_reads_go_on(store, tmp_path):
    key = put(store, make_entry(text="before the lock"))
    store.close()
    s = DiskStore(store.directory, timeout=0.2)
    con = sqlite3.connect(str(store.directory / "blobs" / "cache.db"), isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
    try:
        assert s.get(key, FP_A) is not None  # the LRU touch cannot be written: skipped, still a hit
        with pytest.raises(StoreError, match="locked") as e:
            put(s, make_entry(seed=1))
        assert "is damaged" not in str(e.value) and "delete" not in str(e.value)
        with pytest.raises(StoreError, match="locked") as e:
            DiskStore(store.directory, timeout=0.2)
        assert "is damaged" not in str(e.value) and "delete" not in str(e.value)
    finally:
        con.execute("ROLLBACK")
        con.close()
    assert s.get(key, FP_A) is not None
    s.close()


@pytest.fixture
def tiny_disk(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"a full disk needs a small tmpfs, and mounting one failed here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_is_reported_as_full_and_reads_still_hit(tiny_disk):
    s = DiskStore(tiny_disk / "store")
    first = put(s, make_entry(T=64, text="first"))
    with pytest.raises(StoreError, match="disk is full") as e:
        for i in range(1, 40):  # ~16 KiB per entry and ~0.5 MiB of SQLite files: 2 MiB fills
            put(s, make_entry(T=64, D=32, seed=i, text=f"chunk {i}"))
    assert "is damaged" not in str(e.value) and "delete" not in str(e.value)
    # Reads do not need the disk to write (the LRU touch is best effort).
    assert s.get(first, FP_A) is not None and s.stats()["hits"] == 1
    # No file of the failed write is left behind: every blob file is one a row points at.
    rows = {n for (n,) in s._blobs._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    on_disk = {os.path.relpath(f, tiny_disk / "store" / "blobs") for f in blob_files(tiny_disk / "store")}
    assert on_disk == rows
    s.close()


# ---- 5. forged entries -----------------------------------------------------------------
def test_a_valid_blob_under_another_chunks_key_is_a_miss_and_dropped_by_gc(store):
    a = put(store, make_entry(text="a"))
    b_entry = make_entry(seed=1, text="b")
    b_bytes = blob_mod.serialize(b_entry, b_entry.token_ids)
    _replace_blob(store.directory, a, b_bytes)
    assert store.get(a, FP_A) is None and a not in store
    a = put(store, make_entry(text="a"))
    _replace_blob(store.directory, a, b_bytes)
    assert store.gc(verify=True)["corrupt"] == 1 and a not in store


def test_integer_kv_or_a_blank_text_is_never_served(store):
    e = make_entry()
    key = put(store, e)
    forged = safetensors.torch.save(
        {"token_ids": e.token_ids, "keys": e.keys.to(torch.uint8), "values": e.values.to(torch.uint8)},
        metadata={"kvrag_format": "1", "fingerprint": FP_A, "text": "t", "n_tokens": str(e.token_ids.numel())},
    )
    _replace_blob(store.directory, key, forged)
    assert store.get(key, FP_A) is None
    key = put(store, e)
    forged = blob_mod.serialize(e, e.token_ids).replace(b'"text":"some chunk text"', b'"text":"               "')
    _replace_blob(store.directory, key, forged)
    assert store.get(key, FP_A) is None
    for text in (12345, None, ["some chunk text"]):  # safetensors metadata is str -> str
        key = put(store, e)
        data = blob_mod.serialize(e, e.token_ids)
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        header["__metadata__"]["text"] = text
        _replace_blob(store.directory, key, _blob_with_header(json.dumps(header).encode(), data[8 + n :]))
        assert store.get(key, FP_A) is None
        assert key not in store and key not in store.texts(FP_A)


def test_layout_problem_names_what_does_not_fit_the_model():
    e = make_entry(L=2, H=2, D=8)
    assert e.layout_problem((2, 2, 8)) is None
    assert "expected [L, Hkv, T, D]" in e.layout_problem((3, 2, 8))
    assert "expected [L, Hkv, T, D]" in e.layout_problem((2, 2, 16))


def test_gc_removes_at_once_the_unreferenced_file_of_a_writer_that_died(store):
    """A write killed between its file and its row leaves a file no row points at; its name
    carries the writer's host and pid, so gc --verify need not wait an hour for it."""
    from kvrag.store.confined import _host_id

    put(store, make_entry())
    dead = subprocess.Popen(["true"])
    dead.wait()
    blobs = store.directory / "blobs"
    names = {
        "dead": f"{_host_id()}-{dead.pid}",
        "alive": f"{_host_id()}-{os.getpid()}",
        "other_host": f"0badc0de-{dead.pid}",
    }
    files = {}
    for what, owner in names.items():
        f = blobs / "ab" / "cd" / f"{what:0<28}.{owner}.val"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 100)
        files[what] = f
    assert store.gc(verify=True)["check_warnings"] == 1
    assert not files["dead"].exists()
    assert files["alive"].exists() and files["other_host"].exists()  # a write in progress, maybe
    # And what put writes is named so: the writer's own file is kept while it runs.
    (own,) = [f for f in blob_files(store.directory) if f not in files.values()]
    assert own.name.endswith(f".{_host_id()}-{os.getpid()}.val")


def test_a_key_that_is_not_a_str_is_a_miss(store):
    for key in (None, 5, b"k", ("a",)):
        assert store.get(key, FP_A) is None and key not in store and not store.delete(key)
        assert not store.ensure_indexed(key)


def test_a_tensor_of_a_million_dimensions_is_corrupt(store):
    e = make_entry()
    key = put(store, e)
    data = blob_mod.serialize(e, e.token_ids)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["extras.x"] = {"dtype": "U8", "shape": [1] * 1_000_000, "data_offsets": [0, 1]}
    _replace_blob(store.directory, key, _blob_with_header(json.dumps(header).encode(), data[8 + n :]))
    assert _within(20, store.get, key, FP_A) is None


# ---- processes: killed writers, readers against an evicting writer ------------------------
def _endless_writer(directory: str, seed: int, size_limit) -> None:
    s = DiskStore(directory, size_limit=size_limit)
    i = 0
    while True:  # until killed
        put(s, make_entry(T=32, D=32, seed=seed + i, text=f"chunk {seed + i}"))
        i += 1


def _entry_of(text: str):
    return make_entry(T=32, D=32, seed=int(text.split()[1]), text=text)


def _wait_for(pred, seconds=60.0):
    import time

    end = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_writers_killed_mid_write_leave_only_whole_entries_and_no_dead_files(tmp_path):
    import multiprocessing as mp
    import signal

    from helpers.store_entries import assert_same

    ctx = mp.get_context("spawn")
    d = tmp_path / "store"
    DiskStore(d).close()
    p = ctx.Process(target=_endless_writer, args=(str(d), 0, None))
    p.start()
    with DiskStore(d) as s:
        _wait_for(lambda: len(s._blobs) >= 11)
    os.kill(p.pid, signal.SIGKILL)  # wherever it is: mid-file, mid-transaction, between the two caches
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    with DiskStore(d) as s:
        report = s.gc(verify=True)
        assert report["corrupt"] == 0
        texts = s.texts(FP_A)
        assert len(texts) == report["entries"] >= 11
        for key, text in texts.items():
            assert_same(_entry_of(text), s.get(key, FP_A))
        # A file the killed writers wrote but never committed is gone at once (its writer is
        # dead), not an hour later: every blob file left is one a row points at.
        rows = {n for (n,) in s._blobs._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
        assert {os.path.relpath(f, d / "blobs") for f in blob_files(d)} == rows


def test_readers_against_an_evicting_writer_get_whole_entries_or_misses(tmp_path):
    import multiprocessing as mp
    import time

    from helpers.store_entries import assert_same

    d = tmp_path / "store"
    per_entry = len(blob_mod.serialize(e := _entry_of("chunk 0"), e.token_ids))
    with DiskStore(d) as s:
        sqlite_bytes = s._blobs.volume()
    with DiskStore(d, size_limit=sqlite_bytes + 6 * per_entry) as s:  # room for a handful of entries
        p = mp.get_context("spawn").Process(target=_endless_writer, args=(str(d), 0, None))
        p.start()
        try:
            _wait_for(lambda: s.stats()["entries"] >= 3)
            hits = misses = 0
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                for key, text in s.texts(FP_A).items():
                    got = s.get(key, FP_A)
                    if got is None:
                        misses += 1
                    else:
                        assert_same(_entry_of(text), got)
                        hits += 1
        finally:
            p.kill()
            p.join(30)
        assert hits > 0 and s.stats()["corrupt"] == 0
        assert s.stats()["entries"] <= 8  # the writer kept evicting while we read


def test_a_put_never_writes_through_a_symlinked_directory(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    d = tmp_path / "store"
    DiskStore(d).close()
    for i in range(256):  # every first-level directory a new value file may land in
        (d / "blobs" / f"{i:02x}").symlink_to(outside, target_is_directory=True)
    with DiskStore(d) as s:
        with pytest.raises(OSError, match="not a directory of the store"):
            put(s, make_entry())
        assert len(s._blobs) == 0
    assert not any(outside.iterdir())
