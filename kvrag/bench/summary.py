"""Summarizing benchmark records: per device, dataset and policy, medians of the timings and
means of the quality metrics; precompute throughput."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence

from kvrag.bench import metrics as M
from kvrag.bench.config import REFERENCE

log = logging.getLogger("kvrag.bench")

log = logging.getLogger("kvrag.bench")


def median_of(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else None


def mean_of(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


SUMMARY_FIELDS = [
    "device",
    "scenario",
    "dataset",
    "label",
    "policy",
    "recompute_ratio_param",
    "n",
    "errors",
    "prompt_tokens",
    "ttft_s",
    "ttft_spread",
    "speedup",
    "tpot_s",
    "gold_f1",
    "gold_em",
    "gold_acc",
    "fidelity_f1",
    "fidelity_em",
    "gold_nll",
    "gold_nll_delta",
    "gold_ll_rel_gap",
    "top1_agreement",
    "kl",
    "cached_tokens",
    "recomputed_tokens",
    "computed_tokens",
    "kept_tokens",
    "kept_fraction",
    "kv_read_fraction",
    "recompute_fraction",
    "bytes_loaded",
    "peak_mem_mb",
    "peak_mem_delta_mb",
    "gold_f1_ratio",
    "gold_f1_loss_pts",
    "gold_acc_ratio",
    "gold_acc_loss_pts",
    "gold_acc_hits",
]


def summarize(records: list[dict]) -> list[dict]:
    """One row per (device, scenario, dataset, label): medians of TTFT and of the per-example
    TTFT ratio, means of the quality metrics and counters over the examples that ran."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["device"], r["scenario"], r["dataset"], r["label"]), []).append(r)
    rows = []
    for (device, scenario, dataset, label), rs in groups.items():
        ok = [r for r in rs if not r.get("error")]
        spreads = [
            (r["ttft_max"] - r["ttft_min"]) / r["ttft_s"]
            for r in ok
            if r.get("ttft_s") and r.get("ttft_max") is not None
        ]
        row = {
            "device": device,
            "scenario": scenario,
            "dataset": dataset,
            "label": label,
            "policy": rs[0]["policy"],
            "recompute_ratio_param": rs[0].get("recompute_ratio_param"),
            "n": len(rs),
            "errors": len(rs) - len(ok),
            "ttft_s": median_of([r.get("ttft_s") for r in ok]),
            "speedup": median_of([r.get("speedup") for r in ok]),
            "ttft_spread": median_of(spreads),
        }
        for k in (
            "prompt_tokens",
            "tpot_s",
            "gold_f1",
            "gold_em",
            "gold_acc",
            "fidelity_f1",
            "fidelity_em",
            "gold_nll",
            "gold_nll_delta",
            "top1_agreement",
            "kl",
            "cached_tokens",
            "recomputed_tokens",
            "computed_tokens",
            "kept_tokens",
            "kept_fraction",
            "kv_read_fraction",
            "recompute_fraction",
            "bytes_loaded",
        ):
            row[k] = mean_of([r.get(k) for r in ok])
        # Answered items as a count: on a few dozen items a ratio of accuracies hides how few
        # answers it rests on.
        accs = [r["gold_acc"] for r in ok if r.get("gold_acc") is not None]
        row["gold_acc_hits"] = sum(accs) if accs else None
        row["peak_mem_mb"] = max((r.get("peak_mem_mb") or 0.0 for r in ok), default=None)
        row["peak_mem_delta_mb"] = max((r.get("peak_mem_delta_mb") or 0.0 for r in ok), default=None)
        # Relative gap of the *mean* gold log-likelihood to full_prefill's mean on the same examples.
        ids = {r["example_id"] for r in ok if r.get("gold_ll") is not None}
        refs = [
            r
            for r in groups.get((device, scenario, dataset, REFERENCE), [])
            if r["example_id"] in ids and r.get("gold_ll") is not None
        ]
        mine = [
            r["gold_ll"]
            for r in ok
            if r.get("gold_ll") is not None and r["example_id"] in {x["example_id"] for x in refs}
        ]
        row["gold_ll_rel_gap"] = (
            M.relative_gap(mean_of(mine), mean_of([r["gold_ll"] for r in refs])) if mine and refs else None
        )
        # QA score kept, on the examples both ran: ratio to full_prefill's mean and the loss in
        # points (x100), for gold F1 and for gold accuracy (answer contained).
        for metric in ("gold_f1", "gold_acc"):
            ref = {
                r["example_id"]: r[metric]
                for r in groups.get((device, scenario, dataset, REFERENCE), [])
                if r.get(metric) is not None and not r.get("error")
            }
            both = [
                (r[metric], ref[r["example_id"]]) for r in ok if r.get(metric) is not None and r["example_id"] in ref
            ]
            mine_mean, ref_mean = mean_of([a for a, _ in both]), mean_of([b for _, b in both])
            row[f"{metric}_ratio"] = mine_mean / ref_mean if both and ref_mean else None
            row[f"{metric}_loss_pts"] = 100 * (ref_mean - mine_mean) if both else None
        rows.append(row)
    return rows


def throughput(records: list[dict], precompute_log: list[dict]) -> dict:
    """Precompute tokens/s vs plain prefill tokens/s (full_prefill's TTFT on the QA prompts)."""
    out = {}
    devices = {p["device"] for p in precompute_log} | {r["device"] for r in records}
    for d in sorted(devices):
        pre = [p for p in precompute_log if p["device"] == d]
        tok, sec = sum(p["tokens"] for p in pre), sum(p["seconds"] for p in pre)
        fps = [
            r
            for r in records
            if r["device"] == d
            and r["policy"] == REFERENCE
            and r["scenario"] == "qa"
            and r.get("ttft_s")
            and r.get("prompt_tokens")
        ]
        ptok, psec = sum(r["prompt_tokens"] for r in fps), sum(r["ttft_s"] for r in fps)
        out[d] = {
            "precompute_tokens": tok,
            "precompute_s": sec,
            "precompute_tok_per_s": tok / sec if sec else None,
            "prefill_tokens": ptok,
            "prefill_s": psec,
            "prefill_tok_per_s": ptok / psec if psec else None,
        }
        if out[d]["precompute_tok_per_s"] and out[d]["prefill_tok_per_s"]:
            out[d]["ratio"] = out[d]["precompute_tok_per_s"] / out[d]["prefill_tok_per_s"]
    return out
