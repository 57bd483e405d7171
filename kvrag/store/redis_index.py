"""``SharedIndex``: the text index of the shared tier, which segmentation on every replica reads
to find the chunks other replicas stored.

Two keys under this store's prefix, both with the hash tag ``{idx}`` (one slot of a Redis
Cluster, so one transaction writes both): ``<prefix>{idx}``, a hash ``key -> JSON {text,
fingerprint, n_tokens}``; ``<prefix>{idx}:v``, a counter bumped on every change of it, so a
replica re-reads the index only when it changed.

The index is data like the rest of Redis: it is read only while it stays within
``max_entries`` rows and ``max_bytes`` bytes (a crafted index must not cost every replica its
memory; past either, the listing read last stays in use), a row that is not kvrag's is never
listed, and an index key holding another type is deleted (it is kvrag's name, and while it
holds a foreign value no chunk can be listed). A chunk's own blob says what its row must be
(``listing_from_head``), so a missing or crafted row is rebuilt from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvrag.errors import StoreError
from kvrag.store.blob import Corrupt, index_record, index_value, metadata, read_header
from kvrag.store.redis_connection import LOG_NAME, error_cause, routing_error

if TYPE_CHECKING:
    from kvrag.store.redis_connection import RedisConnection

log = logging.getLogger(LOG_NAME)

#: The index is read only while it stays under these (entries, bytes).
MAX_INDEX_ENTRIES = 200_000
MAX_INDEX_BYTES = 2**26


def listing_from_head(head: bytes) -> str | None:
    """The index value (JSON) of a blob whose first bytes are ``head``, from its own header."""
    try:
        meta = metadata(read_header(head)[0])
        return index_value(meta["text"], meta["fingerprint"], int(meta.get("n_tokens", 0)))
    except (Corrupt, KeyError, ValueError, TypeError):
        return None


class SharedIndex:
    """The text index of the shared store under ``prefix`` on ``connection``, and the listing
    this process read of it last.

    max_entries / max_bytes: not read past these. refused: called with an error (an error
    reply, or a ``StoreError`` whose message starts ``INDEXTOOBIG``) to count it and warn once
    per cause (the store's own counter, ``RedisStore._refused``). Every method runs commands and
    raises redis-py's errors: the store calls them through its outage handling."""

    def __init__(
        self,
        connection: RedisConnection,
        prefix: str,
        *,
        max_entries: int = MAX_INDEX_ENTRIES,
        max_bytes: int = MAX_INDEX_BYTES,
        refused: Callable[[BaseException], None],
    ) -> None:
        self.connection = connection
        self.name = f"{prefix}{{idx}}"
        self.version_name = f"{prefix}{{idx}}:v"
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._refused = refused
        self._version: bytes | None = None
        self._rows: dict[str, tuple[str, str]] = {}  # key -> (text, fingerprint), last read
        self._over: tuple | None = None  # (version, entries) of an index found over a bound

    def texts(self, fingerprint: str | None) -> dict[str, str]:
        """key -> text of the rows of ``fingerprint`` (None: all) in the listing read last."""
        return {k: t for k, (t, fp) in self._rows.items() if fingerprint is None or fp == fingerprint}

    def forget(self) -> None:
        """Drop the listing read last (the index was cleared)."""
        self._rows, self._version = {}, None

    def refresh(self) -> None:
        """Re-read the index if its version counter moved, while it stays within the bounds;
        over a bound, the listing read last stays (and is not read again until it changes)."""
        import redis

        client = self.connection.client
        try:
            p = client.pipeline(transaction=False)
            p.get(self.version_name)
            p.hlen(self.name)  # also keeps the index recently used under allkeys-lru
            version, n = p.execute()
        except redis.ResponseError as e:  # an index key of another type: not ours, replaced
            if routing_error(e):
                raise
            self.repair()
            raise
        if version == self._version and n == len(self._rows):
            return
        if (version, n) == self._over:
            return  # still the index found over a bound: not read again until it changes
        if n > self.max_entries:
            self._over = (version, n)
            self._refused(StoreError(f"INDEXTOOBIG the text index lists {n} entries (> {self.max_entries})"))
            return
        rows = None if self._estimate_over() else self._read()
        if rows is None:
            self._over = (version, n)
        else:
            self._rows, self._version = rows, version

    def _estimate_over(self) -> bool:
        """Whether Redis's own estimate of the index's memory (``MEMORY USAGE``, from a few
        sampled rows: O(1)) is over twice ``max_bytes``: refused without reading a row. Below
        that, ``_read`` counts the bytes exactly. A server without the command (or refusing
        it) gives no estimate."""
        import redis

        try:
            estimate = self.connection.client.memory_usage(self.name, samples=5)
        except redis.ResponseError as e:
            if routing_error(e):
                raise
            return False
        if estimate is not None and estimate > 2 * self.max_bytes:
            self._refused(StoreError(f"INDEXTOOBIG the text index takes about {estimate} bytes in Redis"))
            return True
        return False

    def _read(self) -> dict[str, tuple[str, str]] | None:
        """The index, read a batch at a time (HSCAN); None once it passes ``max_bytes``."""
        rows: dict[str, tuple[str, str]] = {}
        size = 0
        for k, v in self.connection.client.hscan_iter(self.name, count=1000):
            size += len(k) + len(v)
            if size > self.max_bytes:
                self._refused(StoreError(f"INDEXTOOBIG the text index holds more than {self.max_bytes} bytes"))
                return None
            # A blank text would match everywhere in a prompt, one not ours is unusable: never listed.
            try:
                rec = index_record(v.decode("utf-8"))
                if rec is not None:
                    rows[k.decode("utf-8")] = rec
            except UnicodeDecodeError:
                continue
        return rows

    def write(self, key: str, listing: str | None) -> None:
        """Set (``listing``: its JSON) or drop (None) ``key``'s row and bump the index version,
        in one transaction (both keys share the ``{idx}`` slot). An index key of another type
        is replaced and the write tried once more."""
        import redis

        for attempt in (0, 1):
            t = self.connection.client.pipeline(transaction=True)
            if listing is None:
                t.hdel(self.name, key)
            else:
                t.hset(self.name, key, listing)
            t.incr(self.version_name)
            try:
                t.execute()
                return
            except redis.ResponseError as e:
                # Only a foreign value under an index name is repaired (OOM, READONLY: raised).
                if attempt or routing_error(e) or error_cause(e) not in ("WRONGTYPE", "ERR"):
                    raise
                self.repair()

    def repair(self) -> None:
        """Delete an index key that holds another type (or a version that is not a number):
        it is kvrag's name, and while it holds a foreign value no chunk can be listed."""
        client = self.connection.client
        p = client.pipeline(transaction=False)
        p.type(self.name)
        p.type(self.version_name)
        t_idx, t_ver = (x.decode() if isinstance(x, bytes) else str(x) for x in p.execute())
        bad = [
            n
            for n, t, ok in ((self.name, t_idx, "hash"), (self.version_name, t_ver, "string"))
            if t not in (ok, "none")
        ]
        if t_ver == "string":
            try:
                int(client.get(self.version_name) or 0)
            except ValueError:
                bad.append(self.version_name)
        for n in bad:
            client.delete(n)
            log.warning("RedisStore: index key %s held a value kvrag does not write; deleted it", n)
        if bad:
            self._version = None
