"""``DiskStore``: the on-disk store of per-chunk KV caches.

Layout under ``directory``::

    blobs/   a ``diskcache.Cache`` (SQLite index + one file per value)
             key   = make_key(fingerprint, token_ids)  (sha256 hex)
             value = safetensors bytes of one ``ChunkEntry`` (see below)
             tag   = checksum of those bytes, "crc32:<8 hex>" (verified on every load;
                     sha256-hex tags of older stores are still verified as sha256)
             eviction: least-recently-used, enforced by DiskStore itself to ``size_limit``
                     (``kvrag.store.disk_evict``); with ``admission="tinylfu"`` a write into
                     a full store is kept only if its key is asked for more often than the
                     entries it would evict (``kvrag.store.admission``)
    index/   a second ``diskcache.Cache`` without eviction: the text index
             key   = the same key
             value = JSON string {"text", "fingerprint", "n_tokens"}
             so the segmenter can list every chunk text without loading a blob
             (``kvrag.store.disk_index``).

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
kvrag sharing the store) is a miss and is left alone. The checks of whole files and of the
directory against its rows (``gc(verify=True)``) are ``kvrag.store.disk_check``'s; opening the
directory (its lock, the caches, the environment's errors) is ``kvrag.store.disk_open``'s.
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
from kvrag.store.admission import FrequencySketch, check_admission
from kvrag.store.base import CACHE_FORMAT_VERSION, ChunkEntry, ChunkStore
from kvrag.store.blob import (
    Corrupt,
    checksum,
    deserialize,
    index_record,
    index_value,
    is_newer_format,
    metadata,
    serialize,
    validate_entry,
    verified_header,
)
from kvrag.store.confined import ConfinedDisk
from kvrag.store.disk_check import blob_problem, check_files, check_owner, misfit, truncation
from kvrag.store.disk_evict import EVICTION_POLICY, evict_to_limit, lru_victims
from kvrag.store.disk_index import header_metadata, listed, listing_of, own_keys
from kvrag.store.disk_open import DirLock, environment_error, open_cache

__all__ = ["CACHE_FORMAT_VERSION", "ChunkEntry", "DiskStore"]


log = logging.getLogger(__name__)

#: Blob-cache size limit of a new store (bytes) when none is given.
DEFAULT_SIZE_LIMIT = 16 * 2**30


class DiskStore(ChunkStore):
    """Per-chunk KV caches on disk, safe to share between threads and processes.

    size_limit: bytes for the blob cache (SQLite file + blob files), kept by evicting the
    least recently used entries after each ``put``. It is recorded in the store: ``None``
    uses the recorded limit (``DEFAULT_SIZE_LIMIT`` for a new store), so a maintenance job
    or a second process never applies a smaller default to a store configured larger.
    Hit/miss/corrupt counters are per process (per ``DiskStore`` object).

    timeout: seconds a write waits for another process holding the store's database lock
    before it fails with a ``StoreError`` that says so.

    admission: ``"lru"`` (default) keeps every write and evicts the least recently used entries
    for it; ``"tinylfu"`` keeps a write into a full store only if its key was asked for (read
    or written) more often lately than each entry it would evict, and otherwise stores nothing
    (counted ``refused``): chunks retrieved again and again survive one-off writes
    (``kvrag.store.admission``; docs/cache.md). The counts are this object's, so per process.

    A store directory is trusted with nothing (docs/cache.md, "Threat model"): its rows go
    through ``kvrag.store.confined.ConfinedDisk`` (no pickles, no file outside the directory)
    and its blobs through ``kvrag.store.blob``'s checks, so a crafted one gives misses."""

    def __init__(self, directory, *, size_limit: int | None = None, timeout: float = 60.0, admission: str = "lru"):
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
        self.admission = check_admission(admission)
        # Opened under an exclusive lock: two processes creating a store at once would otherwise
        # race between "is there a store?" and diskcache writing its settings, and one could
        # record diskcache's 1 GB default limit for good.
        with DirLock(self.directory / ".kvstore.lock"):
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
                    "blobs", eviction_policy=EVICTION_POLICY, disk_min_file_size=0, **common, **blob_settings
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
        self._counts = {"hits": 0, "misses": 0, "corrupt": 0, "wrong_model": 0, "evictions": 0, "refused": 0}
        # How often each key was asked for lately (under ``_lock``), for admission="tinylfu".
        self._sketch = FrequencySketch() if self.admission == "tinylfu" else None

    def _open_cache(self, name: str, **settings) -> diskcache.Cache:
        return open_cache(self.directory, name, self.timeout, **settings)

    def _environment_error(self, e: BaseException, doing: str) -> StoreError | None:
        return environment_error(e, doing, self.directory, self.timeout)

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
        for key in own_keys(self._blobs):
            self._reindex(key)
        return index

    # ---- write ---------------------------------------------------------------------
    def put(self, key: str, entry: ChunkEntry) -> None:
        """Store ``entry`` under ``key`` (replacing any entry there, even one of a newer format:
        keys include the fingerprint, which includes the format version, so two kvrag versions
        only meet on one key if the caller chose it), then evict LRU entries until the store
        fits its size limit. With ``admission="tinylfu"``, a new key that does not fit beside
        the stored entries is written only if the admission rule lets it evict them
        (``_admits``); otherwise nothing is stored. Raises ValueError for an empty or
        inconsistent entry."""
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
        try:
            if self._sketch is not None and not self._admits(key, len(data)):
                return
            self._write(key, data, checksum(data), index_value(entry.text, entry.fingerprint, ids.numel()))
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
            check_owner(key, entry)
        except Corrupt as e:
            self._drop_corrupt(key, name, str(e))
            return self._miss()
        with self._lock:
            self._counts["hits"] += 1
            if self._sketch is not None:
                self._sketch.add(key)
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
        return listed(self._index, self._blobs)

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
        """entries, bytes (blob cache on disk, what size_limit bounds), size_limit, admission,
        and this process's hits, misses, hit_rate, corrupt, wrong_model, evictions, refused
        (writes the admission rule did not keep)."""
        with self._lock:
            c = dict(self._counts)
        lookups = c["hits"] + c["misses"]
        return {
            "directory": str(self.directory),
            "entries": len(self._blobs),
            "bytes": self._blobs.volume(),
            "size_limit": self.size_limit,
            "admission": self.admission,
            **c,
            "hit_rate": c["hits"] / lookups if lookups else 0.0,
        }

    def gc(self, *, verify: bool = False) -> dict[str, int]:
        """Evict to the size limit, drop text-index entries whose blob is gone, re-index
        blobs missing from the text index; with ``verify``, also check both caches' files
        (rows whose file is gone are deleted, files no row points at are removed once older
        than ``disk_check.ORPHAN_GRACE_S``) and load and check every blob (corrupt and
        older-format ones are deleted, newer-format ones are left alone). Safe while other
        processes write. Returns the counts."""
        evicted = self._enforce_limit()
        check_warnings = 0
        if verify:
            # Before the index pass, so the text-index entries of the rows it drops go too.
            check_warnings = sum(
                check_files(c, blobs=self._blobs, index=self._index) for c in (self._blobs, self._index)
            )
        dropped = 0
        for key in own_keys(self._index):
            with self._blobs.transact(retry=True):
                if key not in self._blobs and self._index.delete(key, retry=True):
                    dropped += 1
        reindexed = corrupt = 0
        for key in own_keys(self._blobs):
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

    def __enter__(self) -> DiskStore:
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
        """Whether ``key``'s blob file has the length its own header declares
        (``disk_check.truncation``). A truncated or deleted file is dropped here, so the caller
        recomputes it instead of trusting it until a query reads it."""
        handle = self._fetch(key)[0]
        if handle is None:
            return False
        name = getattr(handle, "name", None)
        if (problem := truncation(handle)) is not None:
            self._drop_corrupt(key, name, problem)
            return False
        return True

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

    def _admits(self, key: str, nbytes: int) -> bool:
        """Whether a write of ``nbytes`` under ``key`` is kept (admission="tinylfu"). The write
        counts as an access of ``key`` either way. A key already stored is replaced, and a store
        with room for the entry takes it; otherwise the entries LRU eviction would remove for it
        must each have been asked for less often than ``key`` (``FrequencySketch.admits``)."""
        sketch = self._sketch
        assert sketch is not None
        entries = len(self._blobs)
        with self._lock:
            # Sized by the entries stored: once the store is full, as many as it can hold.
            sketch.fit(entries)
            sketch.add(key)
        if key in self._blobs:
            return True
        victims = lru_victims(self._blobs, nbytes, self.size_limit)
        if not victims:
            return True
        with self._lock:
            if sketch.admits(key, victims):
                return True
            self._counts["refused"] += 1
        log.debug("DiskStore: %s not admitted: asked for no more often than the LRU entries it would evict", key)
        return False

    def _enforce_limit(self) -> int:
        """Evict least-recently-used blobs until the blob cache fits ``size_limit``
        (``kvrag.store.disk_evict``); returns how many were evicted."""
        evicted = evict_to_limit(self._blobs, self._index, self.size_limit)
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
        if (problem := blob_problem(key, buf, tag)) is not None:
            self._drop_corrupt(key, name, problem)
            return True
        return False

    def _drop_misfit(self, key: str) -> bool:
        """gc(verify=True) of a blob ``_read`` refused unread: dropped (True) if its file is
        not the length its row and its header say (``disk_check.misfit``); absent, or held in
        SQLite, it is left (False)."""
        handle, _, stored = self._fetch(key)
        if handle is None:
            return False
        name = getattr(handle, "name", None)
        if (problem := misfit(handle, stored)) is None:
            return False
        self._drop_corrupt(key, name, problem)
        return True

    def _reindex(self, key: str) -> bool:
        """Recreate a missing or unreadable text-index entry from the blob's own metadata
        (a writer that died between the blob and the index write leaves one)."""
        row = self._index.get(key, retry=True)
        if index_record(row) is not None:
            return False
        handle, tag, _ = self._fetch(key)
        if handle is None:
            return False
        meta = header_metadata(handle)
        if meta and is_newer_format(meta):
            return False  # its text index is the newer kvrag's, which may lay it out differently
        value = listing_of(meta)
        if value is None:
            # A blob without a usable text is never listed (its get finds it corrupt), and an
            # unusable listing of it goes: it can only be skipped on every refresh.
            if row is not None:
                with self._blobs.transact(retry=True):
                    if self._current_tag(key) == tag:
                        self._index.delete(key, retry=True)
            return False
        with self._blobs.transact(retry=True):
            if self._current_tag(key) != tag:
                return False
            self._set(self._index, key, value)
        return True
