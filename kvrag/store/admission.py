"""Admission for a full store: a chunk written into it is kept only if it is retrieved more often
than the chunk it would evict (TinyLFU: Einziger, Friedman and Manes, 2017).

Why: a store smaller than its corpus sees two kinds of writes, the chunks retrieved again and
again and the one-offs (a chunk retrieved once, a document ingested and never asked about).
Least-recently-used eviction lets every one-off push out the least recently used chunk, however
often that one is read; under a skewed (Zipf) retrieval trace that costs hit rate, and one bulk
ingestion flushes the whole store. TinyLFU keeps a compact, aging count of how often each key was
asked for -- including keys not stored, so a chunk evicted once is admitted when it comes back
often -- and a write into a full store is kept only when its key's count beats the LRU victim's.
Eviction order stays LRU among what is admitted. ``benchmarks/admission_zipf.py`` measures the
rule against LRU (docs/bench/admission_zipf).

What counts as an access: a read that hits, and a write (in kvrag a write of a chunk not stored
means it was ingested or retrieved and missed: the retriever hooks write what they miss). While
the store has room, every write is kept: the rule only decides what a full store gives up.
"""

from __future__ import annotations

import hashlib

#: Admission rules a ``DiskStore`` takes (``DiskStore(admission=...)``): ``"lru"`` keeps every
#: write (the least recently used entries go), ``"tinylfu"`` keeps a write into a full store only
#: if its key was asked for more often than the entries it would evict.
ADMISSION_RULES = ("lru", "tinylfu")


def check_admission(rule: object) -> str:
    if rule not in ADMISSION_RULES:
        raise ValueError(f"admission must be one of {', '.join(ADMISSION_RULES)}, got {rule!r}")
    return str(rule)


# Halves every counter of a row at once (bytes.translate runs in C): the sketch's aging.
_HALVE = bytes(b >> 1 for b in range(256))


class FrequencySketch:
    """Estimated access counts of string keys, in fixed memory: a count-min sketch of ``DEPTH``
    rows of one-byte counters capped at ``CAP`` (4 bits' worth, as TinyLFU's: only "more than
    the victim" matters, and a low cap lets a formerly hot key fall back quickly).

    An estimate is the least of the key's counters, so it never undercounts (until aging).
    Every ``period`` additions all counters are halved: counts become recent popularity, and a
    chunk once hot does not stay admitted for ever. ``fit(capacity)`` sizes both to the number
    of entries the store holds: ``WIDTH_PER_ENTRY`` counters a row per entry (few collisions
    over a corpus ten times the store) and a period of ``PERIOD_PER_ENTRY`` additions per entry
    (long enough to tell a chunk read once per period from one never read again)."""

    DEPTH = 4
    CAP = 15
    WIDTH_PER_ENTRY = 16
    PERIOD_PER_ENTRY = 30
    MIN_WIDTH = 1 << 10

    def __init__(self, capacity: int = 1) -> None:
        self.width = self.MIN_WIDTH
        self.rows = [bytearray(self.width) for _ in range(self.DEPTH)]
        self.period = self.PERIOD_PER_ENTRY
        self.added = 0
        self.fit(capacity)

    def fit(self, capacity: int) -> None:
        """Size the sketch for a store of ``capacity`` entries. It only grows: doubling a row
        by repeating it keeps every estimate an upper bound (a key's slot in the wider row
        holds the count of its slot in the narrower one, since slots are the hash's low bits)."""
        capacity = max(1, int(capacity))
        while self.width < self.WIDTH_PER_ENTRY * capacity:
            self.rows = [row + row for row in self.rows]
            self.width *= 2
        self.period = max(self.period, self.PERIOD_PER_ENTRY * capacity)

    def _slots(self, key: str) -> list[int]:
        h = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")
        lo, hi = h & 0xFFFFFFFF, (h >> 32) | 1
        # Double hashing (Kirsch and Mitzenmacher): row i's slot is lo + i * hi, low bits only.
        return [(lo + i * hi) & (self.width - 1) for i in range(self.DEPTH)]

    def add(self, key: str) -> None:
        """Count one access of ``key``."""
        for row, s in zip(self.rows, self._slots(key)):
            if row[s] < self.CAP:
                row[s] += 1
        self.added += 1
        if self.added >= self.period:
            self.rows = [bytearray(row.translate(_HALVE)) for row in self.rows]
            self.added //= 2

    def estimate(self, key: str) -> int:
        """How often ``key`` was accessed lately (an upper bound before aging)."""
        return min(row[s] for row, s in zip(self.rows, self._slots(key)))

    def admits(self, candidate: str, victims: list[str]) -> bool:
        """Whether a write of ``candidate`` may evict ``victims`` (the entries that must go to make
        room for it, least recently used first): only if it was asked for more often than each.
        A tie keeps the victims, which are already stored: a new key must earn its place."""
        c = self.estimate(candidate)
        return all(c > self.estimate(v) for v in victims)
