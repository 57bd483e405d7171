"""Benchmark outputs: results.json, CSV files, PNG plots (matplotlib, Agg) and the markdown
report (``docs/benchmarks.md`` for the default run), with the targets marked PASS/FAIL.

Targets are *reported*, never asserted: a FAIL is a finding, not a crash.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from kvrag.bench.config import REFERENCE
from kvrag.bench.summary import SUMMARY_FIELDS

# (policy label, what, threshold) at ~6k tokens: the QA data set (MuSiQue, 10 passages).
TARGETS_6K = [
    ("cacheblend", "speedup", 5.0),
    ("cacheblend", "fidelity_f1", 0.8),
    ("cacheblend", "gold_ll_rel_gap", 0.05),
    ("a3", "speedup", 5.0),
    ("a3", "fidelity_f1", 0.8),
    ("a3", "gold_ll_rel_gap", 0.05),
    ("naive_reuse", "speedup", 20.0),
]
# At ~4k tokens (8 chunks of 512 tokens).
TARGETS_4K = [("naive_reuse", "speedup", 15.0), ("cacheblend", "speedup", 4.0)]
# On the QA set the model can answer (synthetic; else the data set): QA score kept at
# 15% recompute (a3, cacheblend), SamKV's kept share and QA loss, A2ATS' KV read per token.
# The QA score is gold accuracy (answer contained): SmolLM2 answers in sentences, which gold
# F1 against one-word answers scores alike whether right or wrong (gold F1 is reported too).
TARGETS_QA = [
    ("a3", "gold_acc_ratio", 0.9),
    ("cacheblend", "gold_acc_ratio", 0.9),
    ("samkv", "kept_fraction", 0.2),
    ("samkv", "gold_acc_loss_pts", 5.0),
    ("a2ats", "kv_read_fraction", 0.25),
]
TARGETS_4K_QA = [("a3", "speedup", 4.0)]
# The QA and speed targets hold at one point ("keep >= 90% ... while >= 4x faster at
# ~4k context tokens"): when the QA set's prompts are that long (synthetic items of ~4k tokens,
# e.g. benchmarks/run_qa_4k.sh), the speed-ups on those very prompts are judged too.
TARGETS_QA_SPEED = [("a3", "speedup", 4.0), ("cacheblend", "speedup", 4.0)]
QA_SPEED_MIN_TOKENS = 3500
# "Visibly worse": naive_reuse's fidelity F1 at least this much below cacheblend's.
VISIBLY_WORSE = 0.1

_DESCR = {
    "speedup": ("TTFT speed-up vs full_prefill", ">="),
    "fidelity_f1": ("fidelity F1 vs full_prefill", ">="),
    "gold_ll_rel_gap": ("gold log-likelihood gap to full_prefill", "<="),
    "gold_f1_ratio": ("gold F1 relative to full_prefill's", ">="),
    "gold_f1_loss_pts": ("gold F1 loss vs full_prefill (points)", "<="),
    "gold_acc_ratio": ("gold accuracy relative to full_prefill's", ">="),
    "gold_acc_loss_pts": ("gold accuracy loss vs full_prefill (points)", "<="),
    "kept_fraction": ("share of prompt KV kept", "<="),
    "kv_read_fraction": ("share of KV read per decoded token", "<="),
}


def _fmt(x, spec=".2f", none="–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def _row(summary, device, scenario, dataset, label):
    for r in summary:
        if (r["device"], r["scenario"], r["dataset"], r["label"]) == (device, scenario, dataset, label):
            return r
    return None


def qa_datasets(summary, device) -> list[str]:
    seen = []
    for r in summary:
        if r["device"] == device and r["scenario"] == "qa" and r["dataset"] not in seen:
            seen.append(r["dataset"])
    return seen


def evaluate_targets(result: dict) -> list[dict]:
    """The project's targets against this run: one dict per target with measured value and PASS/FAIL.

    The ~6k targets read the first non-synthetic QA data set (MuSiQue), falling back to the
    largest scaling point; the ~4k ones the 8x512 scaling point."""
    summary = result["summary"]
    devices = result["meta"]["config"]["devices"]
    device = "cpu" if "cpu" in devices else devices[0]
    out = []
    data = [d for d in qa_datasets(summary, device) if d != "synthetic"]
    scen6: str | None
    ds6: str | None
    if data:
        scen6, ds6 = "qa", data[0]
    else:
        pts = sorted(
            {r["dataset"] for r in summary if r["scenario"] == "scaling" and r["device"] == device},
            key=lambda s: math.prod(int(v) for v in s.split("x")),
        )
        scen6, ds6 = ("scaling", pts[-1]) if pts else (None, None)

    def add(scen, ds, label, what, thr, where):
        row = _row(summary, device, scen, ds, label) if scen else None
        val = row.get(what) if row else None
        op = _DESCR[what][1]
        ok = None if val is None else (val >= thr if op == ">=" else val <= thr)
        detail = None
        if what.startswith("gold_acc") and row and row.get("gold_acc_hits") is not None:
            ref = _row(summary, device, scen, ds, REFERENCE)
            if ref and ref.get("gold_acc_hits") is not None:
                detail = (
                    f"{row['gold_acc_hits']:.0f}/{row['n']} answered vs "
                    f"{ref['gold_acc_hits']:.0f}/{ref['n']} by {REFERENCE}"
                )
        out.append(
            {
                "where": where,
                "policy": label,
                "metric": _DESCR[what][0],
                "target": f"{op} {thr:g}",
                "measured": val,
                "detail": detail,
                "prompt_tokens": row.get("prompt_tokens") if row else None,
                "status": "n/a" if ok is None else ("PASS" if ok else "FAIL"),
            }
        )

    where6 = f"~6k tokens ({scen6}/{ds6})" if ds6 else "~6k tokens (not run)"
    tok6 = (_row(summary, device, scen6, ds6, REFERENCE) or {}).get("prompt_tokens") if scen6 else None
    if tok6 and tok6 < 4000:  # e.g. --quick: the target's name must not claim a length not run
        where6 = f"~6k-token targets, run at {tok6:.0f} tokens ({scen6}/{ds6})"
    for label, what, thr in TARGETS_6K:
        add(scen6, ds6, label, what, thr, where6)
    naive = _row(summary, device, scen6, ds6, "naive_reuse") if scen6 else None
    blend = _row(summary, device, scen6, ds6, "cacheblend") if scen6 else None
    nf, bf = (naive or {}).get("fidelity_f1"), (blend or {}).get("fidelity_f1")
    ok = None if nf is None or bf is None else nf <= bf - VISIBLY_WORSE
    out.append(
        {
            "where": where6,
            "policy": "naive_reuse",
            "metric": "fidelity F1 visibly worse than cacheblend",
            "target": f"<= cacheblend - {VISIBLY_WORSE:g} ({_fmt(bf)})"
            if bf is not None
            else f"<= cacheblend - {VISIBLY_WORSE:g}",
            "measured": nf,
            "prompt_tokens": (naive or {}).get("prompt_tokens"),
            "status": "n/a" if ok is None else ("PASS" if ok else "FAIL"),
        }
    )
    qa_sets = qa_datasets(summary, device)
    ds_qa = "synthetic" if "synthetic" in qa_sets else (qa_sets[0] if qa_sets else None)
    for label, what, thr in TARGETS_QA:
        add("qa" if ds_qa else None, ds_qa, label, what, thr, f"QA ({ds_qa}), defaults" if ds_qa else "QA (not run)")
    tok_qa = (_row(summary, device, "qa", ds_qa, REFERENCE) or {}).get("prompt_tokens") if ds_qa else None
    if tok_qa and tok_qa >= QA_SPEED_MIN_TOKENS:
        for label, what, thr in TARGETS_QA_SPEED:
            add("qa", ds_qa, label, what, thr, f"QA ({ds_qa}), defaults")
    has4k = _row(summary, device, "scaling", "8x512", REFERENCE) is not None
    for label, what, thr in TARGETS_4K + TARGETS_4K_QA:
        add(
            "scaling" if has4k else None,
            "8x512",
            label,
            what,
            thr,
            "~4k tokens (8 chunks x 512)" if has4k else "~4k tokens (8x512 not run)",
        )
    return out


# ---- files ---------------------------------------------------------------------------------
def _scalar(v):
    return v if v is None or isinstance(v, (int, float, str, bool)) else json.dumps(v)


def write_csv(path: Path, rows: Sequence[dict], fields: Sequence[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _scalar(r.get(k)) for k in fields})


RECORD_CSV_FIELDS = [
    "device",
    "scenario",
    "dataset",
    "example_id",
    "qtype",
    "label",
    "policy",
    "recompute_ratio_param",
    "error",
    "prompt_tokens",
    "ttft_s",
    "ttft_min",
    "ttft_max",
    "speedup",
    "tpot_s",
    "new_tokens",
    "answer",
    "gold_f1",
    "gold_em",
    "gold_acc",
    "fidelity_f1",
    "fidelity_em",
    "gold_ll",
    "gold_nll",
    "gold_nll_delta",
    "top1_agreement",
    "kl",
    "cached_tokens",
    "recomputed_tokens",
    "computed_tokens",
    "kept_tokens",
    "inserted_tokens",
    "recompute_fraction",
    "bytes_loaded",
    "chunks_hit",
    "chunks_missed",
    "peak_mem_mb",
    "peak_mem_delta_mb",
]


def plot_scaling(summary, device, path: Path) -> bool:
    rows = [r for r in summary if r["device"] == device and r["scenario"] == "scaling" and r.get("ttft_s")]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["label"] for r in rows):
        pts = sorted((r["prompt_tokens"], r["ttft_s"]) for r in rows if r["label"] == label and r.get("prompt_tokens"))
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                linewidth=2.5 if label == REFERENCE else 1.5,
                label=label,
            )
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("median TTFT (s)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT vs context length ({device})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_sweep(summary, device, path: Path) -> bool:
    rows = [r for r in summary if r["device"] == device and r["scenario"] == "sweep"]
    swept = [r for r in rows if r.get("recompute_ratio_param") is not None]
    if not swept:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next((r for r in rows if r["label"] == REFERENCE), None)
    panels = [
        ("fidelity_f1", "fidelity F1 vs full_prefill"),
        ("gold_f1", "gold F1"),
        ("gold_nll_delta", "gold NLL/token - full_prefill's"),
        ("top1_agreement", "top-1 agreement (16 pos.)"),
        ("kl", "KL(full || policy), nats"),
        ("speedup", "TTFT speed-up"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        for pol in dict.fromkeys(r["policy"] for r in swept):
            pts = sorted(
                (r["recompute_ratio_param"] * 100, r.get(key))
                for r in swept
                if r["policy"] == pol and r.get(key) is not None
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
        if ref is not None and ref.get(key) is not None:
            ax.axhline(ref[key], color="black", linestyle="--", linewidth=1, label=REFERENCE)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("recompute ratio (%)")
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Quality vs recompute ratio ({device}, {rows[0]['dataset']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_qa(summary, device, dataset, path: Path) -> bool:
    rows = [
        r
        for r in summary
        if r["device"] == device
        and r["scenario"] == "qa"
        and r["dataset"] == dataset
        and r.get("speedup")
        and r.get("fidelity_f1") is not None
    ]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    # A legend, not text beside each point: fast policies crowd the same corner (kvlink, a2ats
    # and naive_reuse land within a few pixels), where annotations overprint each other.
    markers = "osD^vPX*<>h"
    for i, r in enumerate(rows):
        ax.scatter(
            r["speedup"],
            r["fidelity_f1"],
            s=45,
            marker=markers[i % len(markers)],
            color=plt.cm.tab10(i % 10),
            label=r["label"],
            zorder=3,
        )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT speed-up vs full_prefill (median per-example ratio)")
    ax.set_ylabel("fidelity F1 vs full_prefill")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"Speed vs fidelity: {dataset} ({device})")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(result: dict, out: Path) -> dict:
    """results.json (records), summary.json/.csv, records.csv, scaling.csv, sweep.csv, plots.
    Returns {name: path} of what was written."""
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    p = out / "results.json"
    p.write_text(json.dumps(result["records"], indent=1, default=str), encoding="utf-8")
    files["results"] = p
    result["targets"] = evaluate_targets(result)
    side = {
        k: result.get(k)
        for k in ("meta", "summary", "targets", "precompute", "footprint", "throughput", "single_hop_check")
    }
    p = out / "summary.json"
    p.write_text(json.dumps(side, indent=1, default=str), encoding="utf-8")
    files["summary_json"] = p
    write_csv(out / "summary.csv", result["summary"], SUMMARY_FIELDS)
    files["summary_csv"] = out / "summary.csv"
    write_csv(out / "records.csv", result["records"], RECORD_CSV_FIELDS)
    files["records_csv"] = out / "records.csv"
    for scen in ("scaling", "sweep"):
        rows = [r for r in result["summary"] if r["scenario"] == scen]
        if rows:
            write_csv(out / f"{scen}.csv", rows, SUMMARY_FIELDS)
            files[f"{scen}_csv"] = out / f"{scen}.csv"
    if result.get("floor"):
        from kvrag.bench.floor import FLOOR_FIELDS

        write_csv(out / "floor.csv", result["floor"], FLOOR_FIELDS)
        files["floor_csv"] = out / "floor.csv"
    devices = result["meta"]["config"]["devices"]
    for d in devices:
        tag = d.replace(":", "")
        if plot_scaling(result["summary"], d, out / f"ttft_vs_context_{tag}.png"):
            files[f"plot_scaling_{tag}"] = out / f"ttft_vs_context_{tag}.png"
        if plot_sweep(result["summary"], d, out / f"quality_vs_ratio_{tag}.png"):
            files[f"plot_sweep_{tag}"] = out / f"quality_vs_ratio_{tag}.png"
        for ds in qa_datasets(result["summary"], d):
            name = f"speed_vs_fidelity_{ds}_{tag}.png"
            if plot_qa(result["summary"], d, ds, out / name):
                files[f"plot_qa_{ds}_{tag}"] = out / name
    return files


# ---- markdown ------------------------------------------------------------------------------
def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ms(x) -> str:
    return _fmt(None if x is None else x * 1000, ".0f")


def _policy_table(rows: list[dict]) -> str:
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
                _ms(r.get("ttft_s")),
                _fmt(r.get("ttft_spread"), ".0%"),
                _fmt(r.get("speedup"), ".1f") + "x" if r.get("speedup") else "–",
                _ms(r.get("tpot_s")),
                _fmt(r.get("gold_f1")),
                _fmt(r.get("gold_em")),
                _fmt(r.get("gold_acc")),
                _fmt(r.get("fidelity_f1")),
                _fmt(r.get("fidelity_em")),
                _fmt(r.get("gold_nll"), ".3f"),
                _fmt(r.get("gold_nll_delta"), "+.3f"),
                _fmt(r.get("gold_ll_rel_gap"), ".1%"),
                _fmt(r.get("top1_agreement")),
                _fmt(r.get("kl"), ".3f"),
                _fmt(r.get("cached_tokens"), ".0f"),
                _fmt(r.get("recomputed_tokens"), ".0f"),
                _fmt(r.get("kept_tokens"), ".0f"),
                _fmt(r.get("recompute_fraction"), ".1%"),
                _fmt(r.get("kv_read_fraction"), ".1%"),
                _fmt(None if r.get("bytes_loaded") is None else r["bytes_loaded"] / 2**20, ".1f"),
                _fmt(r.get("peak_mem_mb"), ".0f"),
                r["errors"],
            ]
        )
    return _table(heads, body)


def _by_type(records: list[dict], device: str, dataset: str) -> str:
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
                f"{_fmt(sum(a) / len(a) if a else None)} / {_fmt(g)} / "
                f"{_fmt(sum(f) / len(f) if f else None)} (n={len(rs)})"
            )
        body.append(cells)
    return _table(heads, body)


def _floor_section(rows: list[dict]) -> str:
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
                f"{_ms(r.get('ttft_s'))} ms",
                f"{_ms(r['floor_s'])} ms" if r.get("floor_s") else "–",
                _fmt(r.get("ttft_over_floor")),
                _ms(r.get("read_s")) if r.get("floor_s") else "–",
                _ms(r.get("move_s")) if r.get("floor_s") else "–",
                _ms(r.get("forward_s")) if r.get("floor_s") else "–",
                _ms(r.get("recompute_s")) if r.get("floor_s") else "–",
                _fmt(r.get("ops_prefill"), ".0f"),
                _fmt(r.get("ops_plain"), ".0f"),
                _fmt(r.get("ops_decode"), ".0f"),
            ]
        )
    return (
        "### TTFT vs its floor\n\nFloor = chunk lookup and reads from the serving tier + moving them to the "
        "device/dtype + transformers' forward of the non-cached tokens over a prefix cache of the cached length "
        "+ recomputed (token, layer) pairs at full_prefill's rate in this run; TTFT here is the prefill call. "
        "Ops: work-doing aten ops (views excluded) of one fused prefill, of the plain forward, and of one decode "
        "step (`kvrag.bench.ops`). Raw: `floor.csv`.\n\n"
        + _table(
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


def render_markdown(result: dict, files: dict, report_path: Path, assets: Path) -> str:
    meta, summary, records = result["meta"], result["summary"], result["records"]
    m, cfg = meta["machine"], meta["config"]
    rel = lambda p: os.path.relpath(assets / Path(p).name, report_path.parent)  # noqa: E731
    L = []
    L.append("# kvrag benchmarks\n")
    L.append("*Written by `kvrag bench`; rerun the command below to regenerate this page, its plots and CSVs.*\n")
    L.append("## How this was run\n")
    L.append("```\n" + meta["command"] + "\n```\n")
    L.append(
        f"- started {meta['started']}, wall time **{meta['wall_s'] / 60:.1f} min**"
        f" (git commit `{(meta.get('git_commit') or 'unknown')[:12]}`)"
    )
    L.append(
        f"- machine: {m['cpu']}, {m['cores']} cores available, torch threads {m['torch_threads']}, "
        f"{m.get('memory_gib')} GiB RAM; {m['platform']}; Python {m['python']}, torch {m['torch']}, "
        f"transformers {m['transformers']}" + (f"; GPU {m['gpu']}" if m.get("gpu") else "")
    )
    mi = meta.get("model", {})
    L.append(
        f"- model: {mi.get('name')} (fingerprint `{mi.get('fingerprint')}`, {mi.get('layers')} layers, "
        f"{mi.get('kv_heads')} KV heads), compute {mi.get('dtype')}, KV stored as {mi.get('storage_dtype')}"
    )
    L.append(
        f"- devices: {', '.join(cfg['devices'])}; greedy decoding, at most {cfg['max_new_tokens']} new tokens, "
        f"stop at newline; TTFT repeats per example: {cfg['repeats']} (rotated policy order, after one untimed "
        "warm-up run of every policy)"
    )
    anchor = mi.get("chunk_anchor")
    behind = (
        f"behind the anchor token(s) {anchor} (the model's attention sink, dropped after)"
        if anchor
        else "alone from position 0 (no anchor)"
    )
    L.append(
        "- prompt: the model's chat template, system = fixed instruction, user = passages + question "
        "(`kvrag.layout.prompt.rag_prompt`; the same as plain text for a model without a chat template); "
        f"each passage precomputed as one chunk, {behind}, before timing\n"
    )
    ad = mi.get("kvlink_adapter")
    if ad:
        L.append(
            f"- `kvlink` runs **trained** with the KVLink adapter `{ad.get('path')}` ({ad.get('link_tokens')} link "
            f"tokens, {ad.get('steps')} training steps, "
            + (
                "LoRA weights: a model of its own with its own chunk caches; the reference and every other "
                "policy run on the base model"
                if ad.get("lora")
                else "link embeddings only, base weights"
            )
            + "); `kvlink(mode=untrained)` beside it is the same policy without the adapter\n"
        )
    for err in meta.get("errors", []):
        L.append(f"- **scenario failed**: {err}")

    L.append("## Targets\n")
    target_rows = [
        [
            t["where"],
            f"`{t['policy']}`",
            t["metric"],
            t["target"],
            # 3 significant digits: a value just inside a threshold must not print as on it
            (_fmt(t["measured"], ".1%") if "gap" in t["metric"] else _fmt(t["measured"], ".3g"))
            + (f" ({t['detail']})" if t.get("detail") else ""),
            _fmt(t.get("prompt_tokens"), ".0f"),
            f"**{t['status']}**",
        ]
        for t in result["targets"]
    ]
    L.append(_table(["where", "policy", "metric", "target", "measured", "prompt tokens", "status"], target_rows))
    L.append(
        "\nSpeed-ups are the median over examples of full_prefill's TTFT divided by the policy's, both "
        'measured on the same prompt in the same run. "LL gap" is |mean gold log-likelihood per token − '
        "full_prefill's| / |full_prefill's|. Targets are stated for 2 CPU cores; "
        f"this run had {m['cores']} cores.\n"
    )

    for device in cfg["devices"]:
        tag = device.replace(":", "")
        L.append(f"## Results on {device}\n")
        for ds in qa_datasets(summary, device):
            rows = [r for r in summary if r["device"] == device and r["scenario"] == "qa" and r["dataset"] == ds]
            L.append(
                f"### QA: {ds} ({rows[0]['n']} examples, ~{_fmt(rows[0].get('prompt_tokens'), '.0f')} prompt tokens)\n"
            )
            L.append(_policy_table(rows) + "\n")
            bt = _by_type(records, device, ds)
            if bt:
                L.append(
                    "By question type (cross_passage needs a passage's subject named in *another* passage, "
                    "the case reuse loses):\n"
                )
                L.append(bt + "\n")
                single_hop = [
                    r
                    for r in records
                    if r["device"] == device
                    and r["dataset"] == ds
                    and r["scenario"] == "qa"
                    and r["policy"] == REFERENCE
                    and r["qtype"] == "single_hop"
                    and not r.get("error")
                ]
                if single_hop:
                    ok = sum(r.get("gold_acc") == 1.0 or r["gold_em"] == 1.0 for r in single_hop)
                    L.append(
                        f"`full_prefill` answers **{ok}/{len(single_hop)}** of these single-hop items "
                        "(gold answer contained in its answer).\n"
                    )
                chk = result.get("single_hop_check") or {}
                if ds == "synthetic" and chk.get("device") == device and chk.get("items"):
                    L.append(
                        f"Check of the generator: `full_prefill` answers **{chk['answered']}/{chk['items']}** "
                        f"({chk['answered'] / chk['items']:.0%}) single-hop items of their own seed "
                        f"({chk['seed']}; {chk['passages']} passages x {chk['passage_tokens']} tokens, gold answer "
                        "contained in its answer).\n"
                    )
            key = f"plot_qa_{ds}_{tag}"
            if key in files:
                L.append(f"![speed vs fidelity, {ds}]({rel(files[key])})\n")
        sc = [r for r in summary if r["device"] == device and r["scenario"] == "scaling"]
        if sc:
            L.append("### TTFT vs context length\n")
            L.append("Synthetic passages of exactly the stated token length (tokenized alone), one question.\n")
            pts = list(dict.fromkeys(r["dataset"] for r in sc))
            labels = list(dict.fromkeys(r["label"] for r in sc))
            heads = ["policy"] + [
                f"{p} ({_fmt(_row(summary, device, 'scaling', p, REFERENCE)['prompt_tokens'], '.0f')} tok)"
                if _row(summary, device, "scaling", p, REFERENCE)
                else p
                for p in pts
            ]
            body = []
            for lab in labels:
                cells = [f"`{lab}`"]
                for p in pts:
                    r = _row(summary, device, "scaling", p, lab)
                    cells.append(
                        "–"
                        if not r or not r.get("ttft_s")
                        else f"{_ms(r['ttft_s'])} ms ({_fmt(r.get('speedup'), '.1f')}x)"
                    )
                body.append(cells)
            L.append(_table(heads, body) + "\n")
            if f"plot_scaling_{tag}" in files:
                L.append(f"![TTFT vs context length]({rel(files[f'plot_scaling_{tag}'])})\n")
        fl = [r for r in result.get("floor") or [] if r["device"] == device]
        if fl:
            L.append(_floor_section(fl))
        sw = [r for r in summary if r["device"] == device and r["scenario"] == "sweep"]
        if sw:
            L.append(f"### Quality vs recompute ratio ({sw[0]['dataset']}, {sw[0]['n']} examples)\n")
            L.append(_policy_table(sw) + "\n")
            if f"plot_sweep_{tag}" in files:
                L.append(f"![quality vs recompute ratio]({rel(files[f'plot_sweep_{tag}'])})\n")

    L.append("## Precompute throughput and KV footprint\n")
    for d, t in result.get("throughput", {}).items():
        L.append(
            f"- {d}: precompute {_fmt(t.get('precompute_tok_per_s'), '.0f')} tokens/s "
            f"({t['precompute_tokens']} tokens in {t['precompute_s']:.1f} s, chunks packed, ingest extras "
            f"included) vs plain prefill {_fmt(t.get('prefill_tok_per_s'), '.0f')} tokens/s "
            f"(full_prefill TTFT on the QA prompts): ratio {_fmt(t.get('ratio'))}"
        )
    fp = result.get("footprint") or {}
    if fp:
        L.append(
            f"\nKV on disk per 1k tokens (measured on {fp['tokens']} tokens of passages; bound = "
            f"2 × {fp['layers']} layers × {fp['kv_heads']} KV heads × {fp['head_dim']} dims × bytes × 1000):\n"
        )
        footprint_rows = [
            [
                dt,
                f"{fp[dt]['bytes_per_1k'] / 2**20:.2f} MiB",
                f"{fp[dt]['blob_bytes_per_1k'] / 2**20:.2f} MiB",
                f"{fp[dt]['bound_per_1k'] / 2**20:.2f} MiB",
                f"{fp[dt]['ratio']:.3f}",
            ]
            for dt in ("float32", "float16")
            if dt in fp
        ]
        L.append(
            _table(
                [
                    "storage dtype",
                    "directory bytes / 1k tok",
                    "blob bytes / 1k tok",
                    "bound / 1k tok",
                    "measured / bound",
                ],
                footprint_rows,
            )
            + "\n"
        )

    L.append("## Metrics\n")
    L.append(
        "- **TTFT**: from the `generate` call to the first sampled token (segmentation, cache loads, fused "
        "prefill); median over repeats, *spread* = (max − min) / median over repeats (median over examples)."
    )
    L.append("- **ms/token**: decode time after the first token / (new tokens − 1).")
    L.append(
        "- **gold F1 / EM**: SQuAD/LongBench normalisation (lower-case, no punctuation, no articles), token F1, "
        "max over gold answers. **gold acc**: 1 if a gold answer occurs in the answer as whole words (the "
        "accuracy of *Lost in the Middle*), the QA score of the QA targets, since SmolLM2 answers in whole "
        "sentences. **fidelity F1 / EM**: the same as gold F1 / EM, against full_prefill's answer on the same prompt."
    )
    L.append(
        "- **gold NLL/tok**: −mean log-probability per token of the first gold answer, teacher-forced after the "
        "prompt (`KVRag.continuation_logits`); **ΔNLL** vs full_prefill on the same example."
    )
    L.append(
        f"- **top-1 / KL**: full_prefill's answer is teacher-forced under every policy; over its first "
        f"{cfg['kl_positions']} positions, the share of positions with the same argmax and the mean "
        "KL(full_prefill ‖ policy) in nats."
    )
    L.append(
        "- **cached / recomputed / kept**: FusionStats means: tokens served from cache, cached tokens still "
        "computed at the last layer, tokens kept in the final KV cache; *recomp. frac* = computed (token, layer) "
        "pairs of cached tokens over all of them. **peak MB**: process RSS peak during a run (CPU), "
        "`torch.cuda.max_memory_allocated` (CUDA)."
    )
    L.append(
        "\nRaw data: `results.json` (one record per example × policy), `summary.csv`, `records.csv`, "
        "`scaling.csv`, `sweep.csv`, `floor.csv` in the output directory.\n"
    )
    return "\n".join(L)


def write_report(result: dict, files: dict, report_path: Path) -> Path:
    """Markdown report at ``report_path``; plots/CSVs are copied next to it (``<stem>/``)
    when it lives outside the output directory, so the page's links work where it is."""
    report_path = Path(report_path)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    out_dir = Path(files["results"]).parent
    if report_path.parent.resolve() == out_dir.resolve():
        assets = out_dir
    else:
        assets = report_path.parent / "bench"
        assets.mkdir(parents=True, exist_ok=True)
        for k, p in files.items():
            if k.startswith("plot_") or k.endswith("_csv"):
                shutil.copy2(p, assets / Path(p).name)
    report_path.write_text(render_markdown(result, files, report_path, assets), encoding="utf-8")
    return report_path
