"""Keeping a ``DiskStore`` within its size limit: least-recently-used blobs are evicted, one
per transaction, until the blob cache fits (with their text-index entries).

diskcache has no public "evict one LRU item" call (``Cache.cull`` removes ten at a time, and
its own culling on ``set`` may drop the entry being written when the cache is small), so the
store turns diskcache's culling off (``cull_limit=0``) and runs diskcache's own policy query
here, on its connection, inside its transaction. ``lru_victims`` lists, without evicting, what a
write would evict: what the admission rule (``kvrag.store.admission``) weighs a new key against.
"""

from __future__ import annotations

import logging

import diskcache
import diskcache.core

# The disk tier's one logger, whichever of its modules speaks.
log = logging.getLogger("kvrag.store.disk")

#: The blob cache's eviction policy (diskcache's name for it).
EVICTION_POLICY = "least-recently-used"


def evict_to_limit(blobs: diskcache.Cache, index: diskcache.Cache, size_limit: int) -> int:
    """Evict least-recently-used rows of ``blobs``, one per transaction, until it fits
    ``size_limit`` bytes, and their ``index`` entries; returns how many were evicted."""
    # The row goes by its rowid (as in diskcache's own delete), so a row whose key kvrag
    # never writes (pickled) is evicted like any other instead of being looked up by a key
    # it cannot be found by, forever.
    select = diskcache.core.EVICTION_POLICY[EVICTION_POLICY]["cull"].format(fields="rowid, key, raw, filename", now=0)
    evicted = 0
    while blobs.volume() > size_limit:
        with blobs._transact(retry=True) as (sql, cleanup):
            if blobs.volume() <= size_limit:
                break
            rows = sql(select, (1,)).fetchall()
            if not rows:
                break
            rowid, victim, raw, filename = rows[0]
            sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
            cleanup(filename)  # removed (inside the store only) once the delete commits
            if raw and isinstance(victim, str):
                index.delete(victim, retry=True)
        evicted += 1
        log.debug("DiskStore: evicted %s (size limit %d)", victim, size_limit)
    return evicted


def lru_victims(blobs: diskcache.Cache, nbytes: int, size_limit: int) -> list[str]:
    """The keys ``evict_to_limit`` would evict, least recently used first, if ``nbytes`` more
    were written into ``blobs`` (empty when they fit). Rows whose key kvrag never writes are
    counted towards the room they free but not listed."""
    excess = blobs.volume() + nbytes - size_limit
    if excess <= 0:
        return []
    # LIMIT -1: SQLite's "no limit"; the rows are read only as far as they are needed.
    select = diskcache.core.EVICTION_POLICY[EVICTION_POLICY]["cull"].format(fields="key, raw, size", now=0)
    victims = []
    for key, raw, size in blobs._sql(select, (-1,)):
        if raw and isinstance(key, str):
            victims.append(key)
        excess -= size or 0
        if excess <= 0:
            break
    return victims
