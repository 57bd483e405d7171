"""``KVStore``: the on-disk store of per-chunk KV caches.

Layout under ``directory``::

    blobs/   a ``diskcache.Cache`` (SQLite index + one file per value)
             key   = KVStore.make_key(fingerprint, token_ids)  (sha256 hex)
             value = safetensors bytes of one ``ChunkEntry`` (see below)
             tag   = checksum of those bytes, "crc32:<8 hex>" (verified on every load;
                     sha256-hex tags of older stores are still verified as sha256)
             eviction: least-recently-used, enforced by KVStore itself to ``size_limit``
    index/   a second ``diskcache.Cache`` without eviction: the text index
             key   = the same key
             value = JSON string {"text", "fingerprint", "n_tokens"}
             so the segmenter can list every chunk text without loading a blob.

A blob is a safetensors file holding the tensors ``token_ids`` [T] int64, ``keys`` and
``values`` [L, Hkv, T, D] (storage dtype) and ``extras.<name>`` (any shape/dtype), with string
metadata ``kvrag_format`` (= ``CACHE_FORMAT_VERSION``), ``fingerprint``, ``text`` and
``n_tokens``: a blob describes itself, the text index is only a fast listing of it.

Only ``bytes`` and ``str`` values reach diskcache, so nothing is ever pickled (diskcache
pickles any other value type).

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
import hashlib
import io
import json
import logging
import math
import mmap
import os
import sqlite3
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diskcache
import diskcache.core
import safetensors.torch
import torch

from kvrag.errors import StoreError

__all__ = ["CACHE_FORMAT_VERSION", "ChunkEntry", "KVStore"]

# Bumped whenever the blob layout or the meaning of the stored tensors changes. The model
# fingerprint includes it (kvrag/model.py), so a new version never even looks up old keys.
CACHE_FORMAT_VERSION = 1

log = logging.getLogger(__name__)

_EXTRA_PREFIX = "extras."
_EVICTION_POLICY = "least-recently-used"
#: Blob-cache size limit of a new store (bytes) when none is given.
DEFAULT_SIZE_LIMIT = 16 * 2**30
#: gc(verify=True) removes a file that no row points at only once it is this old (seconds):
#: diskcache writes a value's file *before* committing the row that points at it, so a young
#: unreferenced file is most likely a write in progress in another process. A writer commits
#: within seconds (longer only while waiting for the database lock); an hour leaves it ample
#: time, and the files of writers that died are still reclaimed by a later gc.
_ORPHAN_GRACE_S = 3600.0


@dataclass
class ChunkEntry:
    """The precomputed KV cache of one chunk.

    token_ids [T] int64; keys/values [L, Hkv, T, D] in the storage dtype (fp32/fp16/bf16),
    keys taken *before* RoPE (position-free); extras: per-policy tensors of any shape, e.g.
    ``"a2ats.codes"`` [L, Hkv, T] int16."""

    fingerprint: str
    text: str
    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def span(self, a: int, b: int) -> "ChunkEntry":
        """The entry of the chunk's tokens ``a..b-1`` (views, no copy), for a prompt whose
        tokenization matches only part of the chunk. A prefix (a = 0) is exact: each token's
        K/V depend only on the tokens before it. Extras laid out per token like the K/V
        ([L, Hkv, T, ...], e.g. A2ATS codes) are cut the same way; the others describe the
        chunk as a whole (e.g. the codebook digest) and are kept."""
        t = self.token_ids.numel()
        if not 0 <= a < b <= t:
            raise ValueError(f"span {a}..{b} of a {t}-token chunk")
        extras = {k: (v[:, :, a:b] if v.dim() >= 3 and v.shape[2] == t else v) for k, v in self.extras.items()}
        return ChunkEntry(self.fingerprint, self.text, self.token_ids[a:b], self.keys[:, :, a:b],
                          self.values[:, :, a:b], extras)

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors (ids, keys, values, extras)."""
        tensors = [self.token_ids, self.keys, self.values, *self.extras.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


_CRC_PREFIX = "crc32:"


def checksum(data: bytes) -> str:
    """The tag stored with a blob: ``"crc32:<8 hex>"``. CRC-32 (zlib) rather than a
    cryptographic hash because it only has to catch truncated or damaged files, and it is
    verified on the TTFT path: ~3x faster than sha256 (tens of ms per prompt of cached MB)."""
    return f"{_CRC_PREFIX}{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def checksum_matches(data: bytes, tag: object) -> bool:
    """Whether ``data`` matches the stored ``tag``: a ``crc32:`` tag, or the sha256 hex tag
    that stores written before the switch hold (still readable, no migration)."""
    if not isinstance(tag, str):
        return False
    if tag.startswith(_CRC_PREFIX):
        return tag == checksum(data)
    if len(tag) == 64:
        return hashlib.sha256(data).hexdigest() == tag
    return False


class _Corrupt(Exception):
    """A blob that failed verification (message = the problem)."""


def _is_newer_format(meta: dict[str, str]) -> bool:
    """Whether a blob's header declares a format version newer than ``CACHE_FORMAT_VERSION``."""
    try:
        return int(meta.get("kvrag_format")) > CACHE_FORMAT_VERSION
    except (TypeError, ValueError):
        return False


def _verified_header(buf: torch.Tensor, tag: object, fingerprint: str | None = None) -> tuple[dict[str, Any], int] | None:
    """The safetensors header of a stored blob (uint8 [bytes]) and the offset its data starts
    at, once its checksum and format version check out; None for a blob of a newer format;
    raises _Corrupt otherwise.

    The version is read from the header *before* the checksum: a newer kvrag sharing the
    store may use another checksum scheme or layout, so its blobs are not ours to judge (or
    delete). A blob of an older version is treated like a damaged one: corrupt. So is one that
    claims a newer version but carries ``fingerprint`` (the one this kvrag asked for): model
    fingerprints include the format version, so a newer kvrag never writes that one."""
    data = buf.numpy()
    header, start = _read_header(data)
    meta = _metadata(header)
    if _is_newer_format(meta):
        if fingerprint is not None and meta.get("fingerprint") == fingerprint:
            raise _Corrupt(f"format version {meta.get('kvrag_format')!r} with this kvrag's fingerprint")
        return None
    if not checksum_matches(data, tag):
        raise _Corrupt(f"checksum mismatch (stored {tag}, {len(data)} bytes)")
    if meta.get("kvrag_format") != str(CACHE_FORMAT_VERSION):
        raise _Corrupt(f"format version {meta.get('kvrag_format')!r}, expected {CACHE_FORMAT_VERSION}")
    return header, start


def _validate_entry(entry: ChunkEntry) -> torch.Tensor:
    """Check an entry before storing it; returns its token ids as int64 [T]."""
    if not isinstance(entry, ChunkEntry):
        raise TypeError(f"put() needs a ChunkEntry, got {type(entry).__name__}")
    if not isinstance(entry.fingerprint, str) or not entry.fingerprint:
        raise ValueError("ChunkEntry.fingerprint must be a non-empty string")
    if not isinstance(entry.text, str):
        raise ValueError(f"ChunkEntry.text must be a str, got {type(entry.text).__name__}")
    for name in ("token_ids", "keys", "values"):
        if not isinstance(getattr(entry, name), torch.Tensor):
            raise ValueError(f"ChunkEntry.{name} must be a torch.Tensor, got {type(getattr(entry, name)).__name__}")
    ids = entry.token_ids
    if ids.dim() != 1:
        raise ValueError(f"ChunkEntry.token_ids must be 1-D [T], got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"ChunkEntry.token_ids must be integers, got {ids.dtype}")
    if ids.numel() == 0:
        raise ValueError("empty ChunkEntry: token_ids has T == 0 tokens")
    k, v = entry.keys, entry.values
    if k.dim() != 4:
        raise ValueError(f"ChunkEntry.keys must be [L, Hkv, T, D], got shape {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"ChunkEntry keys/values shape mismatch: keys {tuple(k.shape)} vs values {tuple(v.shape)}")
    if k.dtype != v.dtype or not k.dtype.is_floating_point:
        raise ValueError(f"ChunkEntry keys/values must share one floating dtype, got {k.dtype} / {v.dtype}")
    if k.shape[2] != ids.numel():
        raise ValueError(f"ChunkEntry has {ids.numel()} token ids but keys/values hold T={k.shape[2]} tokens")
    if k.numel() == 0:
        raise ValueError(f"empty ChunkEntry: keys have shape {tuple(k.shape)}")
    for name, t in entry.extras.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"ChunkEntry.extras names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"ChunkEntry.extras[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
    return ids.to(torch.int64)


def _serialize(entry: ChunkEntry, ids: torch.Tensor) -> bytes:
    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous()

    tensors = {"token_ids": cpu(ids), "keys": cpu(entry.keys), "values": cpu(entry.values)}
    for name, t in entry.extras.items():
        tensors[_EXTRA_PREFIX + name] = cpu(t)
    metadata = {
        "kvrag_format": str(CACHE_FORMAT_VERSION),
        "fingerprint": entry.fingerprint,
        "text": entry.text,
        "n_tokens": str(int(ids.numel())),
    }
    return safetensors.torch.save(tensors, metadata=metadata)


def _read_header(data) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors buffer (bytes, a file mapping or a uint8 array) and the
    offset its tensor data starts at. Format: u64 little-endian header length, then the JSON
    header, then the data."""
    data = memoryview(data)
    if len(data) < 8:
        raise _Corrupt(f"blob too short ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise _Corrupt(f"bad safetensors header length {n} for a {len(data)}-byte blob")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as e:
        raise _Corrupt(f"unreadable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise _Corrupt("safetensors header is not a mapping")
    return header, 8 + n


def _metadata(header: dict[str, Any]) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors header (safetensors' loaders do not return it
    for in-memory bytes)."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise _Corrupt("safetensors metadata is missing or not a mapping")
    return meta


#: safetensors dtype names -> torch dtypes, for the views of a read blob.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool}


def _deserialize(buf: torch.Tensor, header: dict[str, Any], start: int) -> ChunkEntry:
    """The entry held by a verified blob ``buf`` (uint8 [bytes]; header and data offset from
    ``_verified_header``). Its tensors are views of ``buf`` -- a private, copy-on-write file
    mapping or a pinned buffer: no copy and no parse under the GIL, unlike
    ``safetensors.torch.load`` of the bytes, which copies every tensor (on a 2-core box: ~60 ms
    of a 154 ms cold read of 90 MiB, which the mapping with its checksum does in ~25 ms)."""
    size = buf.numel() - start
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            a, b = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise _Corrupt(f"bad header entry for {name!r}: {e!r}") from None
        if not 0 <= a <= b <= size or b - a != math.prod(shape) * dtype.itemsize or min(shape, default=1) < 0:
            raise _Corrupt(f"tensor {name!r} {info['dtype']}{shape} does not fit bytes {a}..{b} of {size}")
        t = buf[start + a : start + b]
        if (start + a) % dtype.itemsize:  # safetensors aligns its tensors; a view needs it
            t = t.clone()
        tensors[name] = t.view(dtype).view(shape)
    meta = _metadata(header)
    try:
        ids, k, v = tensors.pop("token_ids"), tensors.pop("keys"), tensors.pop("values")
        fingerprint, text, n_tokens = meta["fingerprint"], meta["text"], int(meta["n_tokens"])
    except (KeyError, ValueError) as e:
        raise _Corrupt(f"missing or bad field {e}") from None
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise _Corrupt(f"token_ids has shape {tuple(ids.shape)} dtype {ids.dtype}, expected [T] int64")
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise _Corrupt(f"keys {tuple(k.shape)} {k.dtype} / values {tuple(v.shape)} {v.dtype} are inconsistent")
    if k.shape[2] != ids.numel() or n_tokens != ids.numel():
        raise _Corrupt(f"token count mismatch: {ids.numel()} ids, T={k.shape[2]}, n_tokens={n_tokens}")
    unknown = [n for n in tensors if not n.startswith(_EXTRA_PREFIX)]
    if unknown:
        raise _Corrupt(f"unexpected tensors {unknown}")
    extras = {n[len(_EXTRA_PREFIX) :]: t for n, t in tensors.items()}
    return ChunkEntry(fingerprint=fingerprint, text=text, token_ids=ids, keys=k, values=v, extras=extras)


class _DirLock:
    """An exclusive lock between processes on the file ``path`` (flock on POSIX, msvcrt on
    Windows), held while a store is opened (or created)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> "_DirLock":
        self._f = open(self.path, "a+b")
        try:
            import fcntl

            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX)
        except ImportError:  # Windows
            import msvcrt

            self._f.seek(0)
            msvcrt.locking(self._f.fileno(), msvcrt.LK_LOCK, 1)
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()  # closing the file releases the lock


class KVStore:
    """Per-chunk KV caches on disk, safe to share between threads and processes.

    size_limit: bytes for the blob cache (SQLite file + blob files), kept by evicting the
    least recently used entries after each ``put``. It is recorded in the store: ``None``
    uses the recorded limit (``DEFAULT_SIZE_LIMIT`` for a new store), so a maintenance job
    or a second process never applies a smaller default to a store configured larger.
    Hit/miss/corrupt counters are per process (per ``KVStore`` object)."""

    def __init__(self, directory, *, size_limit: int | None = None):
        if size_limit is not None and (isinstance(size_limit, bool) or not isinstance(size_limit, int)
                                       or size_limit <= 0):
            raise ValueError(f"size_limit must be a positive number of bytes, got {size_limit!r}")
        if not str(directory).strip():
            raise ValueError("KVStore directory must be a non-empty path (\"\" would be the current directory)")
        self.directory = Path(directory).expanduser()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise type(e)(e.errno, f"cannot create KVStore directory {self.directory}: {e.strerror}",
                          str(self.directory)) from e
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"KVStore directory {self.directory} is not writable",
                                  str(self.directory))
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
            # (the new one included when the cache is small); KVStore evicts one at a time.
            # disk_min_file_size=0: every blob lives in its own file, written then renamed in.
            # sqlite_mmap_size=0: SQLite reads its file, not a memory map of it, so a damaged or
            # truncated database is an error, not a SIGBUS that kills the process.
            common = dict(cull_limit=0, sqlite_mmap_size=0)
            try:
                self._blobs = diskcache.Cache(
                    str(self.directory / "blobs"), eviction_policy=_EVICTION_POLICY,
                    disk_min_file_size=0, **common, **blob_settings,
                )
            except sqlite3.DatabaseError as e:
                raise StoreError(
                    f"the KVStore database {blob_db} is damaged ({e}); its chunks cannot be found "
                    f"without it: delete the directory {self.directory} (they are recomputed)") from e
            except (OSError, sqlite3.Error) as e:
                raise OSError(f"cannot open the KVStore in {self.directory}: {e}") from e
            self._index = self._open_index(common)
        self.size_limit = int(self._blobs.size_limit)
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "corrupt": 0, "wrong_model": 0, "evictions": 0}

    def _open_index(self, settings: dict) -> diskcache.Cache:
        """The text index; a damaged one is moved aside and rebuilt from the blobs' own
        metadata (it is only a listing of them)."""
        path = self.directory / "index"
        try:
            return diskcache.Cache(str(path), eviction_policy="none", **settings)
        except sqlite3.DatabaseError as e:
            aside = path.with_name(f"index.damaged-{int(time.time())}-{os.getpid()}")
            log.warning("KVStore: text index %s is damaged (%s); moved to %s and rebuilt from the blobs",
                        path / diskcache.core.DBNAME, e, aside)
            path.rename(aside)
            index = diskcache.Cache(str(path), eviction_policy="none", **settings)
        except (OSError, sqlite3.Error) as e:
            raise OSError(f"cannot open the KVStore in {self.directory}: {e}") from e
        self._index = index
        for key in list(self._blobs.iterkeys()):
            self._reindex(key)
        return index

    # ---- keys ----------------------------------------------------------------------
    @staticmethod
    def make_key(fingerprint: str, token_ids) -> str:
        """sha256 hex of the model fingerprint and the token ids (as little-endian int64)."""
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError("make_key needs a non-empty fingerprint string")
        ids = torch.as_tensor(token_ids)
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"token_ids must be a 1-D sequence of ints, got shape {tuple(ids.shape)} dtype {ids.dtype}")
        h = hashlib.sha256()
        fp = fingerprint.encode("utf-8")
        # Length prefix: no (fingerprint, ids) pair can produce another pair's byte string.
        h.update(len(fp).to_bytes(8, "little") + fp)
        h.update(ids.to(torch.int64).cpu().numpy().astype("<i8", copy=False).tobytes())
        return h.hexdigest()

    # ---- write ---------------------------------------------------------------------
    def put(self, key: str, entry: ChunkEntry) -> None:
        """Store ``entry`` under ``key`` (replacing any entry there, even one of a newer format:
        keys include the fingerprint, which includes the format version, so two kvrag versions
        only meet on one key if the caller chose it), then evict LRU entries until the store
        fits its size limit. Raises ValueError for an empty or inconsistent entry."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        ids = _validate_entry(entry)
        data = _serialize(entry, ids)
        if len(data) > self.size_limit:
            # Stored, it would evict every other entry and then itself (least recently used first).
            raise StoreError(
                f"chunk entry of {len(data)} bytes ({int(ids.numel())} tokens) is larger than the store's "
                f"size limit ({self.size_limit} bytes): not stored, nothing evicted; raise size_limit "
                "or split the document into smaller chunks")
        tag = checksum(data)
        self._blobs.set(key, data, tag=tag, retry=True)
        index_value = json.dumps({"text": entry.text, "fingerprint": entry.fingerprint, "n_tokens": int(ids.numel())})
        # Write the index entry only if our blob is still the one stored: when two processes
        # put the same key at once, the text index then matches the blob that won. Lock order
        # is always blobs -> index (everywhere in this class), so this cannot deadlock.
        with self._blobs.transact(retry=True):
            if self._current_tag(key) == tag:
                self._index.set(key, index_value, retry=True)
        if self._enforce_limit() and key not in self._blobs:
            log.warning("KVStore: entry %s (%d bytes) was evicted as soon as stored: the size limit %d "
                        "bytes leaves no room for it (the store takes %d bytes, SQLite files included); "
                        "raise size_limit", key, len(data), self.size_limit, self._blobs.volume())

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
                # A row whose file cannot be read is a broken entry, unless a concurrent writer
                # just replaced the file under us: read once more before calling it corrupt.
                if key in self._blobs:
                    found = self._read(key, pin_memory)
                    if found is None and key in self._blobs:
                        self._drop_corrupt(key, None, "blob file missing or unreadable")
                        return self._miss()
                if found is None:
                    return self._miss()
        except sqlite3.OperationalError as e:
            # A read also records the access (LRU order): on a full disk or a locked-out
            # database that write fails. The entry is sound; this query computes the chunk.
            log.warning("KVStore: cannot read entry %s (%s); treated as a miss", key, e)
            return self._miss()
        except sqlite3.DatabaseError as e:
            # The SQLite file itself is damaged: this query computes the chunk; writes fail
            # with a StoreError that says how to reset the store.
            log.warning("KVStore: the store's database %s is damaged (%s); entry %s treated as a miss",
                        self.directory / "blobs" / diskcache.core.DBNAME, e, key)
            return self._miss()
        buf, tag, name = found
        try:
            verified = _verified_header(buf, tag, fingerprint)
            if verified is None:
                log.warning("KVStore: entry %s has a format version newer than this kvrag's %d; "
                            "not used, left for the newer kvrag", key, CACHE_FORMAT_VERSION)
                return self._miss()
            header, start = verified
            meta = _metadata(header)
            if meta.get("fingerprint") != fingerprint:
                # The checksum holds, so this is a sound entry of another model asked for
                # with the wrong fingerprint (a caller error): leave it for its owner.
                log.warning("KVStore: entry %s belongs to model %s, not %s; not used",
                            key, meta.get("fingerprint"), fingerprint)
                with self._lock:
                    self._counts["wrong_model"] += 1
                return self._miss()
            entry = _deserialize(buf, header, start)
        except _Corrupt as e:
            self._drop_corrupt(key, name, str(e))
            return self._miss()
        with self._lock:
            self._counts["hits"] += 1
        return entry

    def __contains__(self, key) -> bool:
        return key in self._blobs

    def ensure_indexed(self, key: str) -> bool:
        """True when ``key``'s blob is stored *and* listed in the text index, re-listing it
        from the blob's own metadata if it was not (a writer killed between its blob and its
        index write leaves such a chunk, which other processes never find: they find chunks
        through the index). False when no usable blob is stored: compute the chunk."""
        if key not in self._blobs:
            return False
        if not self._looks_whole(key):
            return False
        if self._reindex(key):
            log.warning("KVStore: chunk %s was stored but not listed in the text index (a writer "
                        "killed mid-write?); re-listed it", key)
        return key in self._index

    def texts(self, fingerprint: str | None) -> dict[str, str]:
        """key -> chunk text for every stored entry of ``fingerprint`` (None: of every model)
        (from the text index, no blob loaded; index entries whose blob was evicted or deleted
        are left out)."""
        try:
            return self._texts(fingerprint)
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot list the KVStore in {self.directory}: its database is damaged ({e}); "
                             "reopen it (a damaged text index is rebuilt) or delete the directory") from e

    def _texts(self, fingerprint: str | None) -> dict[str, str]:
        out = {}
        for key in list(self._index.iterkeys()):
            raw = self._index.get(key, retry=True)
            if raw is None:
                continue
            try:
                rec = json.loads(raw)
                text, fp = rec["text"], rec["fingerprint"]
            except (ValueError, KeyError, TypeError):
                log.warning("KVStore: unreadable text-index entry %s; gc() will rebuild it", key)
                continue
            if (fingerprint is None or fp == fingerprint) and key in self._blobs:
                out[key] = text
        return out

    # ---- maintenance ---------------------------------------------------------------
    def delete(self, key) -> bool:
        """Remove ``key``; True if a blob was stored under it."""
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
        for key in list(self._index.iterkeys()):
            with self._blobs.transact(retry=True):
                if key not in self._blobs and self._index.delete(key, retry=True):
                    dropped += 1
        reindexed = corrupt = 0
        for key in list(self._blobs.iterkeys()):
            if verify and self._verify_one(key):
                corrupt += 1
                continue
            if self._reindex(key):
                reindexed += 1
        return {"evicted": evicted, "index_dropped": dropped, "reindexed": reindexed,
                "corrupt": corrupt, "check_warnings": check_warnings, "entries": len(self._blobs)}

    def close(self) -> None:
        self._blobs.close()
        self._index.close()

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVStore({str(self.directory)!r}, size_limit={self.size_limit})"

    # ---- internals -----------------------------------------------------------------
    def _miss(self) -> None:
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
        handle, tag = self._blobs.get(key, default=None, read=True, tag=True, retry=True)
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
                if size == 0:
                    data = handle.read()
                    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data \
                        else torch.empty(0, dtype=torch.uint8), tag, name
                if pin_memory:
                    try:
                        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                    except RuntimeError as e:  # no CUDA, or page-locked memory exhausted
                        log.debug("KVStore: no pinned buffer for %s (%s); mapping the file", key, e)
                    else:
                        view, got = memoryview(buf.numpy()), 0
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
        handle = self._blobs.get(key, default=None, read=True, retry=True)
        if handle is None:
            return False
        name = getattr(handle, "name", None)
        with handle:
            try:
                size = os.fstat(handle.fileno()).st_size
            except (AttributeError, io.UnsupportedOperation):
                return True  # a value held in SQLite: checked when read
            head = handle.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            end = None
            try:
                header = _read_header(head + handle.read(n))[0] if 0 < n < 2**27 else {}
                if header and _is_newer_format(_metadata(header)):
                    return True  # not ours to judge
                end = max((int(info["data_offsets"][1]) for k, info in header.items() if k != "__metadata__"),
                          default=None)
            except (_Corrupt, KeyError, TypeError, ValueError, IndexError):
                pass
        if end is None or size != 8 + n + end:
            self._drop_corrupt(key, name, f"file of {size} bytes, its header says {'?' if end is None else 8 + n + end}")
            return False
        return True

    def _current_tag(self, key: str) -> str | None:
        handle, tag = self._blobs.get(key, default=None, read=True, tag=True, retry=True)
        if handle is not None:
            handle.close()
        return tag

    def _current_name(self, key: str) -> str | None:
        handle = self._blobs.get(key, default=None, read=True, retry=True)
        if handle is None:
            return None
        handle.close()
        return getattr(handle, "name", None)

    def _drop_corrupt(self, key: str, name: str | None, problem: str) -> None:
        """Log, count and delete a blob that failed verification. Deletes only the version
        that was read (same file name), so a good entry another process just wrote survives."""
        log.warning("KVStore: corrupt entry %s in %s: %s; deleted, it will be recomputed",
                    key, self.directory, problem)
        with self._lock:
            self._counts["corrupt"] += 1
        with self._blobs.transact(retry=True):
            if key in self._blobs and (name is None or self._current_name(key) == name):
                self._blobs.delete(key, retry=True)
            if key not in self._blobs:
                self._index.delete(key, retry=True)

    def _enforce_limit(self) -> int:
        """Evict least-recently-used blobs, one per transaction, until the blob cache fits
        ``size_limit``; returns how many were evicted."""
        # diskcache has no public "evict one LRU item" call (Cache.cull removes ten at a time),
        # so run its own policy query on its connection, inside its transaction.
        select = diskcache.core.EVICTION_POLICY[_EVICTION_POLICY]["cull"].format(fields="key", now=0)
        evicted = 0
        while self._blobs.volume() > self.size_limit:
            with self._blobs.transact(retry=True):
                if self._blobs.volume() <= self.size_limit:
                    break
                rows = self._blobs._sql(select, (1,)).fetchall()
                if not rows:
                    break
                (victim,) = rows[0]
                self._blobs.delete(victim, retry=True)
                self._index.delete(victim, retry=True)
            evicted += 1
            log.debug("KVStore: evicted %s (size limit %d)", victim, self.size_limit)
        if evicted:
            with self._lock:
                self._counts["evictions"] += evicted
        return evicted

    def _verify_one(self, key: str) -> bool:
        """Fully check one blob (for gc(verify=True)); True if it was corrupt and dropped."""
        found = self._read(key)
        if found is None:
            return False
        buf, tag, name = found
        try:
            verified = _verified_header(buf, tag)
            if verified is not None:  # None: a newer format, left for the kvrag that wrote it
                _deserialize(buf, *verified)
        except _Corrupt as e:
            self._drop_corrupt(key, name, str(e))
            return True
        return False

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
                log.warning("KVStore: SQLite integrity check of %s: %s", cache.directory, message)
                problems += 1
        root = Path(cache.directory)
        select = "SELECT rowid, key, raw, filename FROM Cache WHERE filename IS NOT NULL"
        # Rows without files. A snapshot finds candidates without holding the write lock; each
        # is confirmed inside a transaction, where its row cannot change and its file cannot
        # legitimately vanish (diskcache removes a replaced file only after its row changed).
        missing = [row for row in cache._sql(select).fetchall() if not (root / row[3]).exists()]
        for rowid, db_key, raw, filename in missing:
            with self._blobs.transact(retry=True), cache.transact(retry=True):
                still = cache._sql("SELECT 1 FROM Cache WHERE rowid = ? AND filename = ?",
                                   (rowid, filename)).fetchall()
                if not still or (root / filename).exists():
                    continue
                cache._sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
                if cache is self._blobs and raw:  # raw: a str key, ours (never unpickle one)
                    self._index.delete(db_key, retry=True)
            log.warning("KVStore: entry %s in %s lost its file %s; deleted", db_key, cache.directory, filename)
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
                age = now - path.stat().st_mtime
            except OSError:  # removed meanwhile (e.g. the old file of a replaced value)
                continue
            if age < _ORPHAN_GRACE_S:
                log.debug("KVStore: unreferenced file %s is %.0f s old: a write in progress, kept", path, age)
                continue
            log.info("KVStore: removing %s, a file no entry points at (%.0f s old)", path, age)
            cache.disk.remove(rel)  # also removes its directories once empty
            problems += 1
        return problems

    def _reindex(self, key: str) -> bool:
        """Recreate a missing or unreadable text-index entry from the blob's own metadata
        (a writer that died between the blob and the index write leaves one)."""
        raw = self._index.get(key, retry=True)
        if raw is not None:
            try:
                json.loads(raw)["text"]
                return False
            except (ValueError, KeyError, TypeError):
                pass
        handle, tag = self._blobs.get(key, default=None, read=True, tag=True, retry=True)
        if handle is None:
            return False
        with handle:
            # Only the header is needed; the checksum is verified when the blob is loaded.
            head = handle.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            try:
                meta = _metadata(_read_header(head + handle.read(n))[0]) if 0 < n < 2**27 else None
            except _Corrupt:
                meta = None
        if not meta or "text" not in meta or "fingerprint" not in meta:
            return False
        if _is_newer_format(meta):
            return False  # its text index is the newer kvrag's, which may lay it out differently
        value = json.dumps({"text": meta["text"], "fingerprint": meta["fingerprint"],
                            "n_tokens": int(meta.get("n_tokens", 0))})
        with self._blobs.transact(retry=True):
            if self._current_tag(key) != tag:
                return False
            self._index.set(key, value, retry=True)
        return True
