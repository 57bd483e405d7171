"""The benchmark's PNG plots (matplotlib with the Agg backend, imported when a plot is drawn):
TTFT vs context length, quality vs recompute ratio, speed vs fidelity per QA data set. Each
returns whether it drew anything (False: the run has no rows for it)."""

from __future__ import annotations

from pathlib import Path

from kvrag.bench.config import REFERENCE


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
