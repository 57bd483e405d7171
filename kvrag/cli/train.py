"""``kvrag train <method>``: fine-tune a model for a reuse policy that needs training.

Only ``kvrag train kvlink`` exists: LoRA (or no model change) + link-token embeddings trained
with KVLink's attention mask, saved as an adapter keyed to the model (see
``kvrag.policies.kvlink.train``). Use the result with ``KVRag(..., kvlink_adapter="auto" or DIR)``.
"""

from __future__ import annotations

import argparse

from kvrag.cli._options import MODEL_HELP


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help unless the help states its default itself or
    there is none to show (None, False, a required option)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.required or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="fine-tune a model for a policy that needs training (kvlink)",
        description="Fine-tune a model for a policy that needs training (kvlink); the policy "
        "finds the result under $KVRAG_HOME.",
    )
    methods = p.add_subparsers(dest="method", metavar="METHOD", required=True)
    k = methods.add_parser(
        "kvlink",
        help="train KVLink link tokens (+ a LoRA adapter) with the link-token attention mask",
        description="Fine-tune for KVLink: each document attends to itself only, K link tokens after "
        "each document and the question/answer attend to everything before them; loss on "
        "the answer tokens. Writes link embeddings, LoRA weights and kvlink.json (command, "
        "steps, losses) to --out.",
        formatter_class=DefaultsHelp,
    )
    k.add_argument(
        "--data",
        required=True,
        help="QA examples: JSON list or JSON lines of "
        "{question, answers, ctxs: [{title, text}]}; MuSiQue, HotpotQA/2Wiki, LongBench and SQuAD "
        "files as released too",
    )
    add_training_options(k)
    k.add_argument("--docs", type=int, default=3, help="passages per training prompt (one holds the answer)")
    k.add_argument(
        "--min-docs",
        type=int,
        default=0,
        help="> 0: each prompt draws its passage count "
        "uniformly from [--min-docs, --docs] (trains every link row up to --docs); 0 = always --docs",
    )
    k.add_argument(
        "--passage-order",
        choices=("shuffle", "source"),
        default="shuffle",
        help="shuffle: the prompt's passages in random order (paper); source: in the example's "
        "own order (for consecutive chunks of one document)",
    )
    k.add_argument("--holdout", type=int, default=0, help="never train on the last N examples (for evaluation)")
    k.add_argument(
        "--objective",
        choices=("answer", "distill"),
        default="answer",
        help="answer: cross-entropy on the gold answer (paper); distill: KL to the base "
        "model's full-prefill distribution on the answer tokens",
    )
    k.set_defaults(func=run_kvlink)


def add_training_options(k) -> None:
    """The options ``kvrag train kvlink`` and ``kvrag tune`` share: model, output, LoRA and
    link-table shape, optimizer, budget."""
    k.add_argument("--model", default=None, help=MODEL_HELP)
    k.add_argument("--dtype", default="float32", help="training dtype of the base model")
    k.add_argument(
        "--out",
        default=None,
        help="adapter directory (default: $KVRAG_HOME/kvlink/<model key>/, where KVRag(policy='kvlink') finds it)",
    )
    k.add_argument("--force", action="store_true", help="overwrite an existing adapter in --out")
    k.add_argument("--steps", type=int, default=200, help="optimizer steps")
    k.add_argument(
        "--batch", type=int, default=1, help="examples per step, run as one packed forward (see --accumulate)"
    )
    k.add_argument(
        "--accumulate",
        action="store_true",
        help="run a step's --batch examples one forward each, accumulating gradients: the same "
        "step up to float rounding, less memory, slower on a GPU",
    )
    k.add_argument(
        "--lora-rank",
        type=int,
        default=8,
        help="LoRA rank; 0 = train link embeddings only "
        "(the model, its fingerprint and its chunk caches stay unchanged)",
    )
    k.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank)")
    k.add_argument(
        "--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated module names that get LoRA"
    )
    k.add_argument("--link-tokens", type=int, default=5, help="link tokens per document (paper: 0, 1, 5)")
    k.add_argument("--max-docs", type=int, default=10, help="rows of the per-document link table")
    k.add_argument("--max-passage-chars", type=int, default=0, help="truncate passages (0 = keep whole)")
    k.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate")
    k.add_argument("--link-lr", type=float, default=1e-3, help="link-embedding learning rate")
    k.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (then cosine decay)")
    k.add_argument("--max-tokens", type=int, default=2048, help="skip training sequences longer than this")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--log-every", type=int, default=10)
    k.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="stop (and save) after this much training time; 0 = run all --steps (SIGTERM "
        "and Ctrl-C stop and save too, after the current step)",
    )
    k.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    k.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="checkpoint (in --out/checkpoint/) every N "
        "steps and at the end; 0: only when --max-minutes ends the run early",
    )
    k.add_argument(
        "--init",
        default=None,
        metavar="ADAPTER",
        help="start from this KVLink adapter directory's LoRA weights and link rows ('auto': the "
        "one KVRag(policy='kvlink') uses) to train it further, e.g. on longer prompts or other "
        "data; its model, --link-tokens and LoRA options must match, --max-docs may grow",
    )
    k.add_argument(
        "--resume",
        action="store_true",
        help="continue the run checkpointed in --out (same options; --max-minutes may differ)",
    )


