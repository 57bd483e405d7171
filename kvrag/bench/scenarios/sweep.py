"""The sweep scenario: quality vs recompute ratio, for the policies that have a
``recompute_ratio`` (``cfg.sweep_policies`` x ``cfg.sweep_ratios``), on one dataset; each
finished example is journaled like the QA scenario's, so a long sweep resumes (``cfg.resume``)."""

from __future__ import annotations

import time

from kvrag.bench.config import REFERENCE, Run
from kvrag.bench.journal import append_to_journal, journal_identity, journal_key, journal_path, open_journal
from kvrag.bench.measure import Measure
from kvrag.qa.example import QAExample


def run_sweep(m: Measure, rag, datasets: dict[str, list[QAExample[str]]], sweep_policies: list[str]) -> None:
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
    # Its own journal beside the QA one's: the sweep's runs are other runs on the same dataset.
    journal = journal_path(cfg.out, m.device, name, "sweep")
    done = open_journal(journal, journal_identity(cfg, m.device, f"sweep/{name}", m.model_info, runs), cfg.resume)
    kept = sum(journal_key(i, ex) in done for i, ex in enumerate(examples))
    m.say(
        f"[{m.device}] sweep on {name}: {len(examples)} examples x {len(runs) - 1} (policy, ratio)"
        + (f" ({kept} kept from {journal})" if kept else "")
    )
    for i, ex in enumerate(examples):
        key = journal_key(i, ex)
        if key in done:
            m.records.extend(done[key])
            continue
        m.precompute(rag, ex.passages, f"sweep/{name}", runs)
        t0 = time.perf_counter()
        recs = m.time_policies(rag, "sweep", name, ex, runs, i, 1, cfg.max_new_tokens)
        m.quality(rag, ex, recs, runs)
        m.keep(recs)
        append_to_journal(journal, key, list(recs.values()))
        m.say(f"  sweep {i + 1}/{len(examples)} ({time.perf_counter() - t0:.0f}s)")
