"""Storage formats against the float16 store: bytes per token, read + expand time per chunk,
and the quality each format keeps, per policy.

For each ``--formats`` entry a store of its own is filled with the same passages (one KVRag
per format, same model). Reported per format:

- ``bytes_per_token``: K/V bytes per token by the format's definition, and ``blob_bytes_per_token``
  measured (the store's bytes on disk over its tokens: headers and texts included);
- ``read_expand_ms``: per chunk, the median over ``--repeats`` of a store read (page cache:
  the files were just written) and the expansion to the compute dtype on the compute device;
- per policy: the mean gold-answer NLL (teacher forced, nats per token) and its gap to the
  float16 store's, the mean KL of the answer tokens' distributions from the float16 store's,
  and the share of items whose greedy first answer token is the float16 store's.

Items: ``--data`` (a QA file ``kvrag.bench.examples.load_examples`` reads) or ``--synthetic N``
made-up items (a code hidden in one of several filler passages; small enough for the tiny
random-weight test model, on which the numbers say nothing of quality: only that it runs).

    .venv/bin/python benchmarks/kv_formats.py --model HuggingFaceTB/SmolLM2-135M-Instruct \\
        --synthetic 8 --policies naive_reuse,cacheblend --out kv_formats.json
    .venv/bin/python benchmarks/kv_formats.py --tiny --synthetic 2   # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvrag import KVRag
from kvrag.layout.prompt import rag_prompt
from kvrag.store.kv_format import bytes_per_token

FILLER = (
    "The river runs past the old mill and the market square, where traders meet every morning. "
    "Nobody remembers who built the bridge, but everyone agrees it has stood for a long time."
)


def synthetic_items(n: int, passages: int, seed: int = 0) -> list[tuple[list[str], str, str]]:
    """``n`` items (passages, question, answer): one passage states a code, the rest are filler."""
    rng = random.Random(seed)
    words = ["amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper"]
    out = []
    for i in range(n):
        code = rng.choice(words)
        ps = [f"Passage {i}.{j}: {FILLER}" for j in range(passages)]
        ps[rng.randrange(passages)] = f"Passage {i}: the code word of archive {i} is {code}. {FILLER}"
        out.append((ps, f"What is the code word of archive {i}?", code))
    return out


def data_items(path: str, limit: int, passages: int) -> list[tuple[list[str], str, str]]:
    """The first ``limit`` items of a QA file, each with its first ``passages`` passages."""
    from kvrag.bench.examples import load_examples

    return [(list(e.passages), e.question, e.answers[0]) for e in load_examples(path, limit=limit, passages=passages)]


def answer_logits(rag: KVRag, prompt, answer_ids: list[int], policy: str) -> torch.Tensor:
    """Teacher-forced log-probabilities [T, V] of the answer's tokens after the prompt."""
    logits, _ = rag.continuation_logits(prompt, answer_ids, policy=policy)
    return logits[: len(answer_ids)].float().log_softmax(-1)


