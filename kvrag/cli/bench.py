"""``kvrag bench``: TTFT and quality of every reuse policy against ``full_prefill``, on a QA
file (MuSiQue format: ``question``, ``answers``, ``ctxs`` of ``{title, text}``) and/or synthetic QA, plus TTFT vs
context length and quality vs recompute ratio; writes results.json, CSVs, PNG plots and a
markdown report (``benchmarks/run_default.sh`` makes ``docs/benchmarks.md``)."""

from __future__ import annotations

import json
import re
import shlex

from kvrag.cli._options import MODEL_HELP
from kvrag.defaults import DEFAULT_COMPUTE_DTYPE, DEFAULT_PREFIX_CACHE, DEFAULT_STORAGE_DTYPE, STORAGE_DTYPES
from kvrag.errors import KVRagError

# Defaults of a full run, and of --quick (a smoke test: seconds per policy, tiny prompts).
FULL = {
    "repeats": 3,
    "max_new_tokens": 32,
    "scaling": "4x256,8x256,8x512,12x512",
    "sweep_ratios": "0,0.05,0.1,0.15,0.3,0.5,1",
    "sweep_limit": 3,
    "synthetic_passages": 6,
    "synthetic_passage_tokens": 200,
    "passage_words": None,
    "limit": None,
    "passages": None,
    "check_items": 24,
}
QUICK = {
    "repeats": 1,
    "max_new_tokens": 8,
    "scaling": "2x64,3x64",
    "sweep_ratios": "0,0.15,1",
    "sweep_limit": 1,
    "synthetic_passages": 3,
    "synthetic_passage_tokens": 60,
    "passage_words": 40,
    "limit": 2,
    "passages": 3,
    "check_items": 2,
}
DEFAULT_SWEEP_POLICIES = "cacheblend,a3"


