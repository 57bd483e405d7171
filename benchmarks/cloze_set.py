"""A held-out QA set from real text that needs no labels: cloze questions ("which sentence
comes right after ...? Quote it.") over the held-out split (10% by passage hash) of a machine
prose source, for benchmarks/run_heldout.sh. The questions and answers come from
the passages themselves (kvrag.policies.kvlink.data.cloze_items), so any corpus works.

    python benchmarks/cloze_set.py OUT.json [--source pydoc|usr-share-doc|man] [--n 100] [--docs 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    from kvrag.policies.kvlink import data as D

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--source", default="pydoc", choices=("pydoc", "usr-share-doc", "man"))
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--docs", type=int, default=8, help="passages per prompt")
    p.add_argument("--passage-tokens", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    read = {"pydoc": D.pydoc_passages, "usr-share-doc": D.usr_share_doc_passages, "man": D.man_passages}[a.source]
    pool = D.pool_split(read(a.passage_tokens), "eval")
    items = D.cloze_items(pool, a.n, a.seed, docs=a.docs)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(items, f)
    print(f"{len(items)} cloze items over {len(pool)} held-out {a.source} passages -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
