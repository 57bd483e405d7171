"""Choosing a model's default reuse policy from its held-out ``kvrag bench`` runs.

The rule, quality first and then speed:

1. The candidates are the policy settings (bench labels: ``cacheblend@0.2``, ``epic``, ...)
   other than ``full_prefill`` that were run on every held-out dataset of the model.
2. On each dataset, the *best* setting is the one whose mean gold log-likelihood is closest
   to full prefill's, over every run on that dataset (the runs hold the same items). A
   setting *keeps quality* on a run when it is not measurably worse than its dataset's best:
   the 95% paired-bootstrap interval of its per-item log-likelihood deficit to the best
   reaches zero. Item-level pairing matters: the items' difficulty varies far
   more than the policies do, so unpaired intervals would call everything a tie.
3. The default is the fastest setting that keeps quality on every run it was measured on,
   its speed-up taken as its smallest over those runs. When none does, the setting with the
   smallest mean gap (quality first).

Pure data in, data out: ``benchmarks/choose_defaults.py`` reads the committed runs with
:func:`read_run`, applies :func:`choose` and writes ``kvrag/assets/policy_defaults.json``."""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from kvrag.bench.config import REFERENCE, label_of

RESAMPLES = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Setting:
    """One policy setting measured on one run: its label, the policy and parameters it ran
    with, items ``n``, TTFT ``speedup`` over full prefill, gold-log-likelihood ``gap`` to it
    (relative, of the means), and ``ll``: gold log-likelihood per example id."""

    label: str
    policy: str
    params: dict
    n: int
    speedup: float
    gap: float
    ll: dict[str, float] = field(repr=False)


@dataclass(frozen=True)
class Run:
    """One held-out run: its directory, dataset, model fingerprint (the journal's), its
    settings, and whether its ``kvlink`` ran with a LoRA KVLink adapter (``trained_kvlink``)."""

    path: str
    dataset: str
    model: str
    settings: dict[str, Setting]
    trained_kvlink: bool = False


@dataclass(frozen=True)
class Choice:
    """The chosen setting and, per candidate, where it kept quality and its slowest speed-up."""

    label: str
    policy: str
    params: dict
    speedup: float
    kept: dict[str, list[str]]  # label -> runs (paths) where it kept quality
    lost: dict[str, list[str]]  # label -> runs where it was measurably worse than the best
    rule: str  # "fastest that keeps quality" or "smallest mean gap"


