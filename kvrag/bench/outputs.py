"""A benchmark run's files: results.json (the records), summary.json (with the targets), the
CSV files and the plots."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

from kvrag.bench.plots import plot_qa, plot_scaling, plot_sweep
from kvrag.bench.summary import SUMMARY_FIELDS
from kvrag.bench.targets import evaluate_targets, qa_datasets


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
