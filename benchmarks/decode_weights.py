"""What decoding from half-precision copies of the weights (``KVRag(decode_weights=...)``,
``kvrag.model.gemv``) costs in answers and saves per token, on held-out RAG prompts, in one run.

Per example (``--data``, MuSiQue's held-out file by default, ``--passages`` each), under the
model's default policy: the reference is greedy decoding of ``--tokens`` tokens from the float32
weights, eager (the library's default path). Each format then decodes the same prompt twice:
teacher-forced on the reference's tokens (every step sees the same context: the KL from the
float32 step's distribution to the format's, and whether their argmax agrees) and free-running
(is its greedy answer the reference's, token for token; is the gold answer in it where the
reference's has it). Decode time per token at batch 1 is each free run's (end - first token) /
(tokens - 1), the formats interleaved per example; ``--compile on`` decodes every format,
float32 included, through the compiled step (each format's one-request graph is built before
the first example): the float32 row is then the compiled path against the eager one.
``DecodeWeights.choose``'s pick on this machine is printed with its timings.

Results: ``--out``/results.json (after every example; ``--resume`` keeps what it holds) and
``--out``/README.md.

    .venv/bin/python benchmarks/decode_weights.py --out docs/bench/decode_weights
    .venv/bin/python benchmarks/decode_weights.py --model gemma3-270m --out docs/bench/decode_weights_gemma3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvrag import KVRag
from kvrag.bench.examples import load_examples
from kvrag.bench.metrics import best_acc
from kvrag.layout.prompt import rag_prompt
from kvrag.model import ModelHandle
from kvrag.model.gemv import DecodeWeights

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("float32", "float16", "bfloat16")


def teacher_forced(rag: KVRag, prompt: list[dict] | str, policy: str, tokens: list[int]) -> list[torch.Tensor]:
    """Log-probabilities [V] of every step of ``rag``'s decoding fed ``tokens``: the first from
    the prefill, each next after one more of ``tokens``."""
    pre = rag.prefill(prompt, policy)
    step = rag._decoding(pre.stepper, len(tokens) + 2)
    logits = [pre.logits]
    for tok in tokens[:-1]:
        logits.append(step(tok))
    return [torch.log_softmax(x.float(), -1) for x in logits]


def free_run(rag: KVRag, prompt: list[dict] | str, policy: str, tokens: int) -> tuple[list[int], str, float]:
    """Greedy answer ids, text and ms per decoded token after the first."""
    t = time.perf_counter()
    first = None
    stream = rag.stream(prompt, policy=policy, max_new_tokens=tokens, ignore_eos=True)
    for _ in stream:
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    g = stream.generation()
    n = len(g.token_ids)
    return list(g.token_ids), g.text, (end - (first or t)) / max(n - 1, 1) * 1000


def report(res: dict, out: Path) -> None:
    rows = res["examples"]
    lines = [
        "# Decoding from half-precision weight copies",
        "",
        "Reference: the eager float32 decode (the library's default path); with compile on, every row,",
        "float32 included, decodes through the compiled step.",
        "",
        f"Machine: {res['machine']}; torch {res['torch']}, {res['threads']} threads; model {res['model']}, "
        f"policy {res['policy']}; {len(rows)} held-out examples of {res['data']}, {res['passages']} passages, "
        f"{res['tokens']} tokens decoded each; compile {res['compile']}. Command: `{res['command']}`.",
        "",
        f'`decode_weights="auto"` on this machine picks **{res["auto"]}**.',
        "",
        "| format | decode ms/token (median) | speed vs float32 | mean KL to float32 | argmax agrees "
        "| same greedy answer | gold in answer |",
        "|---|---|---|---|---|---|---|",
    ]
    base = statistics.median(r["float32"]["ms_per_token"] for r in rows) if rows else float("nan")
    for f in FORMATS:
        if not rows or f not in rows[0]:
            continue
        ms = statistics.median(r[f]["ms_per_token"] for r in rows)
        kl = statistics.mean(r[f]["kl"] for r in rows)
        agree = statistics.mean(r[f]["argmax_agree"] for r in rows)
        same = sum(r[f]["same_answer"] for r in rows)
        gold = sum(r[f]["gold"] for r in rows)
        lines.append(
            f"| {f} | {ms:.1f} | {base / ms:.2f}x | {kl:.2e} | {agree:.1%} | {same}/{len(rows)} | {gold}/{len(rows)} |"
        )
    (out / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=str(ROOT.parent / "shared/data/musique_dev.json"))
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--passages", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--compile", choices=("on", "off"), default="off")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    res = json.loads(path.read_text()) if args.resume and path.exists() else {"examples": []}
    examples = load_examples(args.data, limit=args.limit, passages=args.passages)
    with tempfile.TemporaryDirectory() as tmp:
        handle = ModelHandle.load(args.model)
        # The reference is the library's default path, eager and float32; with --compile on,
        # every format's row (float32 included) is the compiled step against it.
        ref = KVRag(handle, cache_dir=Path(tmp) / "kv", compile="off", decode_weights="float32")
        rags = {
            f: ref
            if f == "float32" and args.compile == "off"
            else KVRag(handle, cache_dir=Path(tmp) / "kv", compile=args.compile, decode_weights=f)
            for f in FORMATS
        }
        policy = ref.policy.name
        for f, rag in rags.items():
            if rag.compiled is not None:  # its one-request graph (all this run decodes), before the clock
                t = time.perf_counter()
                rag.generate("Warm up.", policy=policy, max_new_tokens=2, ignore_eos=True)
                print(f"{f}: compiled the decode step in {time.perf_counter() - t:.0f} s", flush=True)
        res.update(
            machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}",
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            model=args.model or "SmolLM2-135M-Instruct",
            policy=policy,
            data=Path(args.data).name,
            passages=args.passages,
            tokens=args.tokens,
            compile=args.compile,
            auto=DecodeWeights.choose(ref.handle.model),
            command="python benchmarks/decode_weights.py "
            + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k not in ("out", "resume")),
        )
        for i, ex in enumerate(examples):
            if i < len(res["examples"]):
                continue
            prompt = rag_prompt(ref.tokenizer, ex.passages, ex.question)
            ref.precompute(ex.passages)
            ids, text, ms = free_run(ref, prompt, policy, args.tokens)
            want = teacher_forced(ref, prompt, policy, ids)
            row: dict = {"reference": {"ms_per_token": ms, "kl": 0.0, "argmax_agree": 1.0, "same_answer": True}}
            row["reference"]["gold"] = bool(best_acc(text, ex.answers))
            for f in FORMATS:
                if rags[f] is ref:
                    row[f] = row["reference"]
                    continue
                got = teacher_forced(rags[f], prompt, policy, ids)
                kl = [float(torch.sum(w.exp() * (w - g))) for w, g in zip(want, got)]
                agree = [int(w.argmax()) == int(g.argmax()) for w, g in zip(want, got)]
                f_ids, f_text, f_ms = free_run(rags[f], prompt, policy, args.tokens)
                row[f] = {
                    "ms_per_token": f_ms,
                    "kl": statistics.mean(kl),
                    "argmax_agree": statistics.mean(agree),
                    "same_answer": f_ids == ids,
                    "gold": bool(best_acc(f_text, ex.answers)),
                }
            res["examples"].append(row)
            path.write_text(json.dumps(res, indent=1))
            report(res, out)
            print(i, {f: (round(r["ms_per_token"], 1), r["same_answer"]) for f, r in row.items()}, flush=True)
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()