def read_run(directory: str | Path, root: str | Path | None = None) -> Run:
    """The run ``kvrag bench --out directory`` reported: summary.csv (speed-up, gap, n per
    label) and records.csv (per-item gold log-likelihood), written together, so a run still
    extending its journal is read as of its last report; the journal's header and records give
    the model and each label's parameters. ``root``: paths are recorded relative to it."""
    d = Path(directory)
    journals = sorted(d.glob("qa_journal.*.jsonl"))
    if len(journals) != 1:
        raise ValueError(f"{d}: expected one qa_journal.*.jsonl, found {len(journals)}")
    with open(journals[0], encoding="utf-8") as f:
        header = json.loads(f.readline())["journal"]
        params: dict[str, tuple[str, dict]] = {}
        for line in f:
            for r in json.loads(line)["records"]:
                params.setdefault(r["label"], (r["policy"], r.get("params") or {}))
    ll: dict[str, dict[str, float]] = {}
    with open(d / "records.csv", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("error") or not row.get("gold_ll"):
                continue
            ll.setdefault(row["label"], {})[row["example_id"]] = float(row["gold_ll"])
    adapter = header.get("kvlink_adapter")
    settings = {}
    with open(d / "summary.csv", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            label = row["label"]
            if label not in ll or label not in params:
                continue
            policy, kw = params[label]
            if policy == "kvlink" and not kw and adapter is None:
                # Run where no adapter existed, "kvlink" ran untrained: name it so, or a later
                # run of the same model with its adapter would be read as the same setting.
                kw = {"mode": "untrained"}
            shown = label_of(policy, kw)
            settings[shown] = Setting(
                label=shown,
                policy=policy,
                params=kw,
                n=int(row["n"]),
                speedup=float(row["speedup"]),
                gap=float(row["gold_ll_rel_gap"] or 0.0),
                ll=ll[label],
            )
    if REFERENCE not in settings:
        raise ValueError(f"{d}: no {REFERENCE} results to compare with")
    path = str(d.resolve().relative_to(Path(root).resolve())) if root is not None else str(d)
    trained = isinstance(adapter, dict) and bool(adapter.get("lora"))
    return Run(
        path=path, dataset=header["dataset"], model=str(header["model"]), settings=settings, trained_kvlink=trained
    )


def deficit_interval(worse: dict[str, float], better: dict[str, float], seed: int = 0) -> tuple[float, float]:
    """95% paired-bootstrap interval of mean(better - worse) gold log-likelihood over the
    examples both have (positive: ``worse`` is less likely to produce the gold answer)."""
    ids = sorted(set(worse) & set(better))
    if not ids:
        raise ValueError("no examples in common")
    diffs = [better[i] - worse[i] for i in ids]
    rng = random.Random(f"kvrag-pareto:{seed}")
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(RESAMPLES))
    lo = means[int(math.floor((1 - LEVEL) / 2 * RESAMPLES))]
    hi = means[int(math.ceil((1 + LEVEL) / 2 * RESAMPLES)) - 1]
    return lo, hi


def best_label(run: Run) -> str:
    """The setting of ``run`` closest to full prefill in mean gold log-likelihood."""
    others = [s for s in run.settings.values() if s.label != REFERENCE]
    if not others:
        raise ValueError(f"{run.path}: no policy besides {REFERENCE}")
    return min(others, key=lambda s: (s.gap, s.label)).label


def choose(runs: list[Run]) -> Choice:
    """The default setting over one model's held-out ``runs`` (see the module docstring)."""
    if not runs:
        raise ValueError("no runs to choose from")
    models = {r.model for r in runs}
    if len(models) != 1:
        raise ValueError(f"the runs measure different models: {sorted(models)}")
    datasets = {r.dataset for r in runs}
    labels = {s for r in runs for s in r.settings if s != REFERENCE}
    candidates = sorted(
        lab for lab in labels if all(any(lab in r.settings for r in runs if r.dataset == ds) for ds in datasets)
    )
    if not candidates:
        raise ValueError(f"no policy setting was run on every dataset ({sorted(datasets)})")
    # Each candidate's settings over the runs that measured it.
    measured = {lab: [r.settings[lab] for r in runs if lab in r.settings] for lab in candidates}
    kept: dict[str, list[str]] = {lab: [] for lab in candidates}
    lost: dict[str, list[str]] = {lab: [] for lab in candidates}
    # Each dataset's best over all its runs: they hold the same items, and a run that measures
    # one new setting alone must not make it its own best.
    best_of: dict[str, Setting] = {}
    for r in runs:
        b = r.settings[best_label(r)]
        held = best_of.get(r.dataset)
        if held is None or (b.gap, b.label) < (held.gap, held.label):
            best_of[r.dataset] = b
    for r in runs:
        best = best_of[r.dataset]
        for lab in candidates:
            if lab not in r.settings:
                continue
            s = r.settings[lab]
            lo, _ = (0.0, 0.0) if s is best else deficit_interval(s.ll, best.ll)
            (kept if lo <= 0 else lost)[lab].append(r.path)
    speed = {lab: min(s.speedup for s in ss) for lab, ss in measured.items()}
    good = [lab for lab in candidates if not lost[lab]]
    if good:
        label, rule = max(good, key=lambda lab: (speed[lab], lab)), "fastest that keeps quality"
    else:
        mean_gap = {lab: sum(s.gap for s in ss) / len(ss) for lab, ss in measured.items()}
        label, rule = min(candidates, key=lambda lab: (mean_gap[lab], lab)), "smallest mean gap"
    s = measured[label][0]
    return Choice(label, s.policy, dict(s.params), speed[label], kept, lost, rule)