class BenchError(KVRagError, ValueError):
    """Bad ``kvrag bench`` arguments."""


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark TTFT and answer quality of every policy against full_prefill",
        description=__doc__,
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        metavar="FILE",
        help="QA file: a JSON list (or JSON lines) of {question, answers, "
        "ctxs[{title, text}]}; MuSiQue, HotpotQA/2Wiki, LongBench and SQuAD files as released too",
    )
    g.add_argument(
        "--synthetic",
        nargs="?",
        type=int,
        const=None,
        default=0,
        metavar="N",
        help="add N synthetic multi-document QA items (default N: 12; quick: 3)",
    )
    g.add_argument("--limit", type=int, metavar="N", help="first N >= 1 examples of --data (default all; quick: 2)")
    g.add_argument(
        "--passages", type=int, metavar="K", help="first K >= 1 passages of each example (default all; quick: 3)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    g = p.add_argument_group("policies")
    g.add_argument(
        "--policies",
        metavar="LIST",
        help="comma-separated policies (default: every registered one); full_prefill is always added as the reference",
    )
    g.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="a policy hyper-parameter, e.g. cacheblend.recompute_ratio=0.2 (repeatable; JSON values)",
    )
    g = p.add_argument_group("measurement")
    g.add_argument("--repeats", type=int, metavar="R", help="timed runs per example and policy (default 3; quick 1)")
    g.add_argument("--max-new-tokens", type=int, help="answer length cap (default 32; quick 8)")
    g.add_argument("--kl-positions", type=int, default=16, help="answer positions for top-1/KL (default 16)")
    g.add_argument(
        "--scaling",
        metavar="LIST",
        help=f"TTFT-vs-length points NxT: N chunks of exactly T tokens (default {FULL['scaling']}; 'none' to skip)",
    )
    g.add_argument(
        "--floor",
        nargs="?",
        const="12x630",
        metavar="LIST",
        help="floor benchmark at points NxT (bare: 12x630): each policy's TTFT beside its floor (chunk "
        "reads + moving them to the device + transformers' forward of the non-cached tokens over a "
        "prefix cache + recomputed pairs at full_prefill's rate) and op counts; floor.csv",
    )
    g.add_argument("--chunks", type=int, metavar="N", help="add scaling points of N chunks, one per --chunk-tokens")
    g.add_argument("--chunk-tokens", metavar="LIST", help="chunk lengths for --chunks, e.g. 256,512")
    g.add_argument(
        "--sweep-policies",
        default=DEFAULT_SWEEP_POLICIES,
        metavar="LIST",
        help=f"policies swept over --sweep-ratios (default {DEFAULT_SWEEP_POLICIES}; 'none' to skip)",
    )
    g.add_argument(
        "--sweep-ratios",
        metavar="LIST",
        help=f"recompute ratios (default {FULL['sweep_ratios']}; quick: {QUICK['sweep_ratios']})",
    )
    g.add_argument(
        "--sweep-limit", type=int, metavar="N", help="examples in the sweep (default 3; quick 1; 0: no sweep)"
    )
    g.add_argument(
        "--sweep-data",
        choices=("synthetic", "data"),
        default="synthetic",
        help="data set of the sweep when both are given (default synthetic)",
    )
    g.add_argument("--synthetic-passages", type=int, help="passages per synthetic item, >= 3 (default 6; quick 3)")
    g.add_argument(
        "--synthetic-types",
        metavar="LIST",
        help="question types of the synthetic items, round-robin (default: single_hop,two_hop,"
        "cross_passage); e.g. single_hop alone measures QA where the model itself can answer",
    )
    g.add_argument(
        "--synthetic-passage-tokens", type=int, help="tokens per synthetic passage, >= 30 (default 200; quick 60)"
    )
    g.add_argument(
        "--check-items",
        type=int,
        metavar="N",
        help="with --synthetic: full_prefill alone on N single-hop items of their own seed, to check "
        "that the model can answer them (default 24; quick 2; 0 to skip)",
    )
    g.add_argument("--no-footprint", action="store_true", help="skip the KV disk footprint measurement")
    g.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run in --out: the QA examples its journal holds are kept, not "
        "run again (same options; --limit may grow)",
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 2 examples, 3 passages cut to their first 40 words, "
        "8 new tokens, 1 repeat, tiny scaling and sweep",
    )
    g = p.add_argument_group("model and output")
    g.add_argument("--model", help=MODEL_HELP)
    g.add_argument("--device", default="auto", help="comma-separated devices; 'auto' = cpu, plus cuda if present")
    g.add_argument("--dtype", default=DEFAULT_COMPUTE_DTYPE, help=f"compute dtype (default {DEFAULT_COMPUTE_DTYPE})")
    g.add_argument(
        "--storage-dtype",
        default=DEFAULT_STORAGE_DTYPE,
        choices=STORAGE_DTYPES,
        help="format the chunks' K/V are stored in (default float16; int8/int4/float8_e4m3fn: packed)",
    )
    g.add_argument(
        "--chunk-anchor",
        default="auto",
        choices=("auto", "none"),
        help="precompute chunks behind the model's attention-sink token (auto, the default) "
        "or alone from position 0 (none)",
    )
    g.add_argument(
        "--kvlink-adapter",
        default="default",
        metavar="default|links|auto|none|DIR",
        help="KVLink adapter of the trained kvlink runs (default: the one found for the model, if any, "
        "as KVRag(policy='kvlink') loads it; links: links-only adapters only; none: untrained); an "
        "adapter with LoRA weights gets a model of its own, the reference and every other policy "
        "stay on the base model",
    )
    g.add_argument(
        "--hot-cache",
        default="0",
        metavar="BYTES|auto",
        help="KVRag(hot_cache=...): bytes of served chunk K/V kept in memory on the compute device "
        "(default 0: every run reads its chunks from disk, the cold path; 'auto' = KVRag's default, "
        "then the timed runs after the warm-up are served from memory)",
    )
    g.add_argument(
        "--prefix-cache",
        type=int,
        default=DEFAULT_PREFIX_CACHE,
        metavar="BYTES",
        help="KVRag(prefix_cache=...): bytes of exact prompt-prefix K/V (the text before the first "
        f"passage) kept in memory for the fused prefills (default {DEFAULT_PREFIX_CACHE}, as KVRag; "
        "0: every fused prefill computes it; full_prefill never uses it)",
    )
    g.add_argument("--cache-dir", help="KV store directory (default: a temporary one, deleted afterwards)")
    g.add_argument("--out", required=True, metavar="DIR", help="output directory (results.json, CSVs, plots)")
    g.add_argument(
        "--report",
        metavar="FILE",
        help="markdown report path (default: DIR/benchmarks.md); plots are copied beside it under bench/",
    )
    p.set_defaults(func=run)


def _prefix_cache(v: int) -> int:
    if v < 0:
        raise BenchError(f"--prefix-cache: expected a number of bytes >= 0, got {v}")
    return v


def _hot_cache(v: str) -> int | str:
    import torch

    from kvrag.store.hot import resolve_budget

    try:
        return v if v == "auto" else resolve_budget(int(v), torch.device("cpu"))
    except ValueError:
        raise BenchError(f"--hot-cache: expected a number of bytes >= 0 or 'auto', got {v!r}") from None