def read_expand_ms(rag: KVRag, keys: list[str], repeats: int) -> float:
    """Median ms per chunk of a store read plus its expansion on the compute device."""
    dev, dt = rag.handle.device, rag.handle.dtype
    times = []
    for _ in range(repeats):
        for key in keys:
            t = time.perf_counter()
            entry = rag.store.get(key, rag.fingerprint, pin_memory=dev.type == "cuda")
            if entry is None:
                continue
            e = entry.expanded(dev, dt)
            keys_dev = e.keys.to(device=dev, dtype=dt)  # a float entry moves here, as the fusion engine does
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
            del keys_dev
    return 1e3 * statistics.median(times) if times else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model id or path")
    ap.add_argument("--tiny", action="store_true", help="the tiny random-weight test model (kvrag.testing)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="compute dtype")
    ap.add_argument("--formats", default="float16,int8,float8_e4m3fn,int4")
    ap.add_argument("--policies", default="naive_reuse,cacheblend")
    ap.add_argument("--data", help="a QA file (else --synthetic)")
    ap.add_argument("--synthetic", type=int, default=4, help="made-up items when no --data")
    ap.add_argument("--passages", type=int, default=4, help="passages per item (a --data item: its first ones)")
    ap.add_argument("--limit", type=int, default=20, help="items read from --data")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the read + expand timing")
    ap.add_argument(
        "--adapter",
        choices=("none", "default"),
        default="none",
        help="KVLink adapter: none (every policy on the base model) or the model's default one "
        "(its LoRA makes a model of its own: run --policies kvlink alone with it)",
    )
    ap.add_argument("--out", help="JSON results")
    args = ap.parse_args()
    formats = args.formats.split(",")
    if "float16" not in formats:
        formats.insert(0, "float16")  # the reference
    policies = args.policies.split(",")
    if args.tiny:
        from kvrag.testing import tiny_llama

        model = tiny_llama(seed=0)
    elif args.model:
        from kvrag.model import ModelHandle

        model = ModelHandle.load(args.model, dtype=args.dtype, device=args.device)
    else:
        ap.error("--model or --tiny")
    if args.data:
        items = data_items(args.data, args.limit, args.passages)
    else:
        items = synthetic_items(args.synthetic, args.passages)
    shape = (model.n_layers, model.n_kv_heads, model.head_dim)
    results: dict[str, dict] = {}
    ref: dict[tuple[str, int], torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats:
            adapter = None if args.adapter == "none" else "default"
            rag = KVRag(model, cache_dir=Path(tmp) / fmt, storage_dtype=fmt, kvlink_adapter=adapter, hot_cache=0)
            passages = sorted({p for ps, _, _ in items for p in ps})
            keys = rag.precompute(passages)
            tokens = sum(len(rag.chunk_ids(p)) for p in passages)
            rec: dict = {
                "bytes_per_token": bytes_per_token(fmt, *shape),
                "blob_bytes_per_token": rag.store.stats()["bytes"] / tokens,
                "read_expand_ms": read_expand_ms(rag, keys, args.repeats),
                "policies": {},
            }
            for policy in policies:
                nll, kl, kept = [], [], []
                for i, (ps, question, answer) in enumerate(items):
                    prompt = rag_prompt(rag.tokenizer, ps, question)
                    ids = rag.handle.encode(" " + answer)
                    lp = answer_logits(rag, prompt, ids, policy)
                    nll.append(-float(lp[torch.arange(len(ids)), torch.tensor(ids)].mean()))
                    if fmt == "float16":
                        ref[(policy, i)] = lp
                    base = ref[(policy, i)]
                    kl.append(float((base.exp() * (base - lp)).sum(-1).mean()))
                    kept.append(int(lp[0].argmax()) == int(base[0].argmax()))
                rec["policies"][policy] = {
                    "gold_nll": statistics.mean(nll),
                    "kl_vs_float16": statistics.mean(kl),
                    "first_token_kept": statistics.mean(kept),
                }
            results[fmt] = rec
            rag.store.close()
    for rec in results.values():
        for policy, q in rec["policies"].items():
            q["gold_nll_gap"] = q["gold_nll"] - results["float16"]["policies"][policy]["gold_nll"]
    f16 = results["float16"]["bytes_per_token"]
    print(
        f"{'format':<14} {'B/token':>9} {'x f16':>6} {'blob B/tok':>10} {'read+exp ms':>11}  policy: NLL gap, KL, kept"
    )
    for fmt, rec in results.items():
        pol = "; ".join(
            f"{p}: {q['gold_nll_gap']:+.4f}, {q['kl_vs_float16']:.2e}, {q['first_token_kept']:.0%}"
            for p, q in rec["policies"].items()
        )
        print(
            f"{fmt:<14} {rec['bytes_per_token']:>9.0f} {rec['bytes_per_token'] / f16:>6.3f} "
            f"{rec['blob_bytes_per_token']:>10.0f} {rec['read_expand_ms']:>11.2f}  {pol}"
        )
    if args.out:
        meta = {
            "model": args.model or "tiny",
            "device": args.device,
            "dtype": args.dtype,
            "items": len(items),
            "adapter": args.adapter,
        }
        Path(args.out).write_text(json.dumps({"setup": meta, "formats": results}, indent=2))


if __name__ == "__main__":
    main()
