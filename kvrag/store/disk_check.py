"""The consistency checks of a ``DiskStore``: whether a blob file is whole and is its key's,
and ``gc(verify=True)``'s check of a cache's rows against the files in its directory.

Each check says what is wrong (a problem, as text) and leaves the repair to the store, which
deletes only the version it read (``DiskStore._drop_corrupt``): a check never races a writer
into deleting the entry it has just written.
"""

from __future__ import annotations

import io
import logging
import os
import time
from pathlib import Path

import diskcache
import diskcache.core
import torch

from kvrag.store.base import ChunkEntry, make_key
from kvrag.store.blob import (
    Corrupt,
    data_end,
    deserialize,
    is_newer_format,
    metadata,
    read_file_header,
    verified_header,
)

# The disk tier's one logger, whichever of its modules speaks.
log = logging.getLogger("kvrag.store.disk")

#: gc(verify=True) removes a file that no row points at only once it is this old (seconds):
#: diskcache writes a value's file *before* committing the row that points at it, so a young
#: unreferenced file is most likely a write in progress in another process. A writer commits
#: within seconds (longer only while waiting for the database lock); an hour leaves it ample
#: time, and the files of writers that died are still reclaimed by a later gc. A file whose name
#: shows a writer of this host that no longer runs (``ConfinedDisk.writer_is_dead``) goes at once.
ORPHAN_GRACE_S = 3600.0


def check_owner(key: str, entry: ChunkEntry) -> None:
    """Corrupt unless ``key`` is ``make_key`` of the entry's own fingerprint and token ids: the
    checksum only says the bytes are those written, not that they were written for this key (a
    blob copied or forged under another chunk's key). One sha256 of T int64 ids: microseconds."""
    try:
        owner = make_key(entry.fingerprint, entry.token_ids)
    except ValueError as e:
        raise Corrupt(f"entry has no valid key: {e}") from None
    if owner != key:
        raise Corrupt(f"the blob's fingerprint and token ids belong to key {owner}, not to this key")


def truncation(handle) -> str | None:
    """Whether the blob file open as ``handle`` has the length its own header declares (header
    only, no checksum: cheap enough for every precompute of a cached text): the problem, or
    None when it has (or cannot be judged here: a value held in SQLite, checked when read; a
    newer format, not ours to judge). Closes ``handle``."""
    with handle:
        try:
            size = os.fstat(handle.fileno()).st_size
        except (AttributeError, io.UnsupportedOperation):
            return None
        end = None
        try:
            header, start = read_file_header(handle)
            if is_newer_format(metadata(header)):
                return None
            end = start + data_end(header)
        except Corrupt:
            pass
    if end is None or size != end:
        return f"file of {size} bytes, its header says {'?' if end is None else end}"
    return None


def misfit(handle, stored: int | None) -> str | None:
    """For a blob the store refused to read: whether its file's length is not the one its row
    records (``stored``) and its header declares (a file swapped or cut short): the problem,
    or None (also for a value held in SQLite). Closes ``handle``."""
    with handle:
        try:
            size = os.fstat(handle.fileno()).st_size
        except (AttributeError, io.UnsupportedOperation, OSError):
            return None
        try:
            header, start = read_file_header(handle)
            end = start + data_end(header)
        except Corrupt:
            end = None
    if size == stored and size == end:
        return None
    return f"file of {size} bytes, its row says {stored} and its header {end}"


def blob_problem(key: str, buf: torch.Tensor, tag: str | None) -> str | None:
    """The full check of one blob read as ``buf`` (uint8 [bytes]) with its row's ``tag``:
    checksum, format, tensors, and that it is ``key``'s; the problem, or None (a newer format
    is left for the kvrag that wrote it)."""
    try:
        verified = verified_header(buf, tag)
        if verified is not None:
            check_owner(key, deserialize(buf, *verified))
    except Corrupt as e:
        return str(e)
    return None


def check_files(cache: diskcache.Cache, *, blobs: diskcache.Cache, index: diskcache.Cache) -> int:
    """gc(verify=True)'s consistency check of ``cache`` (one of the store's two caches,
    ``blobs`` or ``index``): SQLite's integrity check, rows whose file is gone (deleted, with
    their text-index entry) and files that no row points at (removed once older than
    ``ORPHAN_GRACE_S``). Returns the number of problems found.

    This replaces diskcache's ``check(fix=True)``, which removes every file without a row,
    including the file a concurrent ``set`` in another process has written but not yet
    pointed its row at: that entry was then lost (its row pointing at a missing file)."""
    problems = 0
    for (message,) in cache._sql("PRAGMA integrity_check").fetchall():
        if message != "ok":
            log.warning("DiskStore: SQLite integrity check of %s: %s", cache.directory, message)
            problems += 1
    root = Path(cache.directory)
    select = "SELECT rowid, key, raw, filename FROM Cache WHERE filename IS NOT NULL"
    # Rows without files. A snapshot finds candidates without holding the write lock; each
    # is confirmed inside a transaction, where its row cannot change and its file cannot
    # legitimately vanish (diskcache removes a replaced file only after its row changed).
    missing = [row for row in cache._sql(select).fetchall() if not cache.disk.exists(row[3])]
    for rowid, db_key, raw, filename in missing:
        with blobs.transact(retry=True), cache.transact(retry=True):
            still = cache._sql("SELECT 1 FROM Cache WHERE rowid = ? AND filename = ?", (rowid, filename)).fetchall()
            if not still or cache.disk.exists(filename):
                continue
            # A file name outside the store counts as missing: the row goes, the file stays.
            cache._sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
            if cache is blobs and raw and isinstance(db_key, str):  # ours (never unpickle one)
                index.delete(db_key, retry=True)
        log.warning("DiskStore: entry %s in %s lost its file %s; deleted", db_key, cache.directory, filename)
        problems += 1
    # Files without rows: list the files first, then the names the rows point at, so a
    # file committed in between is seen as referenced.
    on_disk = {}
    for dirpath, _, files in os.walk(root):
        for fname in files:
            if diskcache.core.DBNAME not in fname:  # cache.db and its -wal/-shm files
                path = Path(dirpath) / fname
                on_disk[os.path.relpath(path, root)] = path
    referenced = {name for (name,) in cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    now = time.time()
    for rel, path in on_disk.items():
        if rel in referenced:
            continue
        try:
            age = now - path.lstat().st_mtime
        except OSError:  # removed meanwhile (e.g. the old file of a replaced value)
            continue
        if age < ORPHAN_GRACE_S and not cache.disk.writer_is_dead(rel):
            log.debug("DiskStore: unreferenced file %s is %.0f s old: a write in progress, kept", path, age)
            continue
        log.info("DiskStore: removing %s, a file no entry points at (%.0f s old)", path, age)
        cache.disk.remove(rel)  # also removes its directories once empty
        problems += 1
    return problems
