"""The QA scenario: per example, every policy timed in a rotated order, then its teacher-forced
quality; each finished example is journaled so an interrupted run resumes (``cfg.resume``)."""

from __future__ import annotations

import time

from kvrag.bench.config import REFERENCE
from kvrag.bench.journal import append_to_journal, journal_identity, journal_key, journal_path, open_journal
from kvrag.bench.measure import Measure
from kvrag.qa.example import QAExample


def run_qa(m: Measure, rag, dataset: str, examples: list[QAExample[str]]) -> None:
    """Every run of ``m`` on each of ``examples`` (the dataset ``dataset``), into ``m.records``."""
    journal = journal_path(m.cfg.out, m.device, dataset)
    done = open_journal(journal, journal_identity(m.cfg, m.device, dataset, m.model_info, m.runs), m.cfg.resume)
    kept = sum(journal_key(i, ex) in done for i, ex in enumerate(examples))
    m.say(
        f"[{m.device}] qa/{dataset}: {len(examples)} examples x {len(m.runs)} policies"
        + (f" ({kept} kept from {journal})" if kept else "")
    )
    for i, ex in enumerate(examples):
        key = journal_key(i, ex)
        if key in done:
            m.records.extend(done[key])
            continue
        # Each example's chunks just before it runs: the store then needs to hold one
        # example's chunks (all of them at once would outgrow its size limit on a long run,
        # and the LRU would evict the first examples' chunks before they are timed).
        m.precompute(rag, ex.passages, f"qa/{dataset}")
        t0 = time.perf_counter()
        recs = m.time_policies(rag, "qa", dataset, ex, m.runs, i, m.cfg.repeats, m.cfg.max_new_tokens)
        m.quality(rag, ex, recs, m.runs)
        m.keep(recs)
        append_to_journal(journal, key, list(recs.values()))
        fp = recs[REFERENCE]
        m.say(
            f"  {dataset} {i + 1}/{len(examples)} ({fp.get('prompt_tokens')} tok, "
            f"{time.perf_counter() - t0:.0f}s): "
            + "  ".join(f"{r['label']} {r['ttft_s'] or float('nan'):.2f}s" for r in recs.values())
        )