def config_from_args(args, data: str):
    """The checked ``TrainConfig`` of the parsed options (errors name the option)."""
    from kvrag.policies.kvlink.adapter import KVLinkError
    from kvrag.policies.kvlink.config import TrainConfig

    if args.threads is not None and args.threads < 1:
        raise KVLinkError(f"--threads must be >= 1, got {args.threads}")
    if not args.max_minutes >= 0:  # also NaN
        raise KVLinkError(f"--max-minutes must be >= 0 (0 = run all --steps), got {args.max_minutes}")
    if args.checkpoint_every < 0:
        raise KVLinkError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.resume and args.force:
        raise KVLinkError("--resume continues the run in --out; --force would start over: pass one")
    cfg = TrainConfig(
        data=data,
        steps=args.steps,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
        link_tokens=args.link_tokens,
        max_docs=args.max_docs,
        docs=args.docs,
        min_docs=args.min_docs,
        passage_order=getattr(args, "passage_order", "shuffle"),
        max_passage_chars=args.max_passage_chars,
        holdout=getattr(args, "holdout", 0),
        objective=args.objective,
        lr=args.lr,
        link_lr=args.link_lr,
        batch=args.batch,
        batched=not args.accumulate,
        warmup=args.warmup,
        max_tokens=args.max_tokens,
        seed=args.seed,
        log_every=args.log_every,
        max_seconds=60.0 * args.max_minutes,
        init=args.init,
    )
    try:
        cfg.validate()
    except KVLinkError as e:  # name the option, not the TrainConfig field
        raise KVLinkError(_option_names(str(e), args)) from None
    return cfg


def print_losses(res) -> None:
    """Means over the first and last w steps (w <= 10 and at most half the run: never overlapping)."""
    n = len(res.losses)
    w = max(1, min(10, n // 2))
    if n >= 2:
        first, last = sum(res.losses[:w]) / w, sum(res.losses[-w:]) / w
        print(f"loss {first:.4f} (first {w} steps) -> {last:.4f} (last {w}); adapter: {res.out}")
    else:
        print(f"loss {res.losses[0]:.4f} (1 step); adapter: {res.out}" if n else f"no step trained; adapter: {res.out}")


def run_kvlink(args) -> int:
    import torch

    from kvrag.model import ModelHandle
    from kvrag.outpaths import check_dir
    from kvrag.paths import default_home
    from kvrag.policies.kvlink.adapter import META_FILE, KVLinkError
    from kvrag.policies.kvlink.data import load_qa
    from kvrag.policies.kvlink.train import command_line, train_kvlink

    # Every check before the model load (and long before the adapter is saved).
    cfg = config_from_args(args, args.data)
    items = load_qa(args.data)  # read again by train_kvlink (which records its digest); cheap
    if args.holdout >= len(items):
        raise KVLinkError(f"--holdout {args.holdout} leaves no training examples out of {len(items)} in {args.data}")
    if args.out is not None:
        out = check_dir(args.out, "--out", KVLinkError)
        if (out / META_FILE).exists() and not (args.force or args.resume):
            raise KVLinkError(
                f"--out {out} already holds a KVLink adapter; pass --force to overwrite it "
                "(or --resume to continue its run)"
            )
    else:  # $KVRAG_HOME/kvlink/<model key>/: the key needs the model, its parent does not
        check_dir(default_home() / "kvlink", "the adapter directory ($KVRAG_HOME/kvlink)", KVLinkError)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("loading model ...", flush=True)
    handle = ModelHandle.load(args.model, dtype=args.dtype)
    res = train_kvlink(
        handle,
        cfg,
        args.out,
        command=command_line(),
        force=args.force,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        progress=lambda m: print(m, flush=True),
    )
    print_losses(res)
    if not res.meta["complete"]:
        print(f"{len(res.losses)}/{cfg.steps} steps done; run again with --resume to go on", flush=True)
    return 0


def _option_names(msg: str, args) -> str:
    """'lora_rank must be >= 0 ...' (a TrainConfig field) -> '--lora-rank must be >= 0 ...'."""
    import re

    m = re.match(r"(\w+) (must|is) ", msg)
    if m and hasattr(args, m.group(1)):
        return f"--{m.group(1).replace('_', '-')}{msg[len(m.group(1)) :]}"
    return msg
