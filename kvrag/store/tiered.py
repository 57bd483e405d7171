"""``TieredStore``: a near store (the local disk) in front of a far one (a shared Redis).

Write-through: ``put`` stores in the near tier, then the far one. Read-through: a near miss
is read from the far tier and promoted to the near one (in a background thread, so the query
that found it does not wait for the disk write). Listing is the union of both, so a replica
finds what other replicas stored. The far tier being unreachable never fails a read or a
write here: the near tier serves or holds the entry (``kvrag.store.redis_store`` warns once per
outage).

Chunks stored while the far tier was unreachable are remembered (their keys, in memory, at
most ``max_unsynced``) and pushed up once it answers again: when the far store reports its
reconnection (``RedisStore.outage.on_recover``), or at the next successful write. The push
runs in a background thread, never in a query's path; a process restarted before it loses
the list (the chunks stay on its disk; other replicas compute them, or a ``kvrag worker``
that has them copies them up).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvrag.checks import check_int
from kvrag.errors import StoreError
from kvrag.store.base import ChunkEntry, ChunkStore

log = logging.getLogger("kvrag.store.tiered")


class TieredStore(ChunkStore):
    """``near`` (durable, local: a ``DiskStore``) in front of ``far`` (shared: a ``RedisStore``).

    max_unsynced: how many chunks stored only locally (far tier unreachable) are remembered
    to be pushed up later; beyond it the oldest are forgotten (they stay local)."""

    def __init__(self, near: ChunkStore, far: ChunkStore, *, max_unsynced: int = 100_000) -> None:
        check_int("max_unsynced", max_unsynced, 0)
        self.near = near
        self.far = far
        self.max_unsynced = max_unsynced
        self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrag-promote")
        self._pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrag-push")
        self._promoting: set[str] = set()
        self._unsynced: OrderedDict[str, str] = OrderedDict()  # key -> fingerprint, oldest first
        self._pushing = False
        self._lock = threading.Lock()
        self._counts = {
            "near_hits": 0,
            "far_hits": 0,
            "misses": 0,
            "promoted": 0,
            "far_write_failures": 0,
            "pushed_after_outage": 0,
            "unsynced_dropped": 0,
            "restored": 0,
        }
        outage = getattr(far, "outage", None)
        if outage is not None and hasattr(outage, "on_recover"):
            outage.on_recover(self._schedule_push)

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
        except Exception as e:  # noqa: BLE001 - a full disk must not fail the query that read the entry
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
            self._remember_unsynced(key, entry.fingerprint)
            log.debug("TieredStore: chunk %s stored locally only: %s", key, e)
            return
        if self._unsynced:
            self._schedule_push()  # the far tier writes again: push what it missed

    # ---- the push-up of chunks stored while the far tier was down ----------------------
    def _remember_unsynced(self, key: str, fingerprint: str) -> None:
        with self._lock:
            self._unsynced[key] = fingerprint
            self._unsynced.move_to_end(key)
            dropped = 0
            while len(self._unsynced) > self.max_unsynced:
                self._unsynced.popitem(last=False)
                dropped += 1
            self._counts["unsynced_dropped"] += dropped
            first_drop = dropped and self._counts["unsynced_dropped"] == dropped
        if first_drop:
            log.warning(
                "TieredStore: more than %d chunks stored only locally while the shared tier is down; "
                "the oldest will not be pushed up to it (said once)",
                self.max_unsynced,
            )

    def _schedule_push(self) -> None:
        with self._lock:
            if self._pushing or not self._unsynced:
                return
            self._pushing = True
        self._pusher.submit(self._push)

    def _push(self) -> None:
        """Copy the remembered chunks from the near tier to the far one, oldest first; stops
        (keeping the rest) if the far tier fails again."""
        pushed = 0
        try:
            while True:
                with self._lock:
                    if not self._unsynced:
                        break
                    key, fp = next(iter(self._unsynced.items()))
                # StoreError (down again): stop, keep the rest.
                pushed += copy_up(self.near, self.far, key, fp) == "pushed"
                with self._lock:
                    if self._unsynced.get(key) == fp:
                        del self._unsynced[key]
        except StoreError as e:
            log.debug("TieredStore: push-up paused, the shared tier failed again: %s", e)
        except Exception as e:  # noqa: BLE001 - a background thread: report, keep the list for the next try
            log.warning("TieredStore: pushing chunks up to the shared tier failed: %s", e)
        finally:
            with self._lock:
                self._pushing = False
                self._counts["pushed_after_outage"] += pushed
            if pushed:
                log.warning(
                    "TieredStore: pushed %d chunk(s) stored locally during the outage up to the shared tier", pushed
                )

    def delete(self, key: str) -> bool:
        near = self.near.delete(key)
        try:
            far = self.far.delete(key)
        except StoreError:
            far = False
        return bool(near or far)

    def ensure_indexed(self, key: str) -> bool:
        return self.near.ensure_indexed(key) or self.far.ensure_indexed(key)

    def ensure_stored(self, key: str, fingerprint: str) -> bool:
        """True if either tier holds ``key``; an entry the near tier has and the far one lacks
        (a flushed or evicted Redis, a value there cut short or foreign: deleted by its
        check) is copied up, read verified, not recomputed -- so re-ingesting through any
        replica that holds the chunks restores the shared tier for every replica."""
        near = self.near.ensure_indexed(key)
        far = self.far.ensure_indexed(key)
        if near and not far:
            return self._restore(key, fingerprint)
        return near or far

    def _restore(self, key: str, fingerprint: str) -> bool:
        """Copy ``key`` up from the near tier; False if the near tier cannot read it back
        (then it is computed again). The far tier down or refusing: remembered for the push-up."""
        outage = getattr(self.far, "outage", None)
        if outage is not None and outage.skip():
            self._remember_unsynced(key, fingerprint)
            return True
        entry = self.near.get(key, fingerprint)
        if entry is None:
            return False
        try:
            self.far.put(key, entry)
        except StoreError as e:
            self._count("far_write_failures")
            self._remember_unsynced(key, fingerprint)
            log.debug("TieredStore: chunk %s not copied up: %s", key, e)
            return True
        self._count("restored")
        return True

    def texts(self, fingerprint: str | None) -> dict[str, str]:
        return {**self.far.texts(fingerprint), **self.near.texts(fingerprint)}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = {**self._counts, "unsynced": len(self._unsynced)}
        return {**self.near.stats(), "tiers": c, "shared": self.far.stats()}

    def flush(self) -> None:
        """Wait for the promotions and the push-up already started (tests, shutdown)."""
        self._promoter.submit(lambda: None).result()
        self._pusher.submit(lambda: None).result()

    def close(self) -> None:
        self._promoter.shutdown(wait=True)
        self._pusher.shutdown(wait=True)
        self.near.close()
        self.far.close()


def push_missing(near: ChunkStore, far: ChunkStore, listed: dict[str, tuple[str, str]]) -> dict[str, int]:
    """Copy each entry of ``listed`` (key -> (text, fingerprint), as ``DiskStore.listed()``) that
    ``far`` lacks from ``near`` to ``far``, read verified: to seed a shared tier from a local
    store, or after an outage that outlived the process that remembered what to push
    (``kvrag cache push``). Counts of pushed, already present and unreadable (a miss in
    ``near``) entries; ``far`` failing (``StoreError``) stops it."""
    counts = {"pushed": 0, "present": 0, "unreadable": 0}
    for key, (_, fingerprint) in listed.items():
        counts[copy_up(near, far, key, fingerprint)] += 1
    return counts


def copy_up(near: ChunkStore, far: ChunkStore, key: str, fingerprint: str) -> str:
    """Copy ``key`` from ``near`` to ``far`` unless ``far`` has it (another replica may have
    stored it: one EXISTS beats re-sending megabytes). "pushed", "present", or "unreadable"
    (a miss in ``near``); ``far.put`` raises ``StoreError`` when it is down."""
    if key in far:
        return "present"
    entry = near.get(key, fingerprint)
    if entry is None:
        return "unreadable"
    far.put(key, entry)
    return "pushed"
