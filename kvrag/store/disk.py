"""``DiskStore``: the on-disk store of per-chunk KV caches.

Layout under ``directory``::

    blobs/   a ``diskcache.Cache`` (SQLite index + one file per value)
             key   = make_key(fingerprint, token_ids)  (sha256 hex)
             value = safetensors bytes of one ``ChunkEntry`` (see below)
             tag   = checksum of those bytes, "crc32:<8 hex>" (verified on every load;
                     sha256-hex tags of older stores are still verified as sha256)
             eviction: least-recently-used, enforced by DiskStore itself to ``size_limit``
    index/   a second ``diskcache.Cache`` without eviction: the text index
             key   = the same key
             value = JSON string {"text", "fingerprint", "n_tokens"}
             so the segmenter can list every chunk text without loading a blob.

A blob is a safetensors file holding the tensors ``token_ids`` [T] int64, ``keys`` and
``values`` [L, Hkv, T, D] (storage dtype) and ``extras.<name>`` (any shape/dtype), with string
metadata ``kvrag_format`` (= ``CACHE_FORMAT_VERSION``), ``fingerprint``, ``text`` and
``n_tokens``: a blob describes itself, the text index is only a fast listing of it.

Only ``str`` keys and ``bytes``/``str`` values reach diskcache, so nothing is ever pickled, and
both caches read their rows through ``kvrag.store.confined.ConfinedDisk``, so nothing a crafted
store holds is ever unpickled or names a file outside it.

Integrity: diskcache writes each value to a fresh file and then points the SQLite row at it
(the old file is removed afterwards), so a write is atomic and two processes writing the same
key leave one of the two complete values. Every ``get`` reads the format version from the
header, hashes the bytes and compares them with the tag, then checks the tensors' shapes; a
blob failing any check (or of an older format) is logged, deleted and counted, and ``get``
returns None so the caller recomputes the chunk. A blob of a *newer* format (written by a newer
kvrag sharing the store) is a miss and is left alone.
"""

from __future__ import annotations

import errno
import io
import logging
import mmap
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import diskcache
import diskcache.core
import torch

from kvrag.checks import check_int
from kvrag.errors import StoreError
from kvrag.store.base import CACHE_FORMAT_VERSION, ChunkEntry, ChunkStore, make_key
from kvrag.store.blob import (
    Corrupt,
    checksum,
    data_end,
    deserialize,
    index_record,
    index_value,
    is_newer_format,
    metadata,
    read_file_header,
    serialize,
    validate_entry,
    verified_header,
)
from kvrag.store.confined import ConfinedDisk, check_db_files, sanitize_settings

__all__ = ["CACHE_FORMAT_VERSION", "ChunkEntry", "DiskStore"]


log = logging.getLogger(__name__)

_EVICTION_POLICY = "least-recently-used"
#: Blob-cache size limit of a new store (bytes) when none is given.
DEFAULT_SIZE_LIMIT = 16 * 2**30
#: gc(verify=True) removes a file that no row points at only once it is this old (seconds):
#: diskcache writes a value's file *before* committing the row that points at it, so a young
#: unreferenced file is most likely a write in progress in another process. A writer commits
#: within seconds (longer only while waiting for the database lock); an hour leaves it ample
#: time, and the files of writers that died are still reclaimed by a later gc. A file whose name
#: shows a writer of this host that no longer runs (``ConfinedDisk.writer_is_dead``) goes at once.
_ORPHAN_GRACE_S = 3600.0


def _check_owner(key: str, entry: ChunkEntry) -> None:
    """Corrupt unless ``key`` is ``make_key`` of the entry's own fingerprint and token ids: the
    checksum only says the bytes are those written, not that they were written for this key (a
    blob copied or forged under another chunk's key). One sha256 of T int64 ids: microseconds."""
    try:
        owner = make_key(entry.fingerprint, entry.token_ids)
    except ValueError as e:
        raise Corrupt(f"entry has no valid key: {e}") from None
    if owner != key:
        raise Corrupt(f"the blob's fingerprint and token ids belong to key {owner}, not to this key")


