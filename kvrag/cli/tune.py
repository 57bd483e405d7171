"""``kvrag tune``: adapt a model to chunk reuse on a corpus (KVLink links + LoRA), resumably.

``kvrag train kvlink`` trains on one labelled QA file. ``tune`` trains on a *mixture* of
sources (:mod:`kvrag.policies.kvlink.data`): the user's text files (``--text``), the chunks
they ingested (``--store``), labelled QA (``--qa``, ``--musique``: the "train" half by question
hash), kvrag's synthetic generator (``--synthetic``) and the prose on every machine
(``--sources pydoc,usr-share-doc,man``), with self-distilled targets where there are no labels.
It is a separate command rather than more options on ``train kvlink`` because its inputs are
several sources and its defaults differ (distillation, 2-10 passages, checkpoints).

A run is resumable: checkpoints every ``--checkpoint-every`` steps and when ``--max-minutes``
ends a sitting; ``--resume`` continues from the one in ``--out``, computing what an
uninterrupted run does. The adapter is written to ``$KVRAG_HOME/kvlink/<model key>/`` by
default, where ``KVRag`` finds and applies it for that model, with ``kvlink.json`` recording
the command, the sources (counts, sha256) and the steps. ``--eval`` then measures, on data the
run did not train on, gold-answer containment, gold log-likelihood and KL to ``full_prefill``
for full_prefill, naive_reuse, cacheblend and kvlink (the benchmark's own runner and metrics).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvrag.cli.train import DefaultsHelp, add_training_options, config_from_args, print_losses

EVAL_POLICIES = ("full_prefill", "naive_reuse", "cacheblend", "kvlink")


def register(sub) -> None:
    p = sub.add_parser(
        "tune",
        help="adapt a model to chunk reuse on your corpus (KVLink links + LoRA; resumable)",
        description="Train a KVLink adapter on a mixture of text sources with self-distilled targets "
        "(the base model's own full-prefill answers), resumably; the result is applied by "
        "default for that model. --eval measures it on data not trained on.",
        formatter_class=DefaultsHelp,
    )
    g = p.add_argument_group("sources")
    g.add_argument(
        "--text",
        nargs="+",
        action="extend",
        default=None,
        metavar="PATH",
        help="text files (or directories of .txt/.md/.rst) cut into passages",
    )
    g.add_argument("--store", default=None, metavar="DIR", help="a kvrag chunk store: its ingested chunk texts")
    g.add_argument(
        "--qa",
        default=None,
        metavar="FILE",
        help="labelled QA file (kvrag.qa.files formats); trains on its 'train' half by question hash",
    )
    g.add_argument(
        "--musique",
        default=None,
        metavar="FILE",
        help="MuSiQue-style QA file (e.g. ../shared/data/musique_dev.json); its 'train' half",
    )
    g.add_argument(
        "--synthetic",
        type=int,
        default=0,
        metavar="N",
        help="N items of kvrag's synthetic QA generator (seed 1000 + --seed: not the benchmark's seed 0)",
    )
    g.add_argument(
        "--sources",
        default="pydoc,usr-share-doc,man",
        help="machine prose to add: any of pydoc, usr-share-doc, man; 'none' for none",
    )
    g.add_argument("--weights", default="", help="source=weight,... (default: every source equally)")
    g.add_argument("--passage-tokens", type=int, default=200, help="passage size for text sources (approx. tokens)")
    g.add_argument("--max-pool", type=int, default=20000, help="at most this many passages per source")
    g.add_argument(
        "--p-without", type=float, default=0.25, help="share of prompts without the passage the instruction is about"
    )
    g.add_argument("--answer-tokens", type=int, default=24, help="length of the teacher's answers (self-distillation)")
    add_training_options(p)
    # Ten passages of ~200 tokens are ~2.2k tokens with the template and links.
    p.set_defaults(steps=500, max_tokens=4096)
    p.add_argument("--docs", type=int, default=10, help="most passages per prompt")
    p.add_argument("--min-docs", type=int, default=2, help="fewest passages per prompt")
    p.add_argument(
        "--objective",
        choices=("answer", "distill"),
        default="distill",
        help="distill: KL to the base model's full prefill on the target tokens; answer: cross-entropy",
    )
    r = p.add_argument_group("run")
    r.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.set_defaults(checkpoint_every=50)
    e = p.add_argument_group("evaluation")
    e.add_argument("--eval", action="store_true", help="after training, evaluate on the held-out splits")
    e.add_argument("--eval-only", action="store_true", help="evaluate the adapter in --out without training")
    e.add_argument(
        "--eval-data", default=None, metavar="FILE", help="also evaluate on this QA file (a source not trained on)"
    )
    e.add_argument("--eval-limit", type=int, default=20, help="items per evaluation set")
    e.add_argument(
        "--eval-policies",
        default=",".join(EVAL_POLICIES),
        help="policies compared (full_prefill, the reference, always runs)",
    )
    e.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.set_defaults(func=run)


def _weights(s: str) -> dict[str, float]:
    from kvrag.policies.kvlink.adapter import KVLinkError

    out = {}
    for part in filter(None, (x.strip() for x in s.split(","))):
        name, sep, w = part.partition("=")
        try:
            out[name.strip()] = float(w)
        except ValueError:
            sep = ""
        if not sep:
            raise KVLinkError(f"--weights: expected source=number, got {part!r}")
    return out


def _machine_sources(s: str) -> list[str]:
    from kvrag.policies.kvlink.adapter import KVLinkError
    from kvrag.policies.kvlink.data import MACHINE_SOURCES

    names = [] if s.strip() == "none" else [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in MACHINE_SOURCES]
    if bad:
        raise KVLinkError(f"--sources: unknown {bad}; choose from {', '.join(MACHINE_SOURCES)} or 'none'")
    return names


def _eval_policies(args) -> list[str]:
    from kvrag.policies import policy_names
    from kvrag.policies.kvlink.adapter import KVLinkError

    names = [p.strip() for p in args.eval_policies.split(",") if p.strip()]
    bad = [p for p in names if p not in policy_names()]
    if bad or not names:
        raise KVLinkError(f"--eval-policies: unknown {bad or names}; registered: {', '.join(policy_names())}")
    return names


def check_args(args) -> None:
    """Every check that needs no model (a typo must not cost a model load)."""
    from kvrag.policies.kvlink.adapter import KVLinkError

    for flag in ("qa", "musique", "eval_data"):
        v = getattr(args, flag)
        if v is not None and not Path(v).expanduser().is_file():
            raise KVLinkError(f"--{flag.replace('_', '-')} {v!r} does not exist")
    _eval_policies(args)
    if args.store is not None and not (Path(args.store).expanduser() / "index" / "cache.db").is_file():
        # Opening another directory as a store would create one there.
        raise KVLinkError(f"--store {args.store!r} is not a kvrag chunk store (no index/cache.db in it)")
    args.text = args.text or []
    for t in args.text:
        if not Path(t).expanduser().exists():
            raise KVLinkError(f"--text {t!r} does not exist")
    for name, v, low in (
        ("--synthetic", args.synthetic, 0),
        ("--passage-tokens", args.passage_tokens, 16),
        ("--max-pool", args.max_pool, 1),
        ("--answer-tokens", args.answer_tokens, 1),
        ("--eval-limit", args.eval_limit, 1),
    ):
        if v < low:
            raise KVLinkError(f"{name} must be >= {low}, got {v}")


def build_data(args, handle):
    """(pools, qa, held-out pools) of the sources named on the command line, and their file
    digests: the train split of every source, the eval split kept for ``--eval``."""
    from kvrag.model.digests import sha256_file
    from kvrag.policies.kvlink import data as D

    n = args.passage_tokens
    raw: dict[str, list[str]] = {}
    files: dict[str, str] = {}
    if args.text:
        raw["text"] = D.file_passages(args.text, n)
        for t in args.text:
            if Path(t).is_file():
                files[str(t)] = sha256_file(Path(t))
    if args.store:
        from kvrag.store import DiskStore

        raw["store"] = D.store_passages(DiskStore(args.store))
    readers = {"pydoc": D.pydoc_passages, "usr-share-doc": D.usr_share_doc_passages, "man": D.man_passages}
    for name in _machine_sources(args.sources):
        raw[name] = readers[name](n)
        if not raw[name]:
            print(f"source {name}: no passages on this machine; skipped", flush=True)
    pools, held = {}, {}
    for name, ps in raw.items():
        ps = list(dict.fromkeys(ps))
        pools[name] = D.pool_split(ps, "train")[: args.max_pool]
        held[name] = D.pool_split(ps, "eval")
    qa = {}
    for name, path in (("musique", args.musique), ("qa", args.qa)):
        if path:
            qa[name] = D.qa_items(path, "train")
            files[str(path)] = sha256_file(Path(path))
    if args.synthetic:
        # Seed 1000 + --seed: `kvrag bench --synthetic` evaluates on seed 0 (and the tests use 7).
        qa["synthetic"] = D.synthetic_items(
            args.synthetic, D.SYNTHETIC_SEED + args.seed, lambda s: len(handle.encode(s))
        )
    return pools, qa, held, files


def run(args) -> int:
    import torch

    from kvrag.model import ModelHandle
    from kvrag.outpaths import check_dir
    from kvrag.paths import default_home
    from kvrag.policies.kvlink import data as D
    from kvrag.policies.kvlink.adapter import META_FILE, KVLinkError, default_adapter_dirs
    from kvrag.policies.kvlink.train import command_line, train_kvlink

    cfg = config_from_args(args, "kvrag tune mixture")  # checks --resume/--force and --checkpoint-every too
    check_args(args)
    weights = _weights(args.weights)
    _machine_sources(args.sources)
    if args.out is not None:
        out = check_dir(args.out, "--out", KVLinkError)
        if (out / META_FILE).exists() and not (args.force or args.resume or args.eval_only):
            raise KVLinkError(
                f"--out {out} already holds a KVLink adapter; pass --resume to continue its run "
                "or --force to overwrite it"
            )
    else:
        check_dir(default_home() / "kvlink", "the adapter directory ($KVRAG_HOME/kvlink)", KVLinkError)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading model on {args.device} ...", flush=True)
    handle = ModelHandle.load(args.model, dtype=args.dtype, device=args.device)
    out = Path(args.out).expanduser() if args.out is not None else default_adapter_dirs(handle)[0]
    pools, qa, held, files = build_data(args, handle)
    if not args.eval_only:
        mix = D.Mixture(
            pools, qa, min_docs=args.min_docs, max_docs=args.docs, p_without=args.p_without, weights=weights
        )
        meta = {
            **mix.describe(),
            "files": files,
            "passage_tokens": args.passage_tokens,
            "split": {
                "qa_eval_percent": D.EVAL_PERCENT,
                "pool_eval_percent": D.POOL_EVAL_PERCENT,
                "trained_on": "train",
                "key": "sha256 of the question (QA) / passage text (pools)",
            },
        }
        for name, d in meta["sources"].items():
            print(f"source {name}: " + ", ".join(f"{k} {v}" for k, v in d.items() if k != "sha256"), flush=True)
        sampler = D.TaskSampler(
            handle,
            mix,
            link_tokens=cfg.link_tokens,
            max_docs=cfg.max_docs,
            answer_tokens=args.answer_tokens,
            max_passage_chars=cfg.max_passage_chars,
            max_tokens=cfg.max_tokens,
        )
        res = train_kvlink(
            handle,
            cfg,
            out,
            command=command_line(),
            force=args.force,
            sampler=sampler,
            data_meta=meta,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            bar=True,
            progress=lambda m: print(m, flush=True),
        )
        print_losses(res)
        if not res.meta["complete"]:
            print(f"{len(res.losses)}/{cfg.steps} steps done; run again with --resume to go on", flush=True)
    if args.eval or args.eval_only:
        evaluate(args, out, held)
    return 0


# ---- evaluation on what was not trained on -------------------------------------------------
def eval_sets(args, held: dict[str, list[str]], out: Path) -> list[tuple[str, Path, str]]:
    """(name, QA file, what it is) of every held-out set: the "eval" half of ``--musique`` /
    ``--qa``, cloze questions on the held-out passages of each text source, ``--eval-data``."""
    from kvrag.policies.kvlink import data as D
    from kvrag.qa.files import parse_items, read_items

    d = out / "eval"
    d.mkdir(parents=True, exist_ok=True)
    sets = []
    for name, path in (("musique", args.musique), ("qa", args.qa)):
        if path:
            raw = read_items(path)
            # Split by the parsed question, exactly as training's qa_items did.
            items = [it for it, rec in zip(raw, parse_items(raw, str(path))) if D.split_of(rec.question) == "eval"]
            f = d / f"{name}_eval.json"
            f.write_text(json.dumps(items), encoding="utf-8")
            sets.append((name, f, f"the 'eval' half of {path} by question hash ({len(items)} items)"))
    for name, pool in held.items():
        items = D.cloze_items(pool, args.eval_limit, args.seed, docs=min(4, max(2, len(pool))))
        if items:
            f = d / f"{name}_cloze_eval.json"
            f.write_text(json.dumps(items), encoding="utf-8")
            sets.append((f"{name}_cloze", f, f"cloze questions on {len(pool)} held-out {name} passages"))
    if args.eval_data:
        sets.append((Path(args.eval_data).stem, Path(args.eval_data), f"{args.eval_data} (a source not trained on)"))
    return sets


def evaluate(args, out: Path, held: dict[str, list[str]]) -> dict:
    """Bench the adapter in ``out`` against full_prefill, naive_reuse and cacheblend on every
    held-out set; writes ``out/eval/<set>/`` (the benchmark's files) and ``out/eval.json``."""
    from kvrag.bench.config import BenchConfig
    from kvrag.bench.outputs import write_outputs
    from kvrag.bench.report import write_report
    from kvrag.bench.runner import Bench
    from kvrag.policies.kvlink.adapter import META_FILE, KVLinkError

    if not (out / META_FILE).is_file():
        raise KVLinkError(f"no adapter to evaluate in {out}")
    trained = json.loads((out / META_FILE).read_text(encoding="utf-8"))
    trained_on = trained.get("data") or {"data_file": trained.get("config", {}).get("data")}
    names = ", ".join(f"{k} ({v.get('passages', v.get('items'))})" for k, v in trained_on.get("sources", {}).items())
    header = (
        f"Adapter {out} trained on: {names or trained_on} -- {trained.get('steps')} steps; "
        "evaluated on data it was not trained on:"
    )
    print(header, flush=True)
    report = {"adapter": str(out), "trained_on": trained_on, "steps": trained.get("steps"), "sets": []}
    for name, path, what in eval_sets(args, held, out):
        cfg = BenchConfig(
            out=out / "eval" / name,
            data=str(path),
            policies=_eval_policies(args),
            repeats=1,
            limit=args.eval_limit,
            max_new_tokens=args.eval_max_new_tokens,
            devices=[args.device],
            model=args.model,
            dtype=args.dtype,
            kvlink_adapter=str(out),
            footprint=False,
            warmup=False,
            seed=args.seed,
            command=f"kvrag tune --eval ({name})",
        )
        res = Bench(cfg, progress=lambda m: print(m, flush=True)).run()
        files = write_outputs(res, cfg.out)
        md = write_report(res, files, cfg.out / "benchmarks.md")
        md.write_text(f"{header}\n{name}: {what}\n\n" + md.read_text(encoding="utf-8"), encoding="utf-8")
        rows = [
            {k: r.get(k) for k in ("label", "n", "gold_acc_hits", "gold_acc", "gold_nll", "kl", "speedup")}
            for r in res["summary"]
            if r["scenario"] == "qa"
        ]
        report["sets"].append({"name": name, "file": str(path), "what": what, "rows": rows})
        print(f"\n{name}: {what}")
        print(f"  {'policy':26s} {'n':>3s} {'acc':>6s} {'gold NLL':>9s} {'KL':>8s}")
        for r in rows:
            f = lambda x, s=".3f": "-" if x is None else format(x, s)  # noqa: E731
            print(
                f"  {r['label']:26s} {r['n']:3d} {f(r['gold_acc'], '.2f'):>6s} {f(r['gold_nll']):>9s} "
                f"{f(r['kl'], '.4f'):>8s}"
            )
    (out / "eval.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    return report
