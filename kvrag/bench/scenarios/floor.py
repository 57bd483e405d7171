"""The floor scenario: at each (n, t) of ``cfg.floor``, each policy's TTFT beside its floor and
op counts, measured by ``kvrag.bench.floor.measure_floor``, into ``floor_records``."""

from __future__ import annotations

from kvrag.bench.examples import examples_from_items
from kvrag.bench.floor import measure_floor
from kvrag.bench.measure import Measure
from kvrag.qa import synthetic


def run_floor(m: Measure, rag) -> None:
    """TTFT beside its floor and op counts at each floor point, into ``m.floor_records``."""
    cfg = m.cfg
    m.say(f"[{m.device}] floor: {', '.join(f'{n}x{t}' for n, t in cfg.floor)}")
    for n, t in cfg.floor:
        item = synthetic.exact_length_item(n, t, rag.handle.encode, rag.tokenizer.decode, seed=cfg.seed)
        ex = examples_from_items([item], source="floor")[0]
        m.precompute(rag, ex.passages, "floor")
        recs = measure_floor(
            lambda run: m.rag_for(run, rag),
            m.messages(ex, rag),
            m.runs,
            cfg.repeats,
            f"{n}x{t}",
            m.device,
            cold=not cfg.hot_cache,
        )
        m.floor_records += recs
        m.say(
            f"  {n}x{t} ({recs[0].get('prompt_tokens')} tok): "
            + "  ".join(
                f"{r['label']} {r.get('ttft_s') or float('nan'):.3f}s"
                + (
                    f" (floor {r['floor_s']:.3f}s, ops {r.get('ops_prefill')}/{r.get('ops_plain')})"
                    if r.get("floor_s")
                    else ""
                )
                for r in recs
            )
        )
