"""The scaling scenario: TTFT at controlled context lengths, ``n`` chunks of exactly ``t`` tokens
(``cfg.scaling``), on synthetic passages."""

from __future__ import annotations

from kvrag.bench.config import REFERENCE
from kvrag.bench.examples import examples_from_items
from kvrag.bench.measure import Measure
from kvrag.qa import synthetic


def run_scaling(m: Measure, rag) -> None:
    """Every run of ``m`` at each (n, t) of ``cfg.scaling``, into ``m.records``."""
    cfg = m.cfg
    m.say(f"[{m.device}] scaling: {', '.join(f'{n}x{t}' for n, t in cfg.scaling)}")
    enc = rag.handle.encode
    dec = lambda ids: rag.tokenizer.decode(ids)  # noqa: E731
    for i, (n, t) in enumerate(cfg.scaling):
        item = synthetic.exact_length_item(n, t, enc, dec, seed=cfg.seed)
        ex = examples_from_items([item], source="scaling")[0]
        m.precompute(rag, ex.passages, "scaling")
        recs = m.time_policies(rag, "scaling", f"{n}x{t}", ex, m.runs, i, cfg.repeats, cfg.max_new_tokens)
        for rec in recs.values():
            rec.update(chunks=n, chunk_tokens=t)
        m.keep(recs)
        m.say(
            f"  {n}x{t} ({recs[REFERENCE].get('prompt_tokens')} tok): "
            + "  ".join(f"{r['label']} {r['ttft_s'] or float('nan'):.2f}s" for r in recs.values())
        )
