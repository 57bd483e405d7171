"""A thread-safe least-recently-used map sized in bytes, counting its hits and misses: what the
in-memory tiers keep their entries in (the hot tier's chunk entries, ``kvrag.store.hot``; the
prompt prefix cache's, ``kvrag.query.prefix``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from cachetools import LRUCache

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """At most ``budget`` bytes of values (``size(value)`` each); putting one evicts the least
    recently used down to the budget, and a value alone over it is not kept (budget 0: none)."""

    def __init__(self, budget: int, size: Callable[[V], int]) -> None:
        self.budget = budget
        self.size = size
        # cachetools' LRU sized in bytes (getsizeof); it is not thread-safe, hence the lock.
        self._entries: LRUCache[Hashable, V] = LRUCache(maxsize=budget, getsizeof=size)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> V | None:
        """The value of ``key`` (now the most recently used), or None, counted as a hit or a miss."""
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
            return value

    def fits(self, value: V) -> bool:
        return self.size(value) <= self.budget

    def put(self, key: Hashable, value: V) -> V | None:
        """Keep ``value`` and return it; None (nothing kept) when it alone is over the budget."""
        if not self.fits(value):
            return None
        with self._lock:
            self._entries[key] = value
        return value

    def values(self) -> list[V]:
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def stats(self) -> dict:
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": int(self._entries.currsize),
                "budget": self.budget,
                "hits": self.hits,
                "misses": self.misses,
            }

    def __len__(self) -> int:
        return len(self._entries)
