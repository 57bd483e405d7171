"""The prompt prefix cache, A/B: the same fused prefills with it (``KVRag``'s default) and
without it (``prefix_cache=0``), timed interleaved in one process, beside full prefill.

Each setting's TTFT is the prefill's wall time (chunk reads from disk included, as in
``kvrag bench``'s cold path): per item the median over ``--rounds`` (the order of the two
KVRags alternates each round), then the median over items. The first prefill of a prefix
computes it; the warm-up round takes that, so the timed rounds read it, as every query after
a service's first does. Results: a table on stdout and ``--out`` (JSON, one record per item
and setting, written as it goes).

    .venv/bin/python benchmarks/prefix_cache_ab.py bench_out/yardstick/yardstick.json \\
        --model gemma3-270m --limit 8 --policies auto,naive_reuse,epic --out ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvrag import KVRag
from kvrag.bench.examples import load_examples
from kvrag.layout.prompt import rag_prompt
from kvrag.policies import Policy


def timed(rag: KVRag, prompt, policy: str) -> tuple[float, int]:
    t = time.perf_counter()
    res = rag.prefill(prompt, policy)
    return time.perf_counter() - t, res.stats.prefix_tokens


def pair_of(policy: str) -> str:
    """Which KVRag pair runs ``policy``: the model's default ("auto", maybe LoRA-adapted) or the base model."""
    return "auto" if policy == "auto" else "base"


def name_of(policy: str, pairs: dict) -> str | Policy:
    return pairs["auto"][0].policy if policy == "auto" else policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="a QA file kvrag bench reads (e.g. the yardstick's)")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="auto,naive_reuse", help="comma-separated; auto = the model's default")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    policies = args.policies.split(",")
    examples = load_examples(args.data, limit=args.limit)
    with tempfile.TemporaryDirectory() as store:
        # Naming a policy keeps the base model (a default with a LoRA adapter gets a KVRag of
        # its own, as in kvrag bench); each pair shares one model and one store.
        base_on = KVRag(args.model, cache_dir=store, hot_cache=0, policy="full_prefill")
        pairs = {"base": (base_on, KVRag(base_on.handle, cache_dir=store, hot_cache=0, prefix_cache=0))}
        if "auto" in policies:
            auto_on = KVRag(args.model, cache_dir=store, hot_cache=0)
            auto_off = KVRag(
                auto_on.handle, cache_dir=store, hot_cache=0, prefix_cache=0, policy=auto_on.policy, kvlink_adapter=None
            )
            pairs["auto"] = (auto_on, auto_off)
            print(f"auto = {auto_on.policy!r}", flush=True)
        records = []
        for i, ex in enumerate(examples):
            for on, _ in pairs.values():
                on.precompute(ex.passages)
            prompt = rag_prompt(base_on.tokenizer, ex.passages, ex.question)
            runs = [("full_prefill", "off", pairs["base"][1])]
            runs += [(p, side, r) for p in policies for side, r in zip(("on", "off"), pairs[pair_of(p)])]
            for p, _, r in runs:
                timed(r, prompt, name_of(p, pairs))  # warm-up: the prefix is computed here
            times: dict[tuple[str, str], list[float]] = {(p, s): [] for p, s, _ in runs}
            prefix = {}
            for k in range(args.rounds):
                for p, side, r in runs if k % 2 == 0 else runs[::-1]:
                    t, n = timed(r, prompt, name_of(p, pairs))
                    times[(p, side)].append(t)
                    prefix[(p, side)] = n
            for (p, side), ts in times.items():
                rec = {
                    "item": i,
                    "policy": p,
                    "prefix_cache": side,
                    "ttft_s": statistics.median(ts),
                    "prefix_tokens": prefix[(p, side)],
                }
                records.append(rec)
            args.out.write_text(json.dumps({"model": args.model, "data": args.data, "records": records}, indent=1))
            print(f"item {i + 1}/{len(examples)} done", flush=True)
    full = {r["item"]: r["ttft_s"] for r in records if r["policy"] == "full_prefill"}
    print(f"{'policy':<14} {'prefix':>7} {'ttft ms':>8} {'speed-up':>8}  prefix tokens")
    print(f"{'full_prefill':<14} {'-':>7} {1000 * statistics.median(full.values()):8.0f} {1.0:8.2f}x")
    for p in policies:
        for side in ("off", "on"):
            rs = [r for r in records if r["policy"] == p and r["prefix_cache"] == side]
            ms = 1000 * statistics.median(r["ttft_s"] for r in rs)
            up = statistics.median(full[r["item"]] / r["ttft_s"] for r in rs)
            print(f"{p:<14} {side:>7} {ms:8.0f} {up:8.2f}x  {rs[0]['prefix_tokens']}")


if __name__ == "__main__":
    main()
