"""What a decode step's matrix-vector products cost per weight format on this CPU: the 90
projection matrices of a 30-layer SmolLM2-shaped model (576 -> 1536, ~318 MB in float32, so
no cache holds them) applied to one row (batch 1) and to eight, in float32, as bfloat16 and
float16 weights (the row cast to match), and as int8 weights with per-row scales
(``torch.ops.aten._weight_int8pack_mm``, torch's own weight-only int8 kernel) beside float32
and bfloat16 rows. Prints ms per pass and the bytes read per second.

Whether a format pays depends on the CPU: without native bfloat16 (AVX2 only) the bf16
kernels convert on the fly. ``torch.backends.cpu.get_cpu_capability()`` is printed first.

    .venv/bin/python benchmarks/cpu_weight_formats.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

LAYERS = 30


def bench(f, k: int = 5) -> float:
    f()
    t = time.perf_counter()
    for _ in range(k):
        f()
    return (time.perf_counter() - t) / k * 1000


def main() -> None:
    print("cpu capability:", torch.backends.cpu.get_cpu_capability(), "threads:", torch.get_num_threads())
    ws = [torch.randn(1536, 576) * 0.02 for _ in range(3 * LAYERS)]
    x1, x8 = torch.randn(1, 576), torch.randn(8, 576)
    for name, conv in (("float32", lambda w: w), ("bfloat16", torch.Tensor.bfloat16), ("float16", torch.Tensor.half)):
        w2 = [conv(w) for w in ws]
        nbytes = sum(w.numel() * w.element_size() for w in w2)
        for rows, x in ((1, x1), (8, x8)):
            xx = x.to(w2[0].dtype)
            ms = bench(lambda w2=w2, xx=xx: [F.linear(xx, w).float() for w in w2])
            print(f"{name} weights, batch {rows}: {ms:.2f} ms, {nbytes / ms / 1e6:.1f} GB/s")
    q = []
    for w in ws:
        s = w.abs().amax(1) / 127
        q.append(((w / s[:, None]).round().to(torch.int8), s))
    nbytes = sum(w.numel() for w, _ in q)
    for rows, x in ((1, x1), (8, x8)):
        for xdt in (torch.float32, torch.bfloat16):
            xx = x.to(xdt)
            ms = bench(lambda xx=xx, xdt=xdt: [torch.ops.aten._weight_int8pack_mm(xx, w, s.to(xdt)) for w, s in q])
            print(f"int8 weights, {xdt} rows, batch {rows}: {ms:.2f} ms, {nbytes / ms / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
