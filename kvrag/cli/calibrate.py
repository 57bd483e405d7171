"""``kvrag calibrate a2ats``: fit the A²ATS key codebooks of a model once.

The codebooks land in ``$KVRAG_HOME/a2ats/<model fingerprint>.safetensors`` (or ``--out``),
where the ``a2ats`` policy finds them for that model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvrag.cli._options import MODEL_HELP, add_home_option
from kvrag.defaults import DEFAULT_COMPUTE_DTYPE

#: The calibrator's defaults (``kvrag.policies.a2ats.calibrate`` / ``.codebook``), written out:
#: importing those modules imports torch, and building the parser must not (``kvrag --version``,
#: ``--help``). tests/unit/cli/test_first_hour.py checks that they agree.
DEFAULTS = dict(tokens=8192, codes=512, iters=8, seq_len=512, uuid_fraction=0.2, rope_offset=2048)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit per-model data a policy needs (A2ATS codebooks)",
        description="Fit the per-model data a policy needs before it can run (the a2ats policy's key codebooks).",
    )
    sub = p.add_subparsers(dest="calibrate_command", metavar="POLICY", required=True)

    a = sub.add_parser(
        "a2ats",
        help="fit A2ATS query-aware VQ codebooks (one per layer and KV head)",
        description=(
            "Run the model over calibration text, estimate the second moment of its (windowed-RoPE) "
            "queries per layer and KV head, and fit a query-aware k-means++ codebook of its pre-RoPE "
            "keys. Default text: kvrag's demo corpus + Python's documentation topics, mixed with "
            "random uuids as in the paper; in-domain text (--store, --text) is better."
        ),
    )
    a.add_argument("--model", metavar="MODEL", default=None, help=MODEL_HELP)
    a.add_argument(
        "--tokens",
        type=int,
        default=DEFAULTS["tokens"],
        help=f"calibration tokens (default {DEFAULTS['tokens']}; the paper used 80K)",
    )
    a.add_argument(
        "--codes",
        type=int,
        default=DEFAULTS["codes"],
        help=f"codewords per layer and KV head (default {DEFAULTS['codes']}; the paper used 4096)",
    )
    a.add_argument(
        "--iters",
        type=int,
        default=DEFAULTS["iters"],
        help=f"Lloyd iterations after k-means++ seeding (default {DEFAULTS['iters']})",
    )
    a.add_argument(
        "--text",
        metavar="FILE",
        action="append",
        default=None,
        help="calibration text: .txt, or .json/.jsonl (every string in it); repeatable",
    )
    a.add_argument(
        "--store",
        metavar="DIR",
        default=None,
        help="calibration text: the chunk texts ingested into this kvrag KV store (a KVRag's "
        "cache_dir), i.e. your own documents; combines with --text",
    )
    a.add_argument(
        "--uuid-fraction",
        type=float,
        default=DEFAULTS["uuid_fraction"],
        help=f"share of the tokens that are random uuids (default {DEFAULTS['uuid_fraction']}, as in the paper)",
    )
    a.add_argument(
        "--seq-len",
        type=int,
        default=DEFAULTS["seq_len"],
        help=f"tokens per calibration sequence (default {DEFAULTS['seq_len']})",
    )
    a.add_argument(
        "--rope-offset",
        type=int,
        default=DEFAULTS["rope_offset"],
        help=f"b, the fixed relative position of windowed RoPE (default {DEFAULTS['rope_offset']})",
    )
    a.add_argument("--seed", type=int, default=0, help="random seed (uuids, k-means++)")
    a.add_argument(
        "--out", metavar="FILE", default=None, help="output file (default $KVRAG_HOME/a2ats/<fingerprint>.safetensors)"
    )
    a.add_argument("--dtype", default=DEFAULT_COMPUTE_DTYPE, help=f"compute dtype (default {DEFAULT_COMPUTE_DTYPE})")
    a.add_argument("--device", default="cpu", help="torch device (default cpu)")
    add_home_option(a)
    a.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    a.set_defaults(func=_a2ats)


def _a2ats(args: argparse.Namespace) -> int:
    from kvrag.errors import KVRagError
    from kvrag.model import ModelHandle
    from kvrag.policies.a2ats import calibrate as cal
    from kvrag.policies.a2ats import codebook as books

    if args.tokens < 1 or args.codes < 1 or args.iters < 0 or args.seq_len < 2:
        raise KVRagError("--tokens, --codes must be >= 1, --iters >= 0, --seq-len >= 2")
    if args.codes > books.MAX_CODES:
        raise KVRagError(f"--codes must be at most {books.MAX_CODES} (codes are stored as int16)")
    if not 0.0 <= args.uuid_fraction <= 1.0:
        raise KVRagError(f"--uuid-fraction must be in [0, 1], got {args.uuid_fraction}")
    if args.rope_offset < 0:
        raise KVRagError(f"--rope-offset must be >= 0, got {args.rope_offset}")
    if args.tokens < args.codes:
        raise KVRagError(
            f"--tokens {args.tokens} cannot fit --codes {args.codes} codewords (k-means needs a "
            "calibration token per codeword at least); use more tokens or fewer codes"
        )
    # The output and the text are checked before the model load and the model pass: a wrong
    # path must not cost a calibration, nor an empty text file replace a model's codebooks.
    from kvrag.outpaths import check_dir, check_file

    if args.out is not None:
        check_file(args.out, "--out")
    else:
        check_dir(books.codebook_dir(), "the codebook directory ($KVRAG_HOME/a2ats)")
    texts = cal.read_texts(args.text) if args.text else None
    if args.store is not None:
        from kvrag.cli.cache import open_existing_store

        with open_existing_store(args.store, option="--store") as store:
            texts = (texts or []) + cal.store_texts(store)
    t0 = time.perf_counter()
    handle = ModelHandle.load(args.model, dtype=args.dtype, device=args.device, cache_dir=args.home)
    bars: dict = {}

    def progress(stage: str, n: int) -> None:
        # Two bars on stderr: the model pass over the text, then k-means layer by layer.
        if stage not in bars:
            from tqdm import tqdm

            for b in bars.values():
                b.close()
            total, unit, desc = (
                (args.tokens, "tok", "model pass") if stage == "tokens" else (handle.arch.n_layers, "layer", "k-means")
            )
            bars[stage] = tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, disable=args.json)
        bars[stage].update(n)

    try:
        cb, path = cal.calibrate(
            handle,
            texts=texts,
            n_tokens=args.tokens,
            n_codes=args.codes,
            iters=args.iters,
            seq_len=args.seq_len,
            uuid_fraction=args.uuid_fraction,
            rope_offset=args.rope_offset,
            seed=args.seed,
            out=args.out,
            progress=progress,
        )
    except ValueError as e:  # e.g. fewer calibration tokens than codewords
        raise KVRagError(str(e)) from e
    finally:
        for b in bars.values():
            b.close()
    info = {
        "path": str(path),
        "fingerprint": handle.fingerprint,
        "layers": cb.n_layers,
        "kv_heads": cb.n_kv_heads,
        "codes": cb.n_codes,
        "head_dim": cb.head_dim,
        "tokens": cb.meta.get("n_tokens"),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(
            f"A2ATS codebooks: {info['layers']} layers x {info['kv_heads']} KV heads x {info['codes']} codes "
            f"({info['tokens']} calibration tokens, {info['seconds']} s)"
        )
        print(f"written to {path}")
    return 0
