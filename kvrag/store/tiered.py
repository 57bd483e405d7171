"""``TieredStore``: a near store (the local disk) in front of a far one (a shared Redis).

Write-through: ``put`` stores in the near tier, then the far one. Read-through: a near miss
is read from the far tier and promoted to the near one (in a background thread, so the query
that found it does not wait for the disk write). Listing is the union of both, so a replica
finds what other replicas stored. The far tier being unreachable never fails a read or a
write here: the near tier serves or holds the entry (``kvrag.store.shared`` warns once per
outage).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvrag.errors import StoreError
from kvrag.store.base import ChunkEntry, ChunkStore

log = logging.getLogger("kvrag.store.tiered")


class TieredStore(ChunkStore):
    """``near`` (durable, local: a ``KVStore``) in front of ``far`` (shared: a ``RedisStore``)."""

    def __init__(self, near: ChunkStore, far: ChunkStore) -> None:
        self.near = near
        self.far = far
        self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrag-promote")
        self._promoting: set[str] = set()
        self._lock = threading.Lock()
        self._counts = {"near_hits": 0, "far_hits": 0, "misses": 0, "promoted": 0, "far_write_failures": 0}

    def __repr__(self) -> str:
        return f"TieredStore(near={self.near!r}, far={self.far!r})"

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def __contains__(self, key: object) -> bool:
        return key in self.near or key in self.far

    def get(self, key: str, fingerprint: str, *, pin_memory: bool = False) -> ChunkEntry | None:
        entry = self.near.get(key, fingerprint, pin_memory=pin_memory)
        if entry is not None:
            self._count("near_hits")
            return entry
        entry = self.far.get(key, fingerprint, pin_memory=pin_memory)
        if entry is None:
            self._count("misses")
            return None
        self._count("far_hits")
        with self._lock:
            promote = key not in self._promoting
            self._promoting.add(key)
        if promote:
            self._promoter.submit(self._promote, key, entry)
        return entry

    def _promote(self, key: str, entry: ChunkEntry) -> None:
        try:
            self.near.put(key, entry)
            self._count("promoted")
        except Exception as e:  # a full disk must not fail the query that read the entry
            log.warning("TieredStore: could not copy chunk %s to the local store: %s", key, e)
        finally:
            with self._lock:
                self._promoting.discard(key)

    def put(self, key: str, entry: ChunkEntry) -> None:
        """Near, then far. A far tier that cannot be reached is logged (once per outage, by
        it) and skipped: the entry is stored locally and served from there."""
        self.near.put(key, entry)
        try:
            self.far.put(key, entry)
        except StoreError as e:
            self._count("far_write_failures")
            log.debug("TieredStore: chunk %s stored locally only: %s", key, e)

    def delete(self, key: str) -> bool:
        near = self.near.delete(key)
        try:
            far = self.far.delete(key)
        except StoreError:
            far = False
        return bool(near or far)

    def ensure_indexed(self, key: str) -> bool:
        return self.near.ensure_indexed(key) or self.far.ensure_indexed(key)

    def texts(self, fingerprint: str | None) -> dict[str, str]:
        return {**self.far.texts(fingerprint), **self.near.texts(fingerprint)}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = dict(self._counts)
        return {**self.near.stats(), "tiers": c, "shared": self.far.stats()}

    def flush(self) -> None:
        """Wait for the promotions already started (tests, shutdown)."""
        self._promoter.submit(lambda: None).result()

    def close(self) -> None:
        self._promoter.shutdown(wait=True)
        self.near.close()
        self.far.close()
