"""``RedisStore``: chunk entries in a Redis (or Valkey) server that several replicas share.

The bytes of an entry are the blob every persistent tier writes (``kvrag.store.blob``): the
same fingerprint, token ids and checksum as on disk, verified on every read. Redis is data,
never code: a value that is missing, damaged, of another key, of another model or not
kvrag's at all is a miss (None) -- never deserialized as anything but tensors, never raised
to the reader.

Keys, under a configurable ``prefix`` so several stores (or other applications) share a DB.
Every key of one entry carries the entry key as a Redis hash tag (``{<key>}``), and the two
index keys share the tag ``{idx}``, so each transaction touches one hash slot and the same
layout works on one server and on a Redis Cluster:

* ``<prefix>m:{<key>}``: a hash ``{ver, tag, size, part_size, parts}``, the entry's *meta*
  (``kvrag.store.redis_meta``);
* ``<prefix>p:{<key>}:<ver>:<i>``: the blob's bytes in parts of ``part_size`` bytes;
* ``<prefix>{idx}`` and ``<prefix>{idx}:v``: the text index that segmentation reads
  (``texts``) and its version counter (``kvrag.store.redis_index``).

Keys written under a layout without hash tags (``m:<key>``, ``p:<key>:...``, ``idx``,
``idxv``) are not read: such a store is simply empty to this code -- misses, never errors --
and ``clear`` removes its keys with the rest of the prefix.

Why parts (4 MiB) rather than one value: measured on this project's 2-core box against a
local Redis 8 with hiredis, a 12 MiB blob reads in ~30 ms as one value and ~16 ms as three
pipelined 4 MiB parts, and writes ~3x faster in parts; and one value must stay under
``proto-max-bulk-len`` (512 MB), which a 2048-token chunk of a 70B model does not. A new
version of an entry gets new part names (``ver``), so a reader never mixes two writers'
parts; parts are written with a TTL that the meta transaction removes, so a writer that dies
halfway leaves nothing behind for good. The index entry is written just after the meta (a
second transaction: another slot); a writer that dies between the two leaves an entry that is
stored but not listed, which ``ensure_indexed`` re-lists from the blob's own header.

Servers, URLs and passwords: ``kvrag.store.redis_connection`` (``redis://``, ``rediss://``,
``unix://``, ``redis+cluster://``; the password from ``$KVRAG_REDIS_PASSWORD``).

Eviction is Redis's own (``maxmemory-policy allkeys-lru``): a meta or any one part evicted
makes the entry a miss, and its index entry is dropped when a read finds it gone.

Redis unreachable: reads are misses and listing returns what was seen last, with one
warning per outage (``kvrag.store.redis_store`` logger, the whole tier's); writes raise
``SharedStoreDown`` (the tiered store catches it: the near tiers hold the entry). An error
reply (OOM, READONLY, WRONGTYPE, NOGROUP, ...) is handled the same way -- a read is a miss, a
write raises ``SharedStoreRefused`` (a ``SharedStoreDown``) -- with one warning per cause.
Every read is bounded before it is made (see ``_read`` and ``texts``): Redis is data, and the
worst a crafted value may do is a miss. After a failure the store skips Redis for ``retry_s``
instead of paying a connect timeout on every chunk read (``kvrag.store.outage``), then tries
again: redis-py opens a new connection for the next command, so it reconnects by itself.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from typing import Any

import numpy as np
import torch

from kvrag.checks import check_int
from kvrag.errors import StoreError
from kvrag.store.base import ChunkEntry, ChunkStore, make_key
from kvrag.store.blob import (
    MAX_HEADER_BYTES,
    Corrupt,
    checksum,
    deserialize,
    index_value,
    metadata,
    serialize,
    validate_entry,
    verified_header,
)
from kvrag.store.redis_connection import (
    LOG_NAME,
    RedisConnection,
    SharedStoreDown,
    SharedStoreRefused,
    error_cause,
    redact,
    routing_error,
)
from kvrag.store.redis_index import MAX_INDEX_BYTES, MAX_INDEX_ENTRIES, SharedIndex, listing_from_head
from kvrag.store.redis_meta import MAX_ENTRY_BYTES, META_FIELDS, meta_fields, part_len

log = logging.getLogger(LOG_NAME)

PART_SIZE = 4 * 2**20
# A writer that dies between its parts and its meta leaves parts nobody points at: they expire.
_PENDING_TTL_S = 600
# Parts fetched per round trip: bounded in commands and in bytes, so a meta that declares
# millions of parts costs one small batch before its first missing part ends the read.
_PART_BATCH = 1024
_BATCH_BYTES = 2**26
# Parts deleted with an entry found evicted or corrupt (a 4 MiB-part entry of 16 GiB has 4,096).
_REMOVED_PARTS = 4 * _PART_BATCH
# The first bytes of a blob read to find its header (the rest up to its length if longer).
_HEAD_BYTES = 2**16


class RedisStore(ChunkStore):
    """Chunk entries in Redis, shared by every replica configured with the same URL and prefix.

    url: ``redis://[[user]:password@]host:port/db`` (``rediss://`` for TLS), or
    ``redis+cluster://host:port`` (``rediss+cluster://``) for a Redis Cluster (see
    ``kvrag.store.redis_connection.parse_url``). prefix: the key prefix of this store's keys
    (no ``{`` or ``}``: they make the hash tags). part_size: bytes per stored part.
    socket_timeout: seconds per command (short: a dead server must cost a query little).
    retry_s: after a failure, seconds during which the server is not tried. client: a redis-py
    client to use instead of one made from ``url``. max_entry_bytes: a meta declaring more is
    not fetched (a KVRag lowers it to its model's largest entry); max_index_entries /
    max_index_bytes: the text index is not read past these (the listing read last stays).
    Counters are per process."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvrag:",
        part_size: int = PART_SIZE,
        socket_timeout: float = 2.0,
        retry_s: float = 2.0,
        client=None,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        max_index_entries: int = MAX_INDEX_ENTRIES,
        max_index_bytes: int = MAX_INDEX_BYTES,
    ) -> None:
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(
                f"prefix must be a non-empty string without '{{' or '}}' (kvrag's hash tags), got {prefix!r}"
            )
        check_int("part_size", part_size, 1024)
        self.url = url
        self.prefix = prefix
        self.part_size = part_size
        #: The server's client and outage breaker, shared with the precompute queues on it.
        self.connection = RedisConnection(url, socket_timeout=socket_timeout, retry_s=retry_s, client=client)
        self.cluster = self.connection.cluster
        self.outage = self.connection.outage
        self._lock = threading.Lock()
        for name, v in (
            ("max_entry_bytes", max_entry_bytes),
            ("max_index_entries", max_index_entries),
            ("max_index_bytes", max_index_bytes),
        ):
            check_int(name, v, 1)
        self.max_entry_bytes = max_entry_bytes
        self.index = SharedIndex(
            self.connection, prefix, max_entries=max_index_entries, max_bytes=max_index_bytes, refused=self._refused
        )
        self._refusals: set[str] = set()
        self._maxmemory = 0
        self._room_read_at = 0.0  # causes of error replies already warned about
        self._counts = {
            "hits": 0,
            "misses": 0,
            "corrupt": 0,
            "wrong_model": 0,
            "unreachable": 0,
            "error_replies": 0,
        }

    def __repr__(self) -> str:
        return f"RedisStore({redact(self.url)!r}, prefix={self.prefix!r})"

    @property
    def client(self):
        """The redis-py client (``RedisConnection.client``: a cluster's is made at first use)."""
        return self.connection.client

    # ---- key names (layout 2: hash tags, see the module docstring) ---------------------
    def _meta(self, key: str) -> str:
        return f"{self.prefix}m:{{{key}}}"

    def _part(self, key: str, ver: str, i: int) -> str:
        return f"{self.prefix}p:{{{key}}}:{ver}:{i}"

    @property
    def _idx(self) -> str:
        return self.index.name

    @property
    def _idxv(self) -> str:
        return self.index.version_name

    # ---- plumbing ------------------------------------------------------------------
    def _call(self, fn, *, default=None, write: bool = False):
        """Run ``fn()`` against the server; connection trouble -> ``default`` (reads) or
        ``SharedStoreDown`` (writes), logged once per outage."""
        import redis
        from redis.exceptions import AskError, ClusterCrossSlotError, ClusterError, RedisClusterException

        if self.outage.skip():
            if write:
                raise SharedStoreDown(f"{self.outage.what} is unreachable")
            with self._lock:
                self._counts["unreachable"] += 1
            return default
        try:
            try:
                out = fn()
            except (AskError, ClusterCrossSlotError) as e:
                # MOVED/ASK/CROSSSLOT from a plain client: the URL names a cluster node.
                raise redis.ConnectionError(
                    f"{e} (the server is a Redis Cluster node: use a redis+cluster:// URL)"
                ) from e
        except (redis.ConnectionError, redis.TimeoutError, OSError, ClusterError, RedisClusterException) as e:
            self.outage.failed(e)
            if write:
                raise SharedStoreDown(f"{self.outage.what} is unreachable: {e}") from e
            with self._lock:
                self._counts["unreachable"] += 1
            return default
        except redis.RedisError as e:  # an error reply: the server is up, the command failed
            self.outage.ok()
            self._refused(e)
            if write:
                raise SharedStoreRefused(f"{self.outage.what} refused the write: {error_cause(e)}: {e}") from e
            return default
        self.outage.ok()
        return out

    def _refused(self, e: BaseException) -> None:
        """Count an error reply and warn once per cause (OOM, READONLY, WRONGTYPE, ...)."""
        cause = error_cause(e)
        with self._lock:
            self._counts["error_replies"] += 1
            first = cause not in self._refusals
            self._refusals.add(cause)
        if first:
            log.warning(
                "%s answered an error (%s: %s): reads of it are misses, writes stay in the local "
                "tiers and are pushed up later; said once per kind of error",
                self.outage.what,
                cause,
                e,
            )

    def _check_room(self, size: int) -> None:
        """Refuse (``SharedStoreRefused``) an entry larger than a quarter of the server's
        ``maxmemory``: storing it would evict most of the rest, the text index and the
        queue with it. The limit is read at most once a minute (one server; a cluster's
        memory is per node and not checked)."""
        if self.cluster:
            return
        now = time.monotonic()
        if now >= self._room_read_at:
            import redis

            try:
                self._maxmemory = int(self.client.info("memory").get("maxmemory") or 0)
            except (redis.ResponseError, ValueError, TypeError):  # INFO refused (ACL): not checked
                self._maxmemory = 0
            self._room_read_at = now + 60.0
        if self._maxmemory and size > self._maxmemory // 4:
            e = StoreError(
                f"TOOBIG an entry of {size} bytes is more than a quarter of the server's maxmemory "
                f"({self._maxmemory} bytes); kept in the local tiers only"
            )
            self._refused(e)
            raise SharedStoreRefused(str(e))

    def limit_entry_bytes(self, n: int) -> None:
        """Fetch no entry whose meta declares more than ``n`` bytes (the largest entry the
        reading model can produce, with margin: ``kvrag.limits.entry_bytes_bound``)."""
        self.max_entry_bytes = min(check_int("entry byte limit", n, 1), MAX_ENTRY_BYTES)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    # ---- ChunkStore ----------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return bool(self._call(lambda: self.client.exists(self._meta(key)), default=0))

    def put(self, key: str, entry: ChunkEntry) -> None:
        """Store ``entry`` (parts first, then the meta that points at them and the index
        entry, in one transaction); the parts of the version it replaces are deleted.
        Raises SharedStoreDown if the server cannot be reached."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        ids = validate_entry(entry)
        data = serialize(entry, ids)
        ver = uuid.uuid4().hex[:12]
        n = max(1, math.ceil(len(data) / self.part_size))
        view = memoryview(data)
        parts = [self._part(key, ver, i) for i in range(n)]
        listing = index_value(entry.text, entry.fingerprint, ids.numel())

        def write():
            import redis

            self._check_room(len(data))
            p = self.client.pipeline(transaction=False)
            for i, name in enumerate(parts):
                p.set(name, view[i * self.part_size : (i + 1) * self.part_size], ex=_PENDING_TTL_S)
            p.execute()
            # WATCH the meta: a writer that published the same key between our read of the old
            # version and our commit makes us read again, so its parts are deleted, not leaked.
            with self.client.pipeline(transaction=True) as t:
                while True:
                    try:
                        t.watch(self._meta(key))
                        try:
                            old = meta_fields(
                                t.hmget(self._meta(key), META_FIELDS), self.part_size, self.max_entry_bytes
                            )
                        except redis.ResponseError as e:  # not a hash: not ours, replaced
                            if routing_error(e):
                                raise
                            old = None
                        t.multi()
                        for name in parts:
                            t.persist(name)
                        t.delete(self._meta(key))
                        t.hset(
                            self._meta(key),
                            mapping={
                                "ver": ver,
                                "tag": checksum(data),
                                "size": len(data),
                                "part_size": self.part_size,
                                "parts": n,
                            },
                        )
                        t.execute()
                        break
                    except redis.WatchError:
                        continue
            self.index.write(key, listing)
            if old is not None:
                self._delete_parts(key, old)

        self._call(write, write=True)

    def get(self, key: str, fingerprint: str, *, pin_memory: bool = False) -> ChunkEntry | None:
        found = self._call(lambda: self._read(key))
        if found is None:
            self._count("misses")
            return None
        if found[0] == "gone":  # evicted: the rest of it is removed, it will be recomputed
            self._count("misses")
            self._call(lambda: self._remove(key, found[1]))
            return None
        if found[0] == "bad":
            self._drop_corrupt(key, found[1], found[2])
            return None
        parts, meta = found
        try:
            buf = _buffer(parts, meta["size"], pin_memory)
            verified = verified_header(buf, meta.get("tag"), fingerprint)
            if verified is None:
                log.warning("RedisStore: entry %s has a newer format than this kvrag's; not used", key)
                self._count("misses")
                return None
            header, start = verified
            if (owner := metadata(header).get("fingerprint")) != fingerprint:
                log.warning("RedisStore: entry %s belongs to model %s, not %s; not used", key, owner, fingerprint)
                self._count("wrong_model")
                self._count("misses")
                return None
            entry = deserialize(buf, header, start)
            # The checksum proves the bytes are whole, not that they are this key's: a value
            # copied from another key (or a crafted one with its own checksum) is caught here.
            if make_key(fingerprint, entry.token_ids) != key:
                raise Corrupt("its token ids belong to another key")
        except Corrupt as e:
            self._drop_corrupt(key, meta, str(e))
            return None
        self._count("hits")
        return entry

    def delete(self, key: str) -> bool:
        def run():
            old = meta_fields(self._hmget(self._meta(key)), self.part_size, self.max_entry_bytes)
            existed = self.client.delete(self._meta(key))
            self.index.write(key, None)
            if old is not None:
                self._delete_parts(key, old)
            return bool(existed)

        return self._call(run, write=True)

    def ensure_indexed(self, key: str) -> bool:
        """True if ``key``'s meta and every part are present, of the lengths the meta declares,
        and it is listed as its blob's own header says (re-listed if not: a writer killed
        between the two, or a crafted row). A cut-short, over-long or foreign value is deleted
        (counted ``corrupt``) and an evicted one removed: False, so it is stored again."""
        return bool(self._call(lambda: self._ensure_indexed(key), default=False))

    def _ensure_indexed(self, key: str) -> bool:
        found = self._present(key)
        if found is None:
            return False
        if found[0] == "gone":
            self._remove(key, found[1])
            return False
        if found[0] == "bad":
            self._drop_corrupt(key, found[1], found[2])
            return False
        meta = found[1]
        head, listed = self._head(key, meta)
        listing = listing_from_head(head)
        if listing is None:
            self._drop_corrupt(key, meta, "its blob's header is unreadable")
            return False
        if listed != listing.encode("utf-8"):
            self.index.write(key, listing)
            log.warning(
                "RedisStore: chunk %s was stored but %s; re-listed it from its blob",
                key,
                "not listed" if listed is None else "listed with another text",
            )
        return True

    def texts(self, fingerprint: str | None) -> dict[str, str]:
        """key -> text of the listed entries of ``fingerprint`` (None: all). The index is
        re-read only when its version counter moved, and only while it stays within
        ``max_index_entries`` and ``max_index_bytes``; unreachable, refusing, or over a bound:
        what was read last (``SharedIndex.refresh``)."""
        self._call(self.index.refresh)
        return self.index.texts(fingerprint)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = dict(self._counts)
        lookups = c["hits"] + c["misses"]

        def run():
            import redis

            try:
                listed = self.client.hlen(self._idx)
            except redis.ResponseError as e:  # an index of another type: the rest is still reported
                if routing_error(e):
                    raise
                self._refused(e)
                listed = None
            if not self.cluster:
                mem = self.client.info("memory")
                return {
                    "listed": listed,
                    "used_memory": mem.get("used_memory"),
                    "maxmemory": mem.get("maxmemory"),
                    "maxmemory_policy": mem.get("maxmemory_policy"),
                }
            # A cluster: summed over its primaries (``nodes``), one policy if they agree.
            mems = list(self.client.info("memory", target_nodes=self.client.PRIMARIES).values())
            policies = sorted({str(m.get("maxmemory_policy")) for m in mems})
            return {
                "listed": listed,
                "nodes": len(mems),
                "used_memory": sum(m.get("used_memory", 0) for m in mems),
                "maxmemory": sum(m.get("maxmemory", 0) for m in mems),
                "maxmemory_policy": policies[0] if len(policies) == 1 else ",".join(policies),
            }

        server = self._call(run, default={"reachable": False})
        return {
            "url": redact(self.url),
            "prefix": self.prefix,
            **server,
            **c,
            "hit_rate": c["hits"] / lookups if lookups else 0.0,
        }

    def clear(self) -> int:
        """Delete every key under this store's prefix (all models); returns how many."""

        def run():
            n = 0
            batch = []
            for k in self.client.scan_iter(match=_glob_escape(self.prefix) + "*", count=500):
                batch.append(k)
                if len(batch) >= 500:
                    n += self.client.delete(*batch)
                    batch = []
            if batch:
                n += self.client.delete(*batch)
            self.index.forget()
            return n

        return self._call(run, write=True)

    def close(self) -> None:
        self.connection.close()

    # ---- internals -----------------------------------------------------------------
    def _read(self, key: str):
        """(parts, meta) of ``key``, every part read bounded by the length its meta declares;
        None if there is no meta; ("gone", meta) if a part is missing (evicted); ("bad", meta
        or None, problem) if the meta or a part is not what kvrag writes (not a hash, a
        declared size over ``max_entry_bytes``, sizes that disagree, a part cut short, too
        long or not a string)."""
        meta = self._meta_checked(key)
        if meta is None or meta[0] != "ok":
            return meta
        meta = meta[1]
        parts: list[bytes] = []
        for batch in self._batches(meta):
            p = self.client.pipeline(transaction=False)
            for i in batch:
                # One byte past the declared length: a part longer than declared shows as such.
                p.getrange(self._part(key, meta["ver"], i), 0, part_len(meta, i))
            got = self._execute_parts(p)
            if isinstance(got, str):
                return "bad", meta, got
            for i, x in zip(batch, got):
                if not x:
                    return "gone", meta
                if len(x) != part_len(meta, i):
                    return "bad", meta, f"part {i} holds {len(x)}+ bytes where its meta declares {part_len(meta, i)}"
            parts.extend(got)
        return parts, meta

    def _present(self, key: str):
        """``_read`` without fetching the bytes (each part's length only): None, ("gone",
        meta), ("bad", meta or None, problem) or ("ok", meta)."""
        meta = self._meta_checked(key)
        if meta is None or meta[0] != "ok":
            return meta
        meta = meta[1]
        for batch in self._batches(meta):
            p = self.client.pipeline(transaction=False)
            for i in batch:
                p.strlen(self._part(key, meta["ver"], i))
            got = self._execute_parts(p)
            if isinstance(got, str):
                return "bad", meta, got
            for i, n in zip(batch, got):
                if not n:
                    return "gone", meta
                if n != part_len(meta, i):
                    return "bad", meta, f"part {i} holds {n} bytes where its meta declares {part_len(meta, i)}"
        return "ok", meta

    def _meta_checked(self, key: str):
        """None (no meta), ("ok", meta) or ("bad", None, problem): a meta that is not a hash
        of kvrag's fields, or whose size, part size and part count disagree or exceed the
        bounds, is never followed."""
        import redis

        try:
            raw = self.client.hmget(self._meta(key), META_FIELDS)
        except redis.ResponseError as e:  # WRONGTYPE: someone else's value under our name
            if routing_error(e):
                raise
            return "bad", None, "its meta is not a hash"
        if all(v is None for v in raw):
            return None
        meta = meta_fields(raw, self.part_size, self.max_entry_bytes)
        if meta is None:
            shown = {f: (v[:40] if isinstance(v, bytes) else v) for f, v in zip(META_FIELDS, raw)}
            return "bad", None, f"its meta {shown} is not one kvrag writes (limit {self.max_entry_bytes} bytes)"
        return "ok", meta

    @staticmethod
    def _batches(meta: dict[str, Any]):
        """Part numbers in batches bounded in count and bytes (one round trip each)."""
        step = max(1, min(_PART_BATCH, _BATCH_BYTES // meta["part_size"]))
        for start in range(0, meta["parts"], step):
            yield range(start, min(start + step, meta["parts"]))

    @staticmethod
    def _execute_parts(p):
        """The pipeline's replies, or a problem (str) if a part is not a string."""
        import redis

        try:
            return p.execute()
        except redis.ResponseError as e:
            if routing_error(e):
                raise
            return f"a part is not a string ({error_cause(e)})"

    def _head(self, key: str, meta: dict[str, Any]) -> tuple[bytes, bytes | None]:
        """(the blob's first bytes, through the end of its header -- bounded by its size and
        the largest header a blob may have, read across parts if it spans several --, the
        index row of ``key``), in one round trip when the header fits in ``_HEAD_BYTES``."""
        want = min(meta["size"], _HEAD_BYTES)
        p = self.client.pipeline(transaction=False)
        self._queue_range(p, key, meta, want)
        p.hget(self._idx, key)
        *parts, listed = p.execute(raise_on_error=False)
        if isinstance(listed, Exception):  # the index: not this entry's problem (see ``texts``)
            raise listed
        head = b"" if any(not isinstance(x, bytes) for x in parts) else b"".join(parts)
        if len(head) >= 8:
            n = 8 + int.from_bytes(head[:8], "little")
            if want < n <= min(meta["size"], MAX_HEADER_BYTES + 8):
                p = self.client.pipeline(transaction=False)
                self._queue_range(p, key, meta, n)
                got = self._execute_parts(p)
                head = b"" if isinstance(got, str) else b"".join(got)
        return head, listed

    def _queue_range(self, p, key: str, meta: dict[str, Any], n: int) -> None:
        """Queue on pipeline ``p`` the reads of the blob's first ``n`` bytes, part by part."""
        i = 0
        while i * meta["part_size"] < n:
            p.getrange(self._part(key, meta["ver"], i), 0, min(meta["part_size"], n - i * meta["part_size"]) - 1)
            i += 1

    def _remove(self, key: str, meta: dict[str, Any] | None) -> None:
        """Delete ``key``'s meta (only the version ``meta`` read: a good entry another replica
        has just written survives; None: only while it is still not kvrag's), its parts and
        its index entry: the first ``_REMOVED_PARTS`` of its declared parts at most -- an entry
        kvrag writes has far fewer, and a crafted meta that declares 400,000 parts must not
        cost 400,000 DELs."""
        import redis

        name = self._meta(key)
        with self.client.pipeline(transaction=True) as t:
            try:
                t.watch(name)
                try:
                    raw = t.hmget(name, META_FIELDS)
                    now = meta_fields(raw, self.part_size, self.max_entry_bytes)
                    same = now is None if meta is None else (now is not None and now["ver"] == meta["ver"])
                except redis.ResponseError as e:
                    if routing_error(e):
                        raise
                    same = meta is None  # still not a hash
                if not same:
                    return
                t.multi()
                t.delete(name)
                t.execute()
            except redis.WatchError:
                return
        self.index.write(key, None)
        if meta is not None:
            self._delete_parts(key, meta, _REMOVED_PARTS)

    def _drop_corrupt(self, key: str, meta: dict[str, Any] | None, problem: str) -> None:
        """Log, count and delete an entry that failed verification (see ``_remove``)."""
        log.warning(
            "RedisStore: corrupt entry %s in %s: %s; deleted, it will be recomputed", key, redact(self.url), problem
        )
        self._count("corrupt")
        self._count("misses")
        self._call(lambda: self._remove(key, meta))

    def _delete_parts(self, key: str, meta: dict[str, Any], limit: int | None = None) -> None:
        """Delete the parts of ``meta``'s version (the first ``limit`` only, if given), a
        batch of names at a time."""
        n = meta["parts"] if limit is None else min(limit, meta["parts"])
        for start in range(0, n, _PART_BATCH):
            self.client.delete(*(self._part(key, meta["ver"], i) for i in range(start, min(start + _PART_BATCH, n))))

    def _hmget(self, name: str) -> list:
        """A meta hash's fields (``META_FIELDS``), or [] when the key holds something else."""
        import redis

        try:
            return self.client.hmget(name, META_FIELDS)
        except redis.ResponseError as e:
            if routing_error(e):
                raise
            return []


def _buffer(parts: list[bytes], size: int, pin_memory: bool) -> torch.Tensor:
    """The parts joined in one writable uint8 tensor [size] (page-locked for a fast copy to a
    GPU if asked): one copy, the tensors of the entry are views of it."""
    buf = None
    if pin_memory:
        try:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no CUDA
            buf = None
    if buf is None:
        buf = torch.empty(size, dtype=torch.uint8)
    out, at = buf.numpy(), 0
    for x in parts:
        out[at : at + len(x)] = np.frombuffer(x, dtype=np.uint8)
        at += len(x)
    return buf


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)
