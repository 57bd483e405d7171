"""Eviction under a skewed retrieval trace: the store's hit rate with today's rule (LRU) against
diskcache's least-frequently-used policy and a TinyLFU admission rule, simulated (no model).

The simulated system is kvrag's as it serves a corpus larger than its store:

- a corpus of ``--corpus-factor`` x C chunks of equal size, ingested in order through the
  store's write path (``DiskStore.put``), into a store that holds C of them (its size limit);
- then a trace of ``--queries`` queries, each retrieving ``--per-query`` distinct chunks drawn
  from Zipf(``--alpha``) popularity (rank r has weight 1 / r^alpha; which chunk has which rank is
  a seeded shuffle, unrelated to ingestion order);
- per query, each chunk is read from the hot tier (``kvrag.store.hot``: an in-process LRU of
  ``--hot`` x C chunks in front of the disk, filled by disk reads only), else from the disk
  store, else it is a miss: the query computes it, and the retriever hook schedules it, so it is
  recomputed and written through the store's write path after the query (the fallback + warm
  hook), where the store's rule decides what it evicts for it, or whether it keeps it at all.

Store rules (the disk's; the hot tier is LRU in every run, as it is in kvrag):

- ``lru``: today's. ``kvrag.store.disk_evict`` evicts diskcache's ``least-recently-used`` row
  (by ``access_time``) after each put; a put and a disk read record the access. A hot-tier hit
  does not reach the disk store, so it records nothing there.
- ``lfu``: diskcache's ``least-frequently-used`` policy as the store would run it: a row's
  ``access_count`` starts at 0 when written and counts disk reads; the row with the least count
  goes first, ties by insertion order (SQLite's index on ``access_count``, then ``rowid``), the
  row just written included. A count dies with its row: an evicted chunk comes back at 0.
- ``tinylfu``: LRU order, plus admission (Einziger et al., TinyLFU, 2017), the very
  ``kvrag.store.admission.FrequencySketch`` ``DiskStore(admission="tinylfu")`` runs: every disk
  read and every put counts the chunk in a count-min sketch (4 rows of counters capped at 15,
  16 x C counters a row, all halved every 30 x C counts so popularity ages; ``--sketch`` changes
  both factors); a chunk written into a full store is kept
  only if its estimated frequency beats the LRU victim's, else it is not stored and the victim
  stays. Until the store is full every write is kept. The sketch outlives eviction: a chunk
  retrieved often is admitted the next time it is written even if it was evicted before.
- ``ideal``: no simulation, the bound: the share of reads that go to the C most popular
  chunks (what a store that always held exactly them would serve).

Reported per rule: the hit rate (hot + disk hits over reads) over the whole trace and over its
second half (steady state), the disk's own hit rate, and the writes per query (misses written).

    .venv/bin/python benchmarks/admission_zipf.py                      # C = 1000, seeds 0-2
    .venv/bin/python benchmarks/admission_zipf.py --capacity 100 --queries 2000 --out /tmp/az
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

from kvrag.store.admission import FrequencySketch

ROOT = Path(__file__).resolve().parent.parent
TARGET_POINTS = 10.0  # the kept rule's hit rate should beat LRU's by this many points


# ---- the disk store's rules ------------------------------------------------------------------
class LRUStore:
    """``capacity`` chunks, the least recently used (written or read) evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, x: int) -> bool:
        return x in self.rows

    def read(self, x: int) -> None:
        self.rows.move_to_end(x)

    def write(self, x: int) -> None:
        self.rows[x] = None
        self.rows.move_to_end(x)
        while len(self.rows) > self.capacity:
            self.rows.popitem(last=False)


class LFUStore:
    """diskcache's least-frequently-used culling: (access_count, rowid) smallest first; the
    count starts at 0 on a write and dies with the row."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count: dict[int, int] = {}
        self.rowid: dict[int, int] = {}
        self.heap: list[tuple[int, int, int]] = []  # (count, rowid, chunk), stale ones skipped
        self.next_rowid = itertools.count()

    def __contains__(self, x: int) -> bool:
        return x in self.count

    def read(self, x: int) -> None:
        self.count[x] += 1
        heapq.heappush(self.heap, (self.count[x], self.rowid[x], x))

    def write(self, x: int) -> None:
        self.count[x], self.rowid[x] = 0, next(self.next_rowid)
        heapq.heappush(self.heap, (0, self.rowid[x], x))
        while len(self.count) > self.capacity:
            c, r, y = heapq.heappop(self.heap)
            if self.count.get(y) == c and self.rowid.get(y) == r:
                del self.count[y], self.rowid[y]


class TinyLFUStore(LRUStore):
    """LRU order; a write into a full store is kept only if the sketch's estimate of the chunk
    beats the LRU victim's (``kvrag.store.admission``, the rule ``DiskStore(admission="tinylfu")``
    runs; ties keep the victim, which is already paid for)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.sketch = FrequencySketch()
        self.refused = 0

    def read(self, x: int) -> None:
        self.sketch.add(str(x))
        super().read(x)

    def write(self, x: int) -> None:
        self.sketch.fit(len(self.rows))  # as the store sizes it: by the entries it holds
        self.sketch.add(str(x))
        if len(self.rows) >= self.capacity and not self.sketch.admits(str(x), [str(next(iter(self.rows)))]):
            self.refused += 1
            return
        super().write(x)