def _list(s: str | None, what: str, conv=str) -> list:
    if s is None or s.strip().lower() == "none":
        return []
    out = []
    for x in s.split(","):
        x = x.strip()
        if not x:
            continue
        try:
            out.append(conv(x))
        except ValueError:
            raise BenchError(f"{what}: cannot read {x!r}") from None
    return out


def _point(s: str) -> tuple[int, int]:
    n, sep, t = s.lower().partition("x")
    if not sep:
        raise ValueError(s)
    return int(n), int(t)


def parse_params(items: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for it in items:
        key, eq, val = it.partition("=")
        pol, dot, name = key.partition(".")
        if not eq or not dot or not pol or not name:
            raise BenchError(f"--param {it!r}: expected POLICY.KEY=VALUE, e.g. cacheblend.recompute_ratio=0.2")
        try:
            v = json.loads(val)
        except json.JSONDecodeError:
            v = val
        out.setdefault(pol, {})[name] = v
    return out


def command_line(args) -> str:
    """The run as one canonical, rerunnable command line (every option that shapes it)."""
    parts = ["kvrag", "bench"]
    for opt in (
        "data",
        "synthetic",
        "limit",
        "passages",
        "seed",
        "policies",
        "repeats",
        "max_new_tokens",
        "kl_positions",
        "scaling",
        "floor",
        "chunks",
        "chunk_tokens",
        "sweep_policies",
        "sweep_ratios",
        "sweep_limit",
        "sweep_data",
        "synthetic_passages",
        "synthetic_passage_tokens",
        "synthetic_types",
        "check_items",
        "model",
        "device",
        "dtype",
        "storage_dtype",
        "chunk_anchor",
        "kvlink_adapter",
        "hot_cache",
        "prefix_cache",
        "cache_dir",
        "out",
        "report",
    ):
        v = getattr(args, opt, None)
        if (
            v is None
            or v is False
            or (opt == "synthetic" and not v)
            or (opt == "sweep_data" and v == "synthetic")
            or (opt == "chunk_anchor" and v == "auto")
            or (opt == "kvlink_adapter" and v == "default")
            or (opt == "hot_cache" and v == "0")
            or (opt == "prefix_cache" and v == DEFAULT_PREFIX_CACHE)
        ):
            continue
        parts += [f"--{opt.replace('_', '-')}", str(v)]
    for prm in args.param:
        parts += ["--param", prm]
    for flag in ("no_footprint", "no_warmup", "quick", "resume"):
        if getattr(args, flag, False):
            parts.append(f"--{flag.replace('_', '-')}")
    return " ".join(shlex.quote(p) for p in parts)


def config_from_args(args):
    import torch

    from kvrag.bench.config import BenchConfig

    floor_only = not args.data and args.synthetic == 0
    if floor_only and not args.floor:
        raise BenchError("nothing to run: give --data FILE and/or --synthetic [N] (or --floor)")
    d = QUICK if args.quick else FULL
    pick = lambda name: getattr(args, name) if getattr(args, name, None) is not None else d[name]  # noqa: E731
    # A floor-only run measures the floor alone unless scaling points are asked for.
    scaling = _list(args.scaling if floor_only else pick("scaling"), "--scaling", _point)
    floor = _list(args.floor, "--floor", _point)
    if args.chunks is not None or args.chunk_tokens is not None:
        if args.chunks is None or args.chunk_tokens is None:
            raise BenchError("--chunks and --chunk-tokens go together (e.g. --chunks 8 --chunk-tokens 256,512)")
        for t in _list(args.chunk_tokens, "--chunk-tokens", int):
            if (args.chunks, t) not in scaling:
                scaling.append((args.chunks, t))
    devices = []
    for dev in _list(args.device, "--device"):
        if dev == "auto":
            devices += ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        elif dev.startswith("cuda") and not torch.cuda.is_available():
            raise BenchError(f"--device {dev}: CUDA is not available on this machine")
        else:
            devices.append(dev)
    if args.synthetic is None:  # bare --synthetic; written back, so the recorded command has N
        args.synthetic = 3 if args.quick else 12
    synthetic = args.synthetic
    if synthetic < 0:
        raise BenchError(f"--synthetic must be >= 0, got {synthetic}")
    for opt in ("limit", "passages"):  # None = all; 0 would run nothing, < 0 slice from the end
        v = getattr(args, opt)
        if v is not None and v < 1:
            raise BenchError(f"--{opt} must be >= 1 (leave it out for all), got {v}")
    check_outputs(args)
    try:
        return BenchConfig(
            out=args.out,
            data=args.data,
            synthetic=synthetic,
            policies=_list(args.policies, "--policies"),
            params=parse_params(args.param),
            limit=pick("limit"),
            passages=pick("passages"),
            passage_words=d["passage_words"],
            repeats=pick("repeats"),
            max_new_tokens=pick("max_new_tokens"),
            kl_positions=args.kl_positions,
            scaling=scaling,
            floor=floor,
            sweep_policies=_list(args.sweep_policies, "--sweep-policies"),
            sweep_ratios=_list(pick("sweep_ratios"), "--sweep-ratios", float),
            sweep_limit=pick("sweep_limit"),
            sweep_data=args.sweep_data,
            synthetic_passages=pick("synthetic_passages"),
            synthetic_passage_tokens=pick("synthetic_passage_tokens"),
            check_items=pick("check_items"),
            **({"synthetic_types": _list(args.synthetic_types, "--synthetic-types")} if args.synthetic_types else {}),
            devices=list(dict.fromkeys(devices)) or ["cpu"],
            model=args.model,
            dtype=args.dtype,
            storage_dtype=args.storage_dtype,
            chunk_anchor=args.chunk_anchor,
            kvlink_adapter=args.kvlink_adapter,
            hot_cache=_hot_cache(args.hot_cache),
            prefix_cache=_prefix_cache(args.prefix_cache),
            seed=args.seed,
            footprint=not args.no_footprint,
            warmup=not args.no_warmup,
            cache_dir=args.cache_dir,
            report=args.report,
            command=command_line(args),
            quick=args.quick,
            resume=args.resume,
        )
    except ValueError as e:
        raise BenchError(_option_names(str(e), args)) from None


def _option_names(msg: str, args) -> str:
    """'limit must be >= 1 ...' (a BenchConfig field) -> '--limit must be >= 1 ...'."""
    m = re.match(r"(\w+) must ", msg)
    if m and hasattr(args, m.group(1)):
        return f"--{m.group(1).replace('_', '-')}{msg[len(m.group(1)) :]}"
    return msg


def check_outputs(args) -> None:
    """Where the run writes (--out, --report and the plots beside it, --cache-dir) must be
    writable now: finding out after an hour of benchmarking loses the results."""
    from kvrag.outpaths import check_dir, check_file

    out = check_dir(args.out, "--out", BenchError)
    if args.report:
        report = check_file(args.report, "--report", BenchError)
        if report.resolve().parent != out.resolve():
            check_dir(report.resolve().parent / "bench", "--report (plots go beside it under bench/)", BenchError)
    if args.cache_dir:
        check_dir(args.cache_dir, "--cache-dir", BenchError)
    for name in ("results.json",) + (() if args.report else ("benchmarks.md",)):
        if (out / name).is_dir():
            raise BenchError(f"--out {out}: {out / name} is a directory")


def run(args) -> int:
    import time
    from pathlib import Path

    from kvrag.bench.outputs import write_outputs
    from kvrag.bench.report import write_report
    from kvrag.bench.runner import Bench

    cfg = config_from_args(args)
    say = lambda s: print(s, flush=True)  # noqa: E731
    try:
        # Validates policies, parameters and the data file before the model loads.
        bench = Bench(cfg, progress=say)
    except (FileNotFoundError, ValueError) as e:
        raise BenchError(str(e)) from None
    result = bench.run()
    files = write_outputs(result, cfg.out)
    report = write_report(result, files, Path(cfg.report) if cfg.report else cfg.out / "benchmarks.md")
    say("")
    for t in result["targets"]:
        say(
            f"  [{t['status']:>4}] {t['where']}: {t['policy']} {t['metric']} {t['target']} "
            f"(measured {t['measured'] if t['measured'] is None else round(t['measured'], 3)})"
        )
    say(
        f"\n{len(result['records'])} records in {time.strftime('%M:%S', time.gmtime(result['meta']['wall_s']))} "
        f"-> {cfg.out}/results.json; report {report}"
    )
    failed = [r for r in result["records"] if r.get("error")]
    if failed:
        # A failing policy is a result (its row says so), but a run where nothing ran is not.
        say(f"{len(failed)} of {len(result['records'])} runs failed, e.g. {failed[0]['label']}: {failed[0]['error']}")
        if len(failed) == len(result["records"]):
            return 1
    return 0
