"""Markdown tables of the benchmark report: the number formats, the per-policy table, the QA
results by question type and the TTFT-floor section."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt(x, spec=".2f", none="–") -> str:
    """``x`` in ``spec``; ``none`` for a value not measured (None, NaN), "inf" for an infinite one."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of ``rows`` under ``headers``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_ms(x) -> str:
    """Seconds ``x`` as whole milliseconds."""
    return fmt(None if x is None else x * 1000, ".0f")


def policy_table(rows: list[dict]) -> str:
    """One line per summary row of ``rows``: timings, quality against gold and full_prefill, cache counts."""
    heads = [
        "policy",
        "n",
        "TTFT ms (median)",
        "spread",
        "speed-up",
        "ms/token",
        "gold F1",
        "gold EM",
        "gold acc",
        "fidelity F1",
        "fidelity EM",
        "gold NLL/tok",
        "ΔNLL",
        "LL gap",
        "top-1",
        "KL",
        "cached",
        "recomputed",
        "kept",
        "recomp. frac",
        "KV read/tok",
        "KV MB loaded",
        "peak MB",
        "errors",
    ]
    body = []
    for r in rows:
        body.append(
            [
                f"`{r['label']}`",
                r["n"],
                fmt_ms(r.get("ttft_s")),
                fmt(r.get("ttft_spread"), ".0%"),
                fmt(r.get("speedup"), ".1f") + "x" if r.get("speedup") else "–",
                fmt_ms(r.get("tpot_s")),
                fmt(r.get("gold_f1")),
                fmt(r.get("gold_em")),
                fmt(r.get("gold_acc")),
                fmt(r.get("fidelity_f1")),
                fmt(r.get("fidelity_em")),
                fmt(r.get("gold_nll"), ".3f"),
                fmt(r.get("gold_nll_delta"), "+.3f"),
                fmt(r.get("gold_ll_rel_gap"), ".1%"),
                fmt(r.get("top1_agreement")),
                fmt(r.get("kl"), ".3f"),
                fmt(r.get("cached_tokens"), ".0f"),
                fmt(r.get("recomputed_tokens"), ".0f"),
                fmt(r.get("kept_tokens"), ".0f"),
                fmt(r.get("recompute_fraction"), ".1%"),
                fmt(r.get("kv_read_fraction"), ".1%"),
                fmt(None if r.get("bytes_loaded") is None else r["bytes_loaded"] / 2**20, ".1f"),
                fmt(r.get("peak_mem_mb"), ".0f"),
                r["errors"],
            ]
        )
    return md_table(heads, body)


def by_type_table(records: list[dict], device: str, dataset: str) -> str:
    """Gold accuracy, gold F1 and fidelity F1 per policy and question type of one QA data set
    (from its records); "" when its examples carry no question type."""
    recs = [
        r
        for r in records
        if r["device"] == device and r["scenario"] == "qa" and r["dataset"] == dataset and not r.get("error")
    ]
    types = list(dict.fromkeys(r["qtype"] for r in recs if r["qtype"]))
    labels = list(dict.fromkeys(r["label"] for r in recs))
    if not types:
        return ""
    heads = ["policy"] + [f"{t}: gold acc / gold F1 / fidelity F1" for t in types]
    body = []
    for lab in labels:
        cells = [f"`{lab}`"]
        for t in types:
            rs = [r for r in recs if r["label"] == lab and r["qtype"] == t]
            a = [r["gold_acc"] for r in rs if r.get("gold_acc") is not None]
            g = sum(r["gold_f1"] for r in rs) / len(rs) if rs else None
            f = [r["fidelity_f1"] for r in rs if r.get("fidelity_f1") is not None]
            cells.append(
                f"{fmt(sum(a) / len(a) if a else None)} / {fmt(g)} / "
                f"{fmt(sum(f) / len(f) if f else None)} (n={len(rs)})"
            )
        body.append(cells)
    return md_table(heads, body)


def floor_section(rows: list[dict]) -> str:
    """The floor scenario's table (``kvrag.bench.floor``)."""
    body = []
    for r in rows:
        if r.get("error") and not r.get("ttft_s"):
            body.append([r["dataset"], f"`{r['label']}`", f"error: {r['error']}"] + [""] * 9)
            continue
        body.append(
            [
                r["dataset"],
                f"`{r['label']}`",
                f"{fmt_ms(r.get('ttft_s'))} ms",
                f"{fmt_ms(r['floor_s'])} ms" if r.get("floor_s") else "–",
                fmt(r.get("ttft_over_floor")),
                fmt_ms(r.get("read_s")) if r.get("floor_s") else "–",
                fmt_ms(r.get("move_s")) if r.get("floor_s") else "–",
                fmt_ms(r.get("forward_s")) if r.get("floor_s") else "–",
                fmt_ms(r.get("recompute_s")) if r.get("floor_s") else "–",
                fmt(r.get("ops_prefill"), ".0f"),
                fmt(r.get("ops_plain"), ".0f"),
                fmt(r.get("ops_decode"), ".0f"),
            ]
        )
    return (
        "### TTFT vs its floor\n\nFloor = chunk lookup and reads from the serving tier + moving them to the "
        "device/dtype + transformers' forward of the non-cached tokens over a prefix cache of the cached length "
        "+ recomputed (token, layer) pairs at full_prefill's rate in this run; TTFT here is the prefill call. "
        "Ops: work-doing aten ops (views excluded) of one fused prefill, of the plain forward, and of one decode "
        "step (`kvrag.bench.ops`). Raw: `floor.csv`.\n\n"
        + md_table(
            [
                "point",
                "policy",
                "TTFT",
                "floor",
                "TTFT / floor",
                "read ms",
                "move ms",
                "forward ms",
                "recompute ms",
                "ops prefill",
                "ops plain fwd",
                "ops decode",
            ],
            body,
        )
        + "\n"
    )