RULES = {"lru": LRUStore, "lfu": LFUStore, "tinylfu": TinyLFUStore}


# ---- the trace -------------------------------------------------------------------------------
SCENARIOS = ("zipf", "shift", "scan")


def zipf_cdf(n: int, alpha: float) -> list[float]:
    weights = [1.0 / (r**alpha) for r in range(1, n + 1)]
    total = sum(weights)
    return list(itertools.accumulate(w / total for w in weights))


def draw(order: list[int], cdf: list[float], queries: int, per_query: int, rng: random.Random) -> list[list[int]]:
    """``queries`` lists of ``per_query`` distinct chunk ids; chunk ``order[r]`` has rank r + 1."""
    n, out = len(order), []
    for _ in range(queries):
        picked: dict[int, None] = {}
        while len(picked) < per_query:
            picked[order[min(bisect.bisect_left(cdf, rng.random()), n - 1)]] = None
        out.append(list(picked))
    return out


def trace(scenario: str, n: int, alpha: float, queries: int, per_query: int, seed: int) -> list[list[int]]:
    """The retrieval trace of ``scenario``: ``zipf``, one popularity throughout; ``shift``, the
    popularity redrawn at the midpoint (the chunks asked for change); ``scan`` is ``zipf``'s
    trace (the one-off writes are ``simulate``'s)."""
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    cdf = zipf_cdf(n, alpha)
    if scenario != "shift":
        return draw(order, cdf, queries, per_query, rng)
    first = draw(order, cdf, queries // 2, per_query, rng)
    rng.shuffle(order)
    return first + draw(order, cdf, queries - queries // 2, per_query, rng)


def ideal(n: int, capacity: int, alpha: float) -> float:
    """Share of reads going to the ``capacity`` most popular chunks (with distinct chunks per
    query the draws are not quite independent; with few per query this is within a hair)."""
    return zipf_cdf(n, alpha)[capacity - 1]


def simulate(rule: str, capacity: int, hot: int, n: int, queries: list[list[int]], scan: int = 0) -> dict:
    """Ingest chunks 0..n-1 in order, then run ``queries``; at the midpoint, ``scan`` new chunks
    (never retrieved) are ingested. Hit rates over the trace and its second half."""
    disk = RULES[rule](capacity)
    tier: OrderedDict[int, None] = OrderedDict()  # the hot tier: LRU of chunks read from disk
    for x in range(n):  # ingestion, in order
        disk.write(x)
    half = len(queries) // 2
    window = range(half, half + max(1, len(queries) // 20))  # right after the midpoint
    hits = [0, 0]
    window_hits = window_reads = 0
    disk_hits = disk_reads = reads = writes = 0
    for qi, q in enumerate(queries):
        if qi == half:
            for x in range(n, n + scan):  # a bulk ingestion of chunks nobody asks for
                disk.write(x)
        missed = []
        in_window = qi in window
        window_reads += len(q) if in_window else 0
        for x in q:
            reads += 1
            if x in tier:
                tier.move_to_end(x)
                hits[qi >= half] += 1
                window_hits += in_window
                continue
            disk_reads += 1
            if x in disk:
                disk.read(x)
                disk_hits += 1
                hits[qi >= half] += 1
                window_hits += in_window
                if hot:
                    tier[x] = None
                    if len(tier) > hot:
                        tier.popitem(last=False)
            else:
                missed.append(x)
        for x in missed:  # the hook recomputes and writes them after the query
            disk.write(x)
            writes += 1
    second = sum(len(q) for q in queries[half:])
    return {
        "hit_rate": sum(hits) / reads,
        "hit_rate_second_half": hits[1] / second,
        "hit_rate_after_midpoint": window_hits / window_reads,
        "disk_hit_rate": disk_hits / disk_reads if disk_reads else 0.0,
        "writes_per_query": writes / len(queries),
        **({"refused": disk.refused} if isinstance(disk, TinyLFUStore) else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacity", type=int, nargs="+", default=[1000, 100, 5000], help="store capacities C, chunks")
    ap.add_argument("--corpus-factor", type=int, default=10, help="corpus size / C (default 10)")
    ap.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    ap.add_argument("--queries", type=int, default=20_000)
    ap.add_argument("--per-query", type=int, default=5, help="distinct chunks a query retrieves (default 5)")
    ap.add_argument("--hot", type=float, nargs="+", default=[0.0, 1 / 32], help="hot tier size / C")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    ap.add_argument(
        "--sketch",
        default=None,
        metavar="WIDTH,PERIOD",
        help="the sketch's counters per row and aging period per store entry (default "
        f"{FrequencySketch.WIDTH_PER_ENTRY},{FrequencySketch.PERIOD_PER_ENTRY}: kvrag's)",
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "admission_zipf"))
    args = ap.parse_args()
    if args.sketch:
        w, period = (int(v) for v in args.sketch.split(","))
        FrequencySketch.WIDTH_PER_ENTRY, FrequencySketch.PERIOD_PER_ENTRY = w, period
    if "lru" not in args.rules:
        ap.error("--rules must include lru (the baseline)")
    t0 = time.perf_counter()
    runs = []
    for scenario in args.scenarios:
        for capacity in args.capacity:
            n = args.corpus_factor * capacity
            for seed in args.seeds:
                queries = trace(scenario, n, args.alpha, args.queries, args.per_query, seed)
                for hot_share in args.hot:
                    hot = int(hot_share * capacity)
                    for rule in args.rules:
                        r = simulate(rule, capacity, hot, n, queries, scan=capacity if scenario == "scan" else 0)
                        key = {"scenario": scenario, "capacity": capacity, "corpus": n, "hot": hot, "seed": seed}
                        runs.append({**key, "rule": rule, **r})
                        print(
                            f"{scenario} C={capacity} hot={hot} seed={seed} {rule:8s} hit {r['hit_rate']:.4f} "
                            f"(2nd half {r['hit_rate_second_half']:.4f}, "
                            f"after mid {r['hit_rate_after_midpoint']:.4f}) disk {r['disk_hit_rate']:.4f} "
                            f"writes/query {r['writes_per_query']:.2f}",
                            flush=True,
                        )
    argv = sys.argv[1:]
    if "--out" in argv:  # where it wrote is not part of what it ran
        del argv[argv.index("--out") : argv.index("--out") + 2]
    meta = {
        "command": " ".join([".venv/bin/python benchmarks/admission_zipf.py", *argv]),
        "alpha": args.alpha,
        "corpus_factor": args.corpus_factor,
        "queries": args.queries,
        "per_query": args.per_query,
        "seeds": args.seeds,
        "hot_shares": args.hot,
        "sketch": {
            "width_per_entry": FrequencySketch.WIDTH_PER_ENTRY,
            "period_per_entry": FrequencySketch.PERIOD_PER_ENTRY,
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    summary = summarize(runs, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n")
    (out / "README.md").write_text(report(meta, summary))
    print(f"wrote {out / 'results.json'} and {out / 'README.md'}")


def summarize(runs: list[dict], args) -> list[dict]:
    """Per (scenario, capacity, hot tier, rule): means over the seeds and the range of the hit
    rate; points over LRU's hit rate (same seed and trace, then averaged); and per (scenario,
    capacity, hot tier) the ``ideal`` bound."""
    rows = []
    keyed = {(r["scenario"], r["capacity"], r["hot"], r["seed"], r["rule"]): r for r in runs}
    for scenario, capacity, hot in dict.fromkeys((r["scenario"], r["capacity"], r["hot"]) for r in runs):
        n = args.corpus_factor * capacity
        lru = [keyed[scenario, capacity, hot, s, "lru"] for s in args.seeds]
        for rule in args.rules:
            got = [keyed[scenario, capacity, hot, s, rule] for s in args.seeds]

            def mean(field, got=got):
                return statistics.fmean(g[field] for g in got)

            def points(field, got=got, lru=lru):
                return 100 * statistics.fmean(g[field] - b[field] for g, b in zip(got, lru))

            rows.append(
                {
                    "scenario": scenario,
                    "capacity": capacity,
                    "corpus": n,
                    "hot": hot,
                    "rule": rule,
                    "hit_rate": mean("hit_rate"),
                    "hit_rate_min": min(g["hit_rate"] for g in got),
                    "hit_rate_max": max(g["hit_rate"] for g in got),
                    "hit_rate_second_half": mean("hit_rate_second_half"),
                    "points_over_lru": points("hit_rate"),
                    "points_over_lru_second_half": points("hit_rate_second_half"),
                    "hit_rate_after_midpoint": mean("hit_rate_after_midpoint"),
                    "points_over_lru_after_midpoint": points("hit_rate_after_midpoint"),
                    "disk_hit_rate": mean("disk_hit_rate"),
                    "writes_per_query": mean("writes_per_query"),
                }
            )
        rows.append(
            {
                "scenario": scenario,
                "capacity": capacity,
                "corpus": n,
                "hot": hot,
                "rule": "ideal",
                "hit_rate": ideal(n, capacity, args.alpha),
            }
        )
    return rows


def report(meta: dict, summary: list[dict]) -> str:
    """README.md: the setup, one table per scenario, and the target judged on the ``zipf``
    scenario (the kept rule, ``tinylfu``, against LRU and against the ``ideal`` bound)."""
    sk = meta["sketch"]
    lines = [
        "# Eviction under a Zipf retrieval trace",
        "",
        "`benchmarks/admission_zipf.py`, a simulation (no model): a store holding C chunks of equal size, a "
        f"corpus of {meta['corpus_factor']} x C chunks ingested in order through the store's write path, then "
        f"{meta['queries']:,} queries of {meta['per_query']} distinct chunks drawn from Zipf({meta['alpha']}) "
        "(ranks a seeded shuffle of the corpus). A read goes to the hot tier (an LRU of `hot tier` chunks filled "
        "by disk reads), then the disk store; a miss is recomputed and written after the query (the fallback + "
        "warm hook). Rules: `lru`, today's disk store (`kvrag.store.disk_evict`); `lfu`, diskcache's "
        "`least-frequently-used` (a row's count starts at 0 when written, least count first, ties oldest first); "
        '`tinylfu`, `DiskStore(admission="tinylfu")` (`kvrag.store.admission`: LRU order, and a write into '
        "a full store kept only if the sketch counts its chunk more often than the LRU victim); `ideal`, the "
        "share of reads that go to the C most popular chunks. Scenarios: `zipf`, one popularity; `shift`, the "
        "popularity redrawn at the midpoint; `scan`, C new chunks nobody asks for ingested at the midpoint.",
        "",
        f"Seeds {', '.join(map(str, meta['seeds']))}; hit rates are means over the seeds (range in brackets); "
        "points over LRU are per seed (same trace) then averaged; `after midpoint` is the first 5% of queries "
        f"after it. Sketch: {sk['width_per_entry']} counters a row and an aging period of "
        f"{sk['period_per_entry']} counts per store entry. Machine: {meta['machine']}; {meta['seconds']} s.",
        "",
        f"Reproduce: `{meta['command']}`.",
    ]
    for scenario in dict.fromkeys(r["scenario"] for r in summary):
        lines += [
            "",
            f"## {scenario}",
            "",
            "| C | hot tier | rule | hit rate [range] | 2nd half | after midpoint | points over LRU: all "
            "(2nd half, after midpoint) | disk hit rate | writes/query |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in summary if r["scenario"] == scenario):
            if r["rule"] == "ideal":
                lines.append(f"| {r['capacity']} | {r['hot']} | ideal (top C) | {r['hit_rate']:.3f} | | | | | |")
                continue
            lines.append(
                f"| {r['capacity']} | {r['hot']} | {r['rule']} | {r['hit_rate']:.3f} "
                f"[{r['hit_rate_min']:.3f}-{r['hit_rate_max']:.3f}] | {r['hit_rate_second_half']:.3f} | "
                f"{r['hit_rate_after_midpoint']:.3f} | {r['points_over_lru']:+.1f} "
                f"({r['points_over_lru_second_half']:+.1f}, {r['points_over_lru_after_midpoint']:+.1f}) | "
                f"{r['disk_hit_rate']:.3f} | {r['writes_per_query']:.2f} |"
            )
    verdict = []
    by = {(r["scenario"], r["capacity"], r["hot"], r["rule"]): r for r in summary}
    for (scenario, capacity, hot, rule), r in by.items():
        if scenario != "zipf" or rule != "tinylfu":
            continue
        lru, best = by[scenario, capacity, hot, "lru"], by[scenario, capacity, hot, "ideal"]
        room = 100 * (best["hit_rate"] - lru["hit_rate"])
        verdict.append(
            f"- C = {capacity}, hot tier {hot}: tinylfu {r['points_over_lru']:+.1f} points over LRU "
            f"({r['points_over_lru_second_half']:+.1f} in the second half); the ideal store is "
            f"{room:+.1f} points over LRU, so tinylfu takes {r['points_over_lru'] / room:.0%} of what any rule "
            "could gain."
        )
    if verdict:
        lines += ["", f"## Target: the kept rule >= LRU + {TARGET_POINTS:.0f} points on `zipf`", "", *verdict]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
