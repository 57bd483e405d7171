"""Why the sparse-read policies (a2ats, samkv) lose answers on a model: gold log-likelihood
of each setting against full prefill on the first items of a QA file, swept from the paper's
budget to the policy's exact limit, beside two bounds: naive_reuse (every cached row read,
none repaired) and the question without any passage. A defect shows as a setting far worse
than its neighbours or a limit that is not naive_reuse/full prefill; a method limit as a
smooth climb from near "no passages" at the paper's budget to the bound at the limit.

    python benchmarks/sparse_limits.py DATA.json OUT.json [--model gemma3-270m] [--n 12] [--passages 7]

a2ats needs ``kvrag calibrate a2ats --model ...`` first. Prints a table; OUT holds per-item values."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = [
    ("full_prefill", {}),
    ("naive_reuse", {}),
    ("a2ats", {"topk": 0.03}),
    ("a2ats", {"topk": 0.1}),
    ("a2ats", {"topk": 0.3}),
    ("a2ats", {"topk": 1.0}),
    ("samkv", {}),
    ("samkv", {"keep_ratio": 0.3, "recompute_ratio": 0.143}),
    ("samkv", {"keep_ratio": 0.6, "recompute_ratio": 0.143}),
    ("samkv", {"keep_ratio": 1.0, "recompute_ratio": 0.143}),
    # Every token kept (no Top-P below the budget): what is left is its recompute and fusion.
    ("samkv", {"keep_ratio": 1.0, "recompute_ratio": 0.143, "adaptive_p": False}),
    ("samkv", {"keep_ratio": 1.0, "recompute_ratio": 0.143, "adaptive_p": False, "update": "overwrite"}),
    ("cacheblend", {"recompute_ratio": 0.143}),
]


def label(policy: str, params: dict) -> str:
    return policy + "".join(f" {k}={v}" for k, v in params.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--n", type=int, default=12)
    p.add_argument("--passages", type=int, default=7)
    a = p.parse_args()

    from kvrag.bench.examples import load_examples
    from kvrag.bench.metrics import mean_logprob
    from kvrag.engine import KVRag
    from kvrag.layout.prompt import rag_prompt

    items = load_examples(a.data, limit=a.n, passages=a.passages)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvrag-sparse-") as kv:
        rag = KVRag(a.model, cache_dir=kv, policy="full_prefill", ingest_policies=["a2ats", "samkv"])
        for i, ex in enumerate(items):
            docs = ex.passages
            rag.precompute(docs)
            gold = rag.handle.encode(ex.answers[0])
            row = {"id": ex.id}
            bare = rag_prompt(rag.tokenizer, [], ex.question)
            outs, _ = rag.continuations_logits(bare, [gold], policy="full_prefill")
            row["no passages"] = mean_logprob(outs[0], gold)
            prompt = rag_prompt(rag.tokenizer, docs, ex.question)
            for pol, prm in SETTINGS:
                outs, _ = rag.continuations_logits(prompt, [gold], policy=pol, **prm)
                row[label(pol, prm)] = mean_logprob(outs[0], gold)
            rows.append(row)
            print(f"item {i + 1}/{len(items)}", flush=True)
    keys = [k for k in rows[0] if k != "id"]
    ref = sum(r["full_prefill"] for r in rows) / len(rows)
    print(f"\n{len(rows)} items, mean gold log-likelihood and gap to full prefill's ({ref:.3f})")
    for k in keys:
        m = sum(r[k] for r in rows) / len(rows)
        print(f"  {k:<42} {m:8.3f}  {abs(m - ref) / abs(ref):7.1%}")
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"model": a.model, "data": a.data, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
