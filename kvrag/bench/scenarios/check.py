"""The synthetic generator's answerability check: can the model do the task at all?"""

from __future__ import annotations

from kvrag.bench import metrics as M
from kvrag.bench.config import REFERENCE, STOP
from kvrag.bench.examples import examples_from_items
from kvrag.bench.measure import Measure
from kvrag.qa import synthetic


def run_check(m: Measure, rag) -> None:
    """``full_prefill`` alone on ``check_items`` single-hop items (a seed of their own),
    answered = the gold answer is contained in the answer or matches it exactly, into
    ``m.check``. Untimed; the QA scenario's few single-hop items are too few to tell whether
    the model can do the task at all."""
    cfg = m.cfg
    seed = cfg.seed + 1
    items = synthetic.generate(
        cfg.check_items,
        seed,
        types=("single_hop",),
        n_passages=cfg.synthetic_passages,
        passage_tokens=cfg.synthetic_passage_tokens,
        count_tokens=lambda s: len(rag.handle.encode(s)),
    )
    answered = 0
    for i, ex in enumerate(examples_from_items(items, source="check"), 1):
        out = rag.generate(m.messages(ex, rag), policy=REFERENCE, max_new_tokens=cfg.max_new_tokens, stop=STOP)
        answer = out.text.strip()
        answered += bool(M.best_acc(answer, ex.answers) or M.best_em(answer, ex.answers))
        if i % 8 == 0 or i == len(items):
            m.say(f"  single-hop check {i}/{len(items)}: {answered} answered")
    m.check = {
        "device": m.device,
        "items": len(items),
        "answered": answered,
        "seed": seed,
        "passages": cfg.synthetic_passages,
        "passage_tokens": cfg.synthetic_passage_tokens,
    }
