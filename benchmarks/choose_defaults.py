"""Choose each packaged model's default reuse policy from its committed held-out runs, and
write the table KVRag reads (kvrag/assets/policy_defaults.json) and the plot docs/policies.md
shows (docs/bench/policy_defaults.png). The rule is kvrag.bench.pareto's.

    python benchmarks/choose_defaults.py [--check]

--check: write nothing; exit 1 when the committed table differs from what the runs give.
Rerun after a held-out run listed in EVIDENCE changes or a new one is added to it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Per packaged model (a ``kvrag.model`` name): its display name and the held-out runs (kvrag
#: bench output directories, relative to the repository) the default is chosen from. One run
#: per item set: a run that extends another on the same items supersedes it.
EVIDENCE = {
    "smollm2": {
        "name": "SmolLM2-135M-Instruct",
        "runs": [
            "docs/bench/heldout_cloze_n100",
            "docs/bench/heldout_cloze_attention",
            "docs/bench/heldout_musique_prophetkv",
            "docs/bench/heldout_musique",
            "docs/bench/heldout_musique_attention",
        ],
    },
    "gemma3-270m": {
        "name": "Gemma 3 270M",
        "runs": [
            "docs/bench/yardstick_gemma3",
            "docs/bench/yardstick_gemma3_kvlink",
            "docs/bench/yardstick_gemma3_kvlink_r05",
            "docs/bench/yardstick_gemma3_kvlink_r10",
            "docs/bench/yardstick_gemma3_kvlink_h8",
            "docs/bench/yardstick_gemma3_epic16",
            "docs/bench/yardstick_gemma3_kvlink_a10",
            "docs/bench/yardstick_gemma3_kvlink_a05",
            "docs/bench/yardstick_gemma3_kvlink_a03",
            "docs/bench/yardstick_gemma3_long",
            "docs/bench/yardstick_gemma3_long_kvlink",
            "docs/bench/yardstick_gemma3_long_kvlink_r05",
            "docs/bench/yardstick_gemma3_long_kvlink_r10",
            "docs/bench/yardstick_gemma3_long_kvlink_a10",
            "docs/bench/yardstick_gemma3_long_kvlink_a05",
        ],
    },
}
FALLBACK = {
    "policy": "cacheblend",
    "params": {},
    "why": "no held-out evidence for this model: CacheBlend, at its paper's recompute ratio, "
    "the training-free policy with the most evidence across models",
}
TABLE = ROOT / "kvrag" / "assets" / "policy_defaults.json"
PLOT = ROOT / "docs" / "bench" / "policy_defaults.png"


def model_entry(name: str, display: str, runs: list) -> dict:
    """The table entry of one model from its runs (``weights`` filled in by the caller)."""
    from kvrag.bench.pareto import choose

    c = choose(runs)
    needs_adapter = c.policy == "kvlink" and c.params.get("mode") != "untrained" and any(r.trained_kvlink for r in runs)
    evidence, described = [], []
    for r in runs:
        if c.label not in r.settings:
            continue
        s = r.settings[c.label]
        evidence.append(
            {"run": r.path, "dataset": r.dataset, "n": s.n, "speedup": round(s.speedup, 2), "gap": round(s.gap, 4)}
        )
        # From the unrounded figures, so the text rounds as the docs' tables do.
        described.append(f"{r.dataset} n={s.n}: {s.speedup:.1f}x, gold-NLL gap {s.gap:.1%}")
    measured = "; ".join(described)
    if c.rule == "fastest that keeps quality":
        why = (
            f"on {display}'s held-out runs the fastest setting not measurably worse than the best in gold "
            f"log-likelihood ({measured})"
        )
    else:
        why = f"no setting kept quality on every held-out run of {display}; the smallest mean gap ({measured})"
    if needs_adapter:
        why += ", with the KVLink adapter that ships for it"
    return {
        "name": display,
        "model": name,
        "policy": c.policy,
        "params": c.params,
        "label": c.label,
        "needs_adapter": needs_adapter,
        "why": why,
        "evidence": evidence,
        "kept_quality": {lab: sorted(v) for lab, v in sorted(c.kept.items())},
        "lost_quality": {lab: sorted(v) for lab, v in sorted(c.lost.items())},
    }


def build(digests: bool = True) -> tuple[dict, dict]:
    """(the table, {model: its runs}); ``digests``: fill in each model's weight digest (reads
    the packaged model files)."""
    from kvrag.bench.pareto import read_run
    from kvrag.model.digests import file_digest
    from kvrag.model.packaged import resolve_model_path
    from kvrag.policies.model_defaults import TABLE_FORMAT

    models, all_runs = [], {}
    for name, spec in EVIDENCE.items():
        runs = [read_run(ROOT / d, root=ROOT) for d in spec["runs"]]
        all_runs[name] = runs
        entry = model_entry(name, spec["name"], runs)
        entry["weights"] = file_digest(resolve_model_path(name)) if digests else None
        models.append(entry)
    table = {
        "format": TABLE_FORMAT,
        "rule": "kvrag.bench.pareto: the fastest setting not measurably worse than the best in gold "
        "log-likelihood (95% paired bootstrap) on every held-out run of the model",
        "fallback": FALLBACK,
        "models": models,
    }
    return table, all_runs


def plot(table: dict, all_runs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    # One panel per dataset: its runs hold the same items, so their settings share the axes
    # (a setting measured twice there is shown from its first run).
    panels = []
    for e in table["models"]:
        by_dataset: dict[str, dict] = {}
        for r in all_runs[e["model"]]:
            for lab, s in r.settings.items():
                by_dataset.setdefault(r.dataset, {}).setdefault(lab, (s, r.path))
        panels += [(e, ds, settings) for ds, settings in by_dataset.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, (entry, dataset, settings) in zip(axes[0], panels):
        for lab, (s, path) in sorted(settings.items()):
            if lab == "full_prefill":
                continue
            chosen = lab == entry["label"]
            bad = path in entry["lost_quality"].get(lab, [])
            color = "tab:red" if chosen else ("0.6" if bad else "tab:blue")
            candidate = lab in entry["kept_quality"]  # run on every dataset of the model
            ax.scatter(
                s.speedup,
                100 * s.gap,
                marker="*" if chosen else "o",
                s=180 if chosen else 36,
                facecolors=color if candidate else "none",
                edgecolors=color,
                zorder=3,
            )
            ax.annotate(lab, (s.speedup, 100 * s.gap), fontsize=7, xytext=(4, 3), textcoords="offset points")
        n = max(s.n for s, _ in settings.values())
        ax.set_title(f"{entry['name']}: {dataset} (n={n})", fontsize=9)
        ax.set_xscale("log")
        ax.set_yscale("log")  # gaps span 1% to 300%
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_minor_locator(NullLocator())
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("TTFT speed-up over full prefill (x)")
        ax.set_ylabel("gold-NLL gap to full prefill (%)")
        ax.grid(alpha=0.3)
    fig.suptitle(
        "Default policy per model (red star); grey: measurably worse than the best on that dataset; "
        "hollow: not run on every dataset of the model",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the committed table; write nothing")
    a = p.parse_args()
    table, runs = build()
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if a.check:
        same = TABLE.is_file() and TABLE.read_text(encoding="utf-8") == text
        print("the committed table is up to date" if same else f"{TABLE} differs from what the runs give")
        return 0 if same else 1
    tmp = TABLE.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, TABLE)
    plot(table, runs, PLOT)
    for e in table["models"]:
        print(f"{e['name']}: {e['label']} -- {e['why']}")
    print(f"-> {TABLE}, {PLOT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