class _DirLock:
    """An exclusive lock between processes on the file ``path`` (flock on POSIX, msvcrt on
    Windows), held while a store is opened (or created)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> "_DirLock":
        # O_NOFOLLOW: a lock file planted as a symlink must not create or open a file elsewhere.
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self._f = os.fdopen(os.open(self.path, flags, 0o644), "a+b")
        except OSError as e:
            raise StoreError(
                f"cannot open the lock file {self.path} ({e.strerror}): a store directory must hold its own files"
            ) from e
        try:
            import fcntl

            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX)
        except ImportError:  # Windows
            import msvcrt

            self._f.seek(0)
            msvcrt.locking(self._f.fileno(), msvcrt.LK_LOCK, 1)  # type: ignore[attr-defined]  # Windows-only module
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()  # closing the file releases the lock


class DiskStore(ChunkStore):
    """Per-chunk KV caches on disk, safe to share between threads and processes.

    size_limit: bytes for the blob cache (SQLite file + blob files), kept by evicting the
    least recently used entries after each ``put``. It is recorded in the store: ``None``
    uses the recorded limit (``DEFAULT_SIZE_LIMIT`` for a new store), so a maintenance job
    or a second process never applies a smaller default to a store configured larger.
    Hit/miss/corrupt counters are per process (per ``DiskStore`` object).

    timeout: seconds a write waits for another process holding the store's database lock
    before it fails with a ``StoreError`` that says so.

    A store directory is trusted with nothing (docs/cache.md, "Threat model"): its rows go
    through ``kvrag.store.confined.ConfinedDisk`` (no pickles, no file outside the directory)
    and its blobs through ``kvrag.store.blob``'s checks, so a crafted one gives misses."""

    def __init__(self, directory, *, size_limit: int | None = None, timeout: float = 60.0):
        if size_limit is not None:
            size_limit = check_int("size_limit (bytes)", size_limit, 1)
        if not str(directory).strip():
            raise ValueError('DiskStore directory must be a non-empty path ("" would be the current directory)')
        self.directory = Path(directory).expanduser()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise type(e)(
                e.errno, f"cannot create DiskStore directory {self.directory}: {e.strerror}", str(self.directory)
            ) from e
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise PermissionError(
                errno.EACCES, f"DiskStore directory {self.directory} is not writable", str(self.directory)
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        # Opened under an exclusive lock: two processes creating a store at once would otherwise
        # race between "is there a store?" and diskcache writing its settings, and one could
        # record diskcache's 1 GB default limit for good.
        with _DirLock(self.directory / ".kvstore.lock"):
            blob_db = self.directory / "blobs" / diskcache.core.DBNAME
            blob_settings = {}
            if size_limit is not None or not blob_db.exists() or blob_db.stat().st_size == 0:
                # diskcache persists the setting in the store's SQLite file; without one it would
                # fall back to its own 1 GB default.
                blob_settings["size_limit"] = size_limit or DEFAULT_SIZE_LIMIT
            # cull_limit=0: diskcache's own culling drops up to `cull_limit` LRU items at once
            # (the new one included when the cache is small); DiskStore evicts one at a time.
            # disk_min_file_size=0: every blob lives in its own file, written then renamed in.
            # sqlite_mmap_size=0: SQLite reads its file, not a memory map of it, so a damaged or
            # truncated database is an error, not a SIGBUS that kills the process.
            common = dict(
                cull_limit=0,
                sqlite_mmap_size=0,
                disk=ConfinedDisk,
                timeout=self.timeout,
                disk_pickle_protocol=0,
                statistics=0,
                tag_index=0,
            )
            try:
                self._blobs = self._open_cache(
                    "blobs", eviction_policy=_EVICTION_POLICY, disk_min_file_size=0, **common, **blob_settings
                )
            except sqlite3.DatabaseError as e:
                if (err := self._environment_error(e, "open")) is not None:
                    raise err from e
                raise StoreError(
                    f"the DiskStore database {blob_db} is damaged ({e}); its chunks cannot be found "
                    f"without it: delete the directory {self.directory} (they are recomputed)"
                ) from e
            except (OSError, sqlite3.Error) as e:
                raise self._environment_error(e, "open") or OSError(
                    f"cannot open the DiskStore in {self.directory}: {e}"
                ) from e
            self._index = self._open_index(common)
        self.size_limit = int(self._blobs.size_limit)
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "corrupt": 0, "wrong_model": 0, "evictions": 0}

    def _open_cache(self, name: str, **settings) -> diskcache.Cache:
        """One of the two diskcache caches, once its files are checked to be the store's own
        and its settings cleaned of anything diskcache would obey but never writes
        (``kvrag.store.confined``)."""
        path = self.directory / name
        check_db_files(path)
        sanitize_settings(path / diskcache.core.DBNAME, self.timeout)
        cache = diskcache.Cache(str(path), **settings)
        # diskcache opens this thread's connection while its own timeout is still 0 (it retries
        # by hand during __init__): give it the store's wait for the write lock too.
        cache._con.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        return cache

    def _environment_error(self, e: BaseException, doing: str) -> StoreError | None:
        """A StoreError for a failure of the environment rather than of the store -- another
        process holding the database lock, a full disk -- whose message says so (and does not
        advise deleting a healthy store); None for any other error."""
        text = str(e).lower()
        if isinstance(e, diskcache.Timeout) or "database is locked" in text or "database is busy" in text:
            return StoreError(
                f"cannot {doing} the DiskStore in {self.directory}: another process has held its database "
                f"locked for over {self.timeout:g} s ({e or 'timeout'}); the store is not damaged: retry "
                "once that process is done, or raise DiskStore(timeout=...)"
            )
        if isinstance(e, PermissionError) or getattr(e, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS):
            where = getattr(e, "filename", None)
            return StoreError(
                f"cannot {doing} the KVStore in {self.directory}: permission denied"
                f"{f' on {where}' if where else ''} ({getattr(e, 'strerror', None) or e}); make the whole directory "
                f"writable by this user (e.g. chown -R / chmod -R u+rwX {self.directory}) or pass a writable cache_dir"
            )
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in text:
            return StoreError(
                f"cannot {doing} the DiskStore in {self.directory}: the disk is full ({e}); the store is "
                "not damaged and its entries are still served: free space (or lower size_limit) and retry"
            )
        return None

    def _open_index(self, settings: dict) -> diskcache.Cache:
        """The text index; a damaged one is moved aside and rebuilt from the blobs' own
        metadata (it is only a listing of them)."""
        path = self.directory / "index"
        try:
            return self._open_cache("index", eviction_policy="none", **settings)
        except sqlite3.DatabaseError as e:
            if (err := self._environment_error(e, "open")) is not None:
                raise err from e
            aside = path.with_name(f"index.damaged-{int(time.time())}-{os.getpid()}")
            log.warning(
                "DiskStore: text index %s is damaged (%s); moved to %s and rebuilt from the blobs",
                path / diskcache.core.DBNAME,
                e,
                aside,
            )
            path.rename(aside)
            index = self._open_cache("index", eviction_policy="none", **settings)
        except (OSError, sqlite3.Error) as e:
            raise self._environment_error(e, "open") or OSError(
                f"cannot open the DiskStore in {self.directory}: {e}"
            ) from e
        self._index = index
        for key in self._keys(self._blobs):
            self._reindex(key)
        return index

    # ---- keys ----------------------------------------------------------------------

    # ---- write ---------------------------------------------------------------------
    def put(self, key: str, entry: ChunkEntry) -> None:
        """Store ``entry`` under ``key`` (replacing any entry there, even one of a newer format:
        keys include the fingerprint, which includes the format version, so two kvrag versions
        only meet on one key if the caller chose it), then evict LRU entries until the store
        fits its size limit. Raises ValueError for an empty or inconsistent entry."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        ids = validate_entry(entry)
        data = serialize(entry, ids)
        if len(data) > self.size_limit:
            # Stored, it would evict every other entry and then itself (least recently used first).
            raise StoreError(
                f"chunk entry of {len(data)} bytes ({int(ids.numel())} tokens) is larger than the store's "
                f"size limit ({self.size_limit} bytes): not stored, nothing evicted; raise size_limit "
                "or split the document into smaller chunks"
            )
        tag = checksum(data)
        try:
            self._write(key, data, tag, index_value(entry.text, entry.fingerprint, ids.numel()))
        except (OSError, sqlite3.Error, diskcache.Timeout) as e:
            if (err := self._environment_error(e, "write to")) is not None:
                raise err from e
            raise
        if self._enforce_limit() and key not in self._blobs:
            log.warning(
                "DiskStore: entry %s (%d bytes) was evicted as soon as stored: the size limit %d "
                "bytes leaves no room for it (the store takes %d bytes, SQLite files included); "
                "raise size_limit",
                key,
                len(data),
                self.size_limit,
                self._blobs.volume(),
            )

    @staticmethod
    def _set(cache: diskcache.Cache, key: str, value, **kw) -> None:
        try:
            # retry=False: wait ``timeout`` seconds for the write lock (SQLite's busy handler),
            # then fail with diskcache.Timeout, which put reports as a locked store; retry=True
            # would wait for ever behind a writer that never lets go.
            cache.set(key, value, retry=False, **kw)
        except (OSError, sqlite3.Error, diskcache.Timeout):  # raised before the row commits
            # The value's file was written but the row pointing at it never committed (a full
            # disk, a lock): the file is ours and dead, so it goes now rather than after gc's
            # grace period for files of writers that may still be running.
            if (name := cache.disk.last_written()) is not None:
                cache.disk.remove(name)
            raise

    def _write(self, key: str, data: bytes, tag: str, listing: str) -> None:
        self._set(self._blobs, key, data, tag=tag)
        # Write the index entry only if our blob is still the one stored: when two processes
        # put the same key at once, the text index then matches the blob that won. Lock order
        # is always blobs -> index (everywhere in this class), so this cannot deadlock.
        with self._blobs.transact(retry=True):
            if self._current_tag(key) == tag:
                self._set(self._index, key, listing)

    # ---- read ----------------------------------------------------------------------
    def get(self, key: str, fingerprint: str, *, pin_memory: bool = False) -> ChunkEntry | None:
        """The verified entry for ``key``, or None on a miss, a corrupt or older-format blob
        (deleted), an entry of a newer format (kept for the newer kvrag that wrote it) or an
        entry of another model (``fingerprint`` differs; kept, counted as wrong_model).
        ``pin_memory``: the tensors live in page-locked host memory (needs CUDA), for a fast
        copy to the GPU; otherwise they are views of the blob file's mapping."""
        try:
            found = self._read(key, pin_memory)
            if found is None:
                found = self._read_settled(key, pin_memory)
            if found is None:
                return self._miss()
        except sqlite3.OperationalError as e:
            # A read also records the access (LRU order): on a full disk or a locked-out
            # database that write fails. The entry is sound; this query computes the chunk.
            log.warning("DiskStore: cannot read entry %s (%s); treated as a miss", key, e)
            return self._miss()
        except sqlite3.DatabaseError as e:
            # The SQLite file itself is damaged: this query computes the chunk; writes fail
            # with a StoreError that says how to reset the store.
            log.warning(
                "DiskStore: the store's database %s is damaged (%s); entry %s treated as a miss",
                self.directory / "blobs" / diskcache.core.DBNAME,
                e,
                key,
            )
            return self._miss()
        buf, tag, name = found
        try:
            verified = verified_header(buf, tag, fingerprint)
            if verified is None:
                log.warning(
                    "DiskStore: entry %s has a format version newer than this kvrag's %d; "
                    "not used, left for the newer kvrag",
                    key,
                    CACHE_FORMAT_VERSION,
                )
                return self._miss()
            header, start = verified
            meta = metadata(header)
            if meta.get("fingerprint") != fingerprint:
                # The checksum holds, so this is a sound entry of another model asked for
                # with the wrong fingerprint (a caller error): leave it for its owner.
                log.warning(
                    "DiskStore: entry %s belongs to model %s, not %s; not used",
                    key,
                    meta.get("fingerprint"),
                    fingerprint,
                )
                with self._lock:
                    self._counts["wrong_model"] += 1
                return self._miss()
            entry = deserialize(buf, header, start)
            _check_owner(key, entry)
        except Corrupt as e:
            self._drop_corrupt(key, name, str(e))
            return self._miss()
        with self._lock:
            self._counts["hits"] += 1
        return entry

    def __contains__(self, key) -> bool:
        return isinstance(key, str) and key in self._blobs

    def ensure_indexed(self, key: str) -> bool:
        """True when ``key``'s blob is stored *and* listed in the text index, re-listing it
        from the blob's own metadata if it was not (a writer killed between its blob and its
        index write leaves such a chunk, which other processes never find: they find chunks
        through the index). False when no usable blob is stored: compute the chunk."""
        if key not in self:
            return False
        if not self._looks_whole(key):
            return False
        if self._reindex(key):
            log.warning(
                "DiskStore: chunk %s was stored but not listed in the text index (a writer "
                "killed mid-write?); re-listed it",
                key,
            )
        return key in self._index

    def texts(self, fingerprint: str | None) -> dict[str, str]:
        """key -> chunk text for every stored entry of ``fingerprint`` (None: of every model)
        (from the text index, no blob loaded; index entries whose blob was evicted or deleted
        are left out)."""
        try:
            return self._texts(fingerprint)
        except sqlite3.DatabaseError as e:
            if (err := self._environment_error(e, "list")) is not None:
                raise err from e
            raise StoreError(
                f"cannot list the DiskStore in {self.directory}: its database is damaged ({e}); "
                "reopen it (a damaged text index is rebuilt) or delete the directory"
            ) from e

    def _texts(self, fingerprint: str | None) -> dict[str, str]:
        return {key: text for key, (text, fp) in self._listed().items() if fingerprint is None or fp == fingerprint}

    def listed(self) -> dict[str, tuple[str, str]]:
        """key -> (chunk text, model fingerprint) of every stored and listed entry (from the
        text index, no blob loaded)."""
        try:
            return self._listed()
        except sqlite3.DatabaseError as e:
            if (err := self._environment_error(e, "list")) is not None:
                raise err from e
            raise StoreError(f"cannot list the DiskStore in {self.directory}: its database is damaged ({e})") from e

    def _listed(self) -> dict[str, tuple[str, str]]:
        out = {}
        for key in self._keys(self._index):
            raw = self._index.get(key, retry=True)
            if raw is None:
                continue
            rec = index_record(raw)
            if rec is None:
                log.warning(
                    "DiskStore: unusable text-index entry %s; skipped (gc() or a precompute of the "
                    "chunk rebuilds it from the blob)",
                    key,
                )
                continue
            if key in self._blobs:
                out[key] = rec
        return out

    # ---- maintenance ---------------------------------------------------------------
    def delete(self, key) -> bool:
        """Remove ``key``; True if a blob was stored under it."""
        if not isinstance(key, str):
            return False  # never stored: kvrag's keys are str
        with self._blobs.transact(retry=True):
            existed = self._blobs.delete(key, retry=True)
            self._index.delete(key, retry=True)
        return bool(existed)

    def clear(self) -> None:
        """Remove every entry (all models)."""
        with self._blobs.transact(retry=True):
            self._blobs.clear(retry=True)
            self._index.clear(retry=True)

    def stats(self) -> dict[str, Any]:
        """entries, bytes (blob cache on disk, what size_limit bounds), size_limit, and this
        process's hits, misses, hit_rate, corrupt, wrong_model, evictions."""
        with self._lock:
            c = dict(self._counts)
        lookups = c["hits"] + c["misses"]
        return {
            "directory": str(self.directory),
            "entries": len(self._blobs),
            "bytes": self._blobs.volume(),
            "size_limit": self.size_limit,
            **c,
            "hit_rate": c["hits"] / lookups if lookups else 0.0,
        }

    def gc(self, *, verify: bool = False) -> dict[str, int]:
        """Evict to the size limit, drop text-index entries whose blob is gone, re-index
        blobs missing from the text index; with ``verify``, also check both caches' files
        (rows whose file is gone are deleted, files no row points at are removed once older
        than ``_ORPHAN_GRACE_S``) and load and check every blob (corrupt and older-format
        ones are deleted, newer-format ones are left alone). Safe while other processes
        write. Returns the counts."""
        evicted = self._enforce_limit()
        check_warnings = 0
        if verify:
            # Before the index pass, so the text-index entries of the rows it drops go too.
            check_warnings = self._check_files(self._blobs) + self._check_files(self._index)
        dropped = 0
        for key in self._keys(self._index):
            with self._blobs.transact(retry=True):
                if key not in self._blobs and self._index.delete(key, retry=True):
                    dropped += 1
        reindexed = corrupt = 0
        for key in self._keys(self._blobs):
            if verify and self._verify_one(key):
                corrupt += 1
                continue
            if self._reindex(key):
                reindexed += 1
        return {
            "evicted": evicted,
            "index_dropped": dropped,
            "reindexed": reindexed,
            "corrupt": corrupt,
            "check_warnings": check_warnings,
            "entries": len(self._blobs),
        }

    def close(self) -> None:
        self._blobs.close()
        self._index.close()

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DiskStore({str(self.directory)!r}, size_limit={self.size_limit})"

    # ---- internals -----------------------------------------------------------------
    def _miss(self) -> ChunkEntry | None:
        """Count a miss; returns what a miss reads as (None)."""
        with self._lock:
            self._counts["misses"] += 1
        return None

    def _read(self, key: str, pin_memory: bool = False) -> tuple[torch.Tensor, str | None, str | None] | None:
        """(contents as uint8 [bytes], tag, file name) of the stored value, or None if
        absent/unreadable. The file name identifies this exact version: diskcache never reuses
        a name.

        The contents are a private (copy-on-write) memory map of the blob file: the checksum
        reads it without copying and the tensors are views of it. diskcache never rewrites a
        file in place (a new value is a new file, an old one is unlinked), so the mapping stays
        valid while any tensor of it is alive. With ``pin_memory`` (a CUDA consumer) the file
        is read into a page-locked buffer instead, so the host-to-device copy of the K/V runs
        at full bus speed without a staging copy."""
        if not isinstance(key, str):
            return None  # never stored: kvrag's keys are str
        handle, tag, stored_size = self._fetch(key, touch=True)
        if handle is None:
            return None
        name = getattr(handle, "name", None)
        try:
            with handle:
                try:
                    fd = handle.fileno()
                    size = os.fstat(fd).st_size
                except (AttributeError, io.UnsupportedOperation):  # a value held in SQLite
                    size = 0
                if size and size != stored_size:
                    # Not the file diskcache wrote (e.g. a huge or growing file put in its place):
                    # nothing of it is read or mapped.
                    return None
                if size == 0:
                    data = handle.read()
                    return (
                        torch.frombuffer(bytearray(data), dtype=torch.uint8)
                        if data
                        else torch.empty(0, dtype=torch.uint8),
                        tag,
                        name,
                    )
                if pin_memory:
                    try:
                        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                    except RuntimeError as e:  # no CUDA, or page-locked memory exhausted
                        log.debug("DiskStore: no pinned buffer for %s (%s); mapping the file", key, e)
                    else:
                        view, got = buf.numpy().data, 0
                        while got < size and (n := handle.readinto(view[got:])):  # releases the GIL
                            got += n
                        return buf[:got], tag, name
                return torch.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY), dtype=torch.uint8), tag, name
        except (OSError, ValueError):
            return None

    def _looks_whole(self, key: str) -> bool:
        """Whether ``key``'s blob file has the length its own header declares (header only, no
        checksum: cheap enough for every precompute of a cached text). A truncated or deleted
        file is dropped here, so the caller recomputes it instead of trusting it until a query
        reads it."""
        handle = self._fetch(key)[0]
        if handle is None:
            return False
        name = getattr(handle, "name", None)
        with handle:
            try:
                size = os.fstat(handle.fileno()).st_size
            except (AttributeError, io.UnsupportedOperation):
                return True  # a value held in SQLite: checked when read
            end = None
            try:
                header, start = read_file_header(handle)
                if is_newer_format(metadata(header)):
                    return True  # not ours to judge
                end = start + data_end(header)
            except Corrupt:
                pass
        if end is None or size != end:
            self._drop_corrupt(key, name, f"file of {size} bytes, its header says {'?' if end is None else end}")
            return False
        return True

    @staticmethod
    def _keys(cache: diskcache.Cache) -> list[str]:
        """The keys of one of the two caches; a key kvrag never writes (pickled, not text:
        ``ConfinedDisk`` returns None for it) is left out."""
        return [k for k in cache.iterkeys() if isinstance(k, str)]

    def _fetch(self, key: str, *, touch: bool = False) -> tuple[Any, str | None, int | None]:
        """(open file of the value, tag, stored size) of ``key``'s blob, or (None, None, None)
        when it is absent or unreadable (a file gone, or a row ``ConfinedDisk`` refuses).

        Read without a transaction, unlike diskcache's ``get`` under an LRU policy, which writes
        the access time in the same transaction as the read: then a full disk or another process
        holding the write lock turned every read into a miss (or a wait). With ``touch`` the
        access is recorded afterwards, best effort (``_touch``)."""
        rows = self._blobs._sql(
            "SELECT rowid, tag, mode, filename, value, size FROM Cache WHERE key = ? AND raw = 1", (key,)
        ).fetchall()
        if not rows:
            return None, None, None
        rowid, tag, mode, filename, value, size = rows[0]
        try:
            handle = self._blobs.disk.fetch(mode, filename, value, True)
        except OSError:  # replaced or evicted since the select, or refused
            return None, None, None
        if touch:
            self._touch(rowid)
        return handle, tag, size

    def _touch(self, rowid: int) -> None:
        """Record an access for LRU eviction, as diskcache's ``get`` does, but never at the cost
        of the read: waiting at most 50 ms for the write lock, and skipped on any error (full
        disk, lock held). The entry is sound; only its eviction order is off."""
        con = self._blobs._con
        try:
            con.execute("PRAGMA busy_timeout = 50")
            try:
                con.execute("UPDATE Cache SET access_time = ? WHERE rowid = ?", (time.time(), rowid))
            finally:  # every connection of the store waits ``timeout`` otherwise (_open_cache)
                con.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        except sqlite3.Error as e:
            log.debug("DiskStore: access to row %s not recorded (%s)", rowid, e)

    #: Reads of an entry whose file a concurrent writer keeps replacing, before this query
    #: takes it as a miss.
    SETTLE_READS = 8

    def _read_settled(self, key: str, pin_memory: bool) -> tuple[torch.Tensor, str | None, str | None] | None:
        """``_read`` again after a failed one. A row whose file cannot be read is a broken
        entry, unless a concurrent writer replaced the file under us: then the row names
        another file, and the read is tried again. Only a row that still names the file that
        could not be read is dropped as corrupt (that version only)."""
        for _ in range(self.SETTLE_READS):
            stored = self._stored_file(key)
            if stored is None:
                return None  # no entry
            found = self._read(key, pin_memory)
            if found is not None:
                return found
            if self._stored_file(key) == stored:
                self._drop_corrupt(key, None, "blob file missing or unreadable", stored_file=stored)
                return None
        return None

    def _stored_file(self, key: str) -> tuple | None:
        """What the row of ``key`` holds now, from the database alone: (row id, file name,
        mode; diskcache never reuses a file name), or None without a row."""
        rows = self._blobs._sql("SELECT rowid, filename, mode FROM Cache WHERE key = ?", (key,)).fetchall()
        return tuple(rows[0]) if rows else None

    def _current_tag(self, key: str) -> str | None:
        handle, tag, _ = self._fetch(key)
        if handle is not None:
            handle.close()
        return tag

    def _current_name(self, key: str) -> str | None:
        handle = self._fetch(key)[0]
        if handle is None:
            return None
        handle.close()
        return getattr(handle, "name", None)

    def _drop_corrupt(self, key: str, name: str | None, problem: str, stored_file: tuple | None = None) -> None:
        """Log, count and delete a blob that failed verification. Deletes only the version
        that was read (same file name, or the row still as ``stored_file`` read it), so a good
        entry another process just wrote survives."""
        log.warning(
            "DiskStore: corrupt entry %s in %s: %s; deleted, it will be recomputed", key, self.directory, problem
        )
        with self._lock:
            self._counts["corrupt"] += 1
        with self._blobs.transact(retry=True):
            same = (name is None or self._current_name(key) == name) and (
                stored_file is None or self._stored_file(key) == stored_file
            )
            if key in self._blobs and same:
                self._blobs.delete(key, retry=True)
            if key not in self._blobs:
                self._index.delete(key, retry=True)

    def _enforce_limit(self) -> int:
        """Evict least-recently-used blobs, one per transaction, until the blob cache fits
        ``size_limit``; returns how many were evicted."""
        # diskcache has no public "evict one LRU item" call (Cache.cull removes ten at a time),
        # so run its own policy query on its connection, inside its transaction.
        # The row goes by its rowid (as in diskcache's own delete), so a row whose key kvrag
        # never writes (pickled) is evicted like any other instead of being looked up by a key
        # it cannot be found by, forever.
        select = diskcache.core.EVICTION_POLICY[_EVICTION_POLICY]["cull"].format(
            fields="rowid, key, raw, filename", now=0
        )
        evicted = 0
        while self._blobs.volume() > self.size_limit:
            with self._blobs._transact(retry=True) as (sql, cleanup):
                if self._blobs.volume() <= self.size_limit:
                    break
                rows = sql(select, (1,)).fetchall()
                if not rows:
                    break
                rowid, victim, raw, filename = rows[0]
                sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
                cleanup(filename)  # removed (inside the store only) once the delete commits
                if raw and isinstance(victim, str):
                    self._index.delete(victim, retry=True)
            evicted += 1
            log.debug("DiskStore: evicted %s (size limit %d)", victim, self.size_limit)
        if evicted:
            with self._lock:
                self._counts["evictions"] += evicted
        return evicted

    def _verify_one(self, key: str) -> bool:
        """Fully check one blob (for gc(verify=True)); True if it was corrupt and dropped."""
        found = self._read(key)
        if found is None:
            return self._drop_misfit(key)
        buf, tag, name = found
        try:
            verified = verified_header(buf, tag)
            if verified is not None:  # None: a newer format, left for the kvrag that wrote it
                _check_owner(key, deserialize(buf, *verified))
        except Corrupt as e:
            self._drop_corrupt(key, name, str(e))
            return True
        return False

    def _drop_misfit(self, key: str) -> bool:
        """gc(verify=True) of a blob ``_read`` refused unread: if its file's length is not the
        one its row records and its header declares (a file swapped or cut short), it is
        dropped (True); absent, or held in SQLite, it is left (False)."""
        handle, _, stored = self._fetch(key)
        if handle is None:
            return False
        name = getattr(handle, "name", None)
        with handle:
            try:
                size = os.fstat(handle.fileno()).st_size
            except (AttributeError, io.UnsupportedOperation, OSError):
                return False
            try:
                header, start = read_file_header(handle)
                end = start + data_end(header)
            except Corrupt:
                end = None
        if size == stored and size == end:
            return False
        self._drop_corrupt(key, name, f"file of {size} bytes, its row says {stored} and its header {end}")
        return True

    def _check_files(self, cache: diskcache.Cache) -> int:
        """gc(verify=True)'s consistency check of one of the two caches: SQLite's integrity
        check, rows whose file is gone (deleted, with their text-index entry) and files that
        no row points at (removed once older than ``_ORPHAN_GRACE_S``). Returns the number of
        problems found.

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
            with self._blobs.transact(retry=True), cache.transact(retry=True):
                still = cache._sql("SELECT 1 FROM Cache WHERE rowid = ? AND filename = ?", (rowid, filename)).fetchall()
                if not still or cache.disk.exists(filename):
                    continue
                # A file name outside the store counts as missing: the row goes, the file stays.
                cache._sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
                if cache is self._blobs and raw and isinstance(db_key, str):  # ours (never unpickle one)
                    self._index.delete(db_key, retry=True)
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
            if age < _ORPHAN_GRACE_S and not cache.disk.writer_is_dead(rel):
                log.debug("DiskStore: unreferenced file %s is %.0f s old: a write in progress, kept", path, age)
                continue
            log.info("DiskStore: removing %s, a file no entry points at (%.0f s old)", path, age)
            cache.disk.remove(rel)  # also removes its directories once empty
            problems += 1
        return problems

    def _reindex(self, key: str) -> bool:
        """Recreate a missing or unreadable text-index entry from the blob's own metadata
        (a writer that died between the blob and the index write leaves one)."""
        listed = self._index.get(key, retry=True)
        if index_record(listed) is not None:
            return False
        handle, tag, _ = self._fetch(key)
        if handle is None:
            return False
        with handle:
            # Only the header is needed; the checksum is verified when the blob is loaded.
            try:
                meta = metadata(read_file_header(handle)[0])
            except Corrupt:
                meta = None
        if meta and is_newer_format(meta):
            return False  # its text index is the newer kvrag's, which may lay it out differently
        if not meta or index_record(meta) is None:
            # A blob without a usable text is never listed (its get finds it corrupt), and an
            # unusable listing of it goes: it can only be skipped on every refresh.
            if listed is not None:
                with self._blobs.transact(retry=True):
                    if self._current_tag(key) == tag:
                        self._index.delete(key, retry=True)
            return False
        n_tokens = meta.get("n_tokens", "0")
        value = index_value(
            meta["text"],
            meta["fingerprint"],
            int(n_tokens) if n_tokens.isascii() and n_tokens.isdigit() and len(n_tokens) < 12 else 0,
        )
        with self._blobs.transact(retry=True):
            if self._current_tag(key) != tag:
                return False
            self._set(self._index, key, value)
        return True
