"""Which cached tokens a recompute policy picks on yardstick items: how many of the tokens of
the two evidence sentences (the intro naming the subject, the fact about it) are among the
recomputed ones. A blind pick of 20% catches ~20% of them.

    python benchmarks/selection_evidence.py N POLICY[:JSON params] ...
    e.g. ... 4 'prophetkv' 'prophetkv:{"score_layers": [5]}' 'cacheblend:{"recompute_ratio": 0.2}'
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def token_span(starts: list[int], text: str, part: str) -> list[int]:
    """Token indices whose first character lies inside ``part``'s first occurrence in ``text``."""
    a = text.find(part)
    if a < 0:
        return []
    b = a + len(part)
    return [k for k, st in enumerate(starts) if a <= st < b]


def main() -> int:
    import yardstick_set as Y

    from kvrag import KVRag
    from kvrag.layout.prompt import rag_prompt
    from kvrag.policies import get_policy

    n, specs = int(sys.argv[1]), sys.argv[2:]
    variants = []
    for spec in specs:
        name, _, params = spec.partition(":")
        variants.append((spec, name, json.loads(params) if params else {}))
    rag = KVRag("gemma3-270m", cache_dir=tempfile.mkdtemp(), hot_cache=0)
    L = rag.fusion.arch.n_layers
    for it in Y.generate(n, 38):
        passages = [c["text"] for c in it["ctxs"]]
        rag.precompute(passages)
        prompt = rag_prompt(rag.tokenizer, passages, it["question"])
        i = it["evidence"][0]
        evidence = [passages[i].rsplit(". ", 1)[-1], passages[i + 1].split(". ", 1)[0]]
        row = []
        for spec, name, params in variants:
            pol = get_policy(name, **params)
            layout = rag._prepare(rag.render(prompt), pol, time.perf_counter()).layout
            res = rag.fusion.prefill(layout, pol, keep_state=True)
            chosen = layout.cached & (res.state.layer_counts == L)
            text, starts = "", []
            for t in layout.token_ids.tolist():
                starts.append(len(text))
                text += rag.tokenizer.decode([t])
            ev = [k for part in evidence for k in token_span(starts, text, part)]
            row.append(f"{spec}: {sum(bool(chosen[k]) for k in ev)}/{len(ev)} (of {int(chosen.sum())} recomputed)")
        print(it["id"], it["type"], "|", " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
