"""The sweep scenario: quality vs recompute ratio, for the policies that have a
``recompute_ratio`` (``cfg.sweep_policies`` x ``cfg.sweep_ratios``), on one dataset."""

from __future__ import annotations

import time

from kvrag.bench.config import REFERENCE, Run
from kvrag.bench.examples import Example
from kvrag.bench.measure import Measure


def run_sweep(m: Measure, rag, datasets: dict[str, list[Example]], sweep_policies: list[str]) -> None:
    """``full_prefill`` and each (policy, ratio) on the first ``cfg.sweep_limit`` examples of
    the sweep's dataset (``cfg.sweep_data``), into ``m.records``."""
    cfg = m.cfg
    name = (
        "synthetic"
        if cfg.sweep_data == "synthetic" and "synthetic" in datasets
        else next((k for k in datasets if k != "synthetic"), None) or next(iter(datasets), None)
    )
    if name is None:
        return
    examples = datasets[name][: cfg.sweep_limit]
    runs = [Run(REFERENCE)] + [
        Run(p, {**cfg.params.get(p, {}), "recompute_ratio": r}) for p in sweep_policies for r in cfg.sweep_ratios
    ]
    m.say(f"[{m.device}] sweep on {name}: {len(examples)} examples x {len(runs) - 1} (policy, ratio)")
    for i, ex in enumerate(examples):
        m.precompute(rag, ex.passages, f"sweep/{name}", runs)
        t0 = time.perf_counter()
        recs = m.time_policies(rag, "sweep", name, ex, runs, i, 1, cfg.max_new_tokens)
        m.quality(rag, ex, recs, runs)
        m.keep(recs)
        m.say(f"  sweep {i + 1}/{len(examples)} ({time.perf_counter() - t0:.0f}s)")
