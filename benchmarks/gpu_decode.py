"""The decode step through the arena, eager and compiled (CUDA graphs on a GPU), at batch 1, 8
and 32, beside the time the bus needs to read what a step reads, at model shapes too large to
save and load inside a short device lease.

The model is ``gpu_floor.build``'s random-weight Llama (Llama-3-8B's or Llama-3.2-1B's shape,
or the tests' tiny one for a rehearsal on a CPU), built where it runs. Each request's cache is
``--context`` rows of random K/V (a decode step's time does not depend on their values), all in
one ``DecodeArena``, as ``kvrag serve`` holds its running requests. Per (shape, batch, path):
the median time of ``--steps`` steps (the device synchronised around each), tokens/s, and the
floor: the bytes a step reads (every weight but the embedding table, plus each request's K/V at
this length) over the bandwidth a device copy of 1 GiB measures in the same run.

Records are appended to ``OUT/decode.csv`` as they are measured and ``OUT/decode.md`` is
rewritten, so a run cut off keeps them; ``--deadline-s`` (seconds from the start) skips what
would start after it.

    python benchmarks/gpu_decode.py OUT --shapes llama8b,llama1b --batches 1,8,32
    python benchmarks/gpu_decode.py OUT --shapes tiny --device cpu --dtype float32 --context 128 --compile off
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_floor import build  # noqa: E402 - this folder's model builder

from kvrag.query.batch import DecodeArena, DecodeCache, decode_step, warm_up  # noqa: E402
from kvrag.query.compiled import CompiledStep  # noqa: E402

FIELDS = [
    "shape",
    "dtype",
    "context",
    "batch",
    "path",
    "step_ms",
    "tokens_per_s",
    "floor_ms",
    "step_over_floor",
    "error",
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_gbs(device: torch.device) -> float:
    """Read rate of the device's memory: a copy of 1 GiB (read + write), best of 5."""
    x = torch.empty(1 << 28, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: all of them but the input embedding table
    (one row of it is read)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)


def caches_for(arch, batch: int, context: int, spare: int) -> list[DecodeCache]:
    g = torch.Generator(device=arch.device).manual_seed(0)
    shape = (arch.n_kv_heads, context, arch.head_dim)

    def kv():
        return torch.randn(shape, generator=g, device=arch.device, dtype=arch.dtype) * 0.5

    return [
        DecodeCache(
            arch,
            [kv() for _ in range(arch.n_layers)],
            [kv() for _ in range(arch.n_layers)],
            context,
            {},
            spare,
        )
        for _ in range(batch)
    ]


def time_steps(arch, batch: int, context: int, steps: int, compiled: CompiledStep | None) -> float:
    """Median seconds of a step of ``batch`` requests of ``context`` rows each (the first
    step, a buffer's first touch, not timed)."""
    arena = DecodeArena(arch)
    caches = caches_for(arch, batch, context, steps + 4)
    if not all(arena.add(c) for c in caches):
        raise RuntimeError("the arena refused a cache")
    tokens = [1] * batch
    times = []
    for i in range(steps + 1):
        sync(arch.device)
        t = time.perf_counter()
        logits = decode_step(arch, caches, tokens, arena, compiled)
        sync(arch.device)
        if i:
            times.append(time.perf_counter() - t)
        tokens = logits.argmax(-1).tolist()
    return statistics.median(times)


def table(records: list[dict]) -> str:
    head = "| shape | dtype | context | batch | path | step ms | tokens/s | floor ms | step / floor |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["error"]:
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {r['context']} | {r['batch']} | {r['path']} | {r['error']} ||||"
            )
            continue
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['context']} | {r['batch']} | {r['path']} | {r['step_ms']} | "
            f"{r['tokens_per_s']} | {r['floor_ms']} | {r['step_over_floor']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shapes", default="llama8b,llama1b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=4096, help="rows of each request's cache")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--device", default=os.environ.get("KVRAG_DEVICE", "cuda"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", choices=("on", "off"), default="on", help="measure the compiled step beside eager")
    ap.add_argument("--deadline-s", type=float, default=float("inf"))
    args = ap.parse_args(argv)
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "decode.csv"
    records = list(csv.DictReader(open(path))) if path.exists() else []
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bw = bandwidth_gbs(device)
    print(f"bandwidth: {bw:.1f} GB/s (device copy)", flush=True)

    def keep(rec: dict) -> None:
        new = not path.exists()
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerow(rec)
        records.append({k: str(v) for k, v in rec.items()})
        (args.out / "decode.md").write_text(
            f"# Decode step through the arena\n\nBandwidth {bw:.1f} GB/s (a device copy of 1 GiB).\n\n"
            + table(records)
            + "\n"
        )
        print({k: v for k, v in rec.items() if v != ""}, flush=True)

    for shape in args.shapes.split(","):
        if time.monotonic() - start > args.deadline_s:
            print(f"{shape}: skipped (past the deadline)", flush=True)
            continue
        base = {"shape": shape, "dtype": args.dtype, "context": args.context}
        try:
            handle = build(shape, args.device, dtype)
        except Exception as e:  # noqa: BLE001 - a shape that cannot be built is reported, the next one runs
            keep({**base, "batch": "", "path": "build", "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        arch = handle.arch
        compiled = None
        if args.compile == "on" and CompiledStep.supports(arch) and DecodeArena.supports(arch):
            compiled = CompiledStep(arch)
            took = warm_up(arch, compiled)
            print(f"{shape}: compiled the step in {took:.1f} s", flush=True)
        kv_row = 2 * arch.n_layers * arch.n_kv_heads * arch.head_dim * torch.finfo(dtype).bits // 8
        for b in (int(x) for x in args.batches.split(",")):
            floor_s = (weight_bytes(handle.model) + b * args.context * kv_row) / (bw * 1e9)
            for name, step in (("eager", None), ("compiled", compiled)):
                if name == "compiled" and compiled is None:
                    continue
                if time.monotonic() - start > args.deadline_s:
                    continue
                rec = {**base, "batch": b, "path": name, "error": ""}
                try:
                    s = time_steps(arch, b, args.context, args.steps, step)
                    rec.update(
                        step_ms=round(s * 1e3, 3),
                        tokens_per_s=round(b / s, 1),
                        floor_ms=round(floor_s * 1e3, 3),
                        step_over_floor=round(s / floor_s, 2),
                    )
                except Exception as e:  # noqa: BLE001 - out of memory at a batch: recorded, the next runs
                    rec["error"] = f"{type(e).__name__}: {e}"[:200]
                keep(rec)
        del handle, arch, compiled
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
