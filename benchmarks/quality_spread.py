"""Quality kept by each policy, with its spread, from a ``kvrag bench`` QA or sweep journal:
accuracy relative to full prefill's, gold-NLL gap, KL and fidelity F1 (the reply's token F1
against full prefill's), each with a 95% bootstrap interval over the examples (resampled
together, so every policy is judged on the same draw of items).

    python benchmarks/quality_spread.py docs/bench/heldout_musique/qa_journal.cpu.musique_dev.jsonl [...]

Prints one markdown table per journal. The gap is the report's: |mean gold NLL − full
prefill's| / full prefill's mean gold NLL, over the examples every policy finished.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import defaultdict

REFERENCE = "full_prefill"


def load(path: str) -> tuple[str, dict[str, dict[str, dict]]]:
    """(dataset, {example key: {label: record}}) of the examples every label finished."""
    by_ex: dict[str, dict[str, dict]] = defaultdict(dict)
    dataset = ""
    with open(path, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if "journal" in d:
                dataset = d["journal"].get("dataset", "")
                continue
            for r in d["records"]:
                if r.get("scenario") in ("qa", "sweep") and not r.get("error"):
                    by_ex[d["key"]][r["label"]] = r
    labels = set.union(*(set(v) for v in by_ex.values())) if by_ex else set()
    done = {k: v for k, v in by_ex.items() if set(v) == labels}
    return dataset, done


def stats(examples: list[dict[str, dict]], label: str) -> dict:
    full_nll = statistics.fmean(e[REFERENCE]["gold_nll"] for e in examples)
    nll = statistics.fmean(e[label]["gold_nll"] for e in examples)
    hits = sum(bool(e[label]["gold_acc"]) for e in examples)
    ref_hits = sum(bool(e[REFERENCE]["gold_acc"]) for e in examples)
    return {
        "gap": abs(nll - full_nll) / full_nll,
        "kl": statistics.fmean(e[label].get("kl") or 0.0 for e in examples),
        "f1": statistics.fmean(e[label].get("fidelity_f1") or 0.0 for e in examples),
        "hits": hits,
        "acc_ratio": hits / ref_hits if ref_hits else float("nan"),
    }


def interval(values: list[float]) -> tuple[float, float]:
    v = sorted(x for x in values if x == x)
    if not v:
        return float("nan"), float("nan")
    return v[int(0.025 * (len(v) - 1))], v[int(0.975 * (len(v) - 1))]


def table(path: str, draws: int, seed: int) -> str:
    dataset, done = load(path)
    examples = list(done.values())
    if not examples:
        return f"{path}: no example finished by every policy\n"
    labels = sorted(examples[0], key=lambda x: (x != REFERENCE, x))
    rng = random.Random(seed)
    boots = [[rng.choice(examples) for _ in examples] for _ in range(draws)]
    n = len(examples)
    ref_hits = sum(bool(e[REFERENCE]["gold_acc"]) for e in examples)
    out = [
        f"{dataset}: n = {n} examples (full prefill answers {ref_hits}); 95% bootstrap intervals, {draws} draws",
        "",
        "| policy | answered | of full prefill's | gold NLL gap | KL | fidelity F1 | TTFT speed-up (median) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label in labels:
        s = stats(examples, label)
        b = [stats(x, label) for x in boots]
        gap_lo, gap_hi = interval([x["gap"] for x in b])
        kl_lo, kl_hi = interval([x["kl"] for x in b])
        acc_lo, acc_hi = interval([x["acc_ratio"] for x in b])
        f1_lo, f1_hi = interval([x["f1"] for x in b])
        speed = statistics.median(e[label].get("speedup") or 1.0 for e in examples)
        acc = f"{s['acc_ratio']:.0%} [{acc_lo:.0%}, {acc_hi:.0%}]" if ref_hits else "–"
        out.append(
            f"| `{label}` | {s['hits']}/{n} | {acc} | {s['gap']:.1%} [{gap_lo:.1%}, {gap_hi:.1%}] "
            f"| {s['kl']:.3f} [{kl_lo:.3f}, {kl_hi:.3f}] | {s['f1']:.2f} [{f1_lo:.2f}, {f1_hi:.2f}] | {speed:.1f}× |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("journals", nargs="+")
    p.add_argument("--draws", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for path in a.journals:
        print(table(path, a.draws, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
