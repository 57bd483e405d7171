"""The lookup without tokenizing the whole prompt, A/B: ``ChunkLookup.pieces`` as it runs (plain
spans tokenized in context, the chunks' stored ids spliced in: ``kvrag.query.splice``) against
the whole-prompt path it replaces (the prompt tokenized whole, ``prompt_tokens``, then the
chunks aligned in it), on RAG prompts of ~4k, ~16k and ~32k tokens, timed interleaved in one
process.

The prompts are kvrag's RAG layout (``rag_prompt``, rendered with SmolLM2's chat template)
over passages of ~400 tokens cut from this repository's docs/*.md (English prose, Markdown,
code, numbers, a little Unicode). The model is the tiny random-weight llama of the tests with
SmolLM2's real tokenizer (or ``--tokenizer gemma3-270m``'s) and a context long enough for
32k: the lookup's cost depends on the tokenizer and the text, not on the weights, and the
chunks are served from the hot tier (a warm-up lookup puts them there), as every query after
the first that reads a chunk is. Both paths must give the same pieces; the run stops if not.

Per size, medians over ``--repeats``: the lookup old and new, and their parts: the whole
prompt's tokenization, the splice alone (``splice_ids``), the segmentation
(``Segmenter.split``). And the served path's host work per request, before the model runs:
the scheduler's ``submit`` counts the prompt's tokens (to refuse one past the context) and
its prefill's lookup reads them. Before: ``submit`` tokenized the whole prompt (with offsets)
and the lookup aligned the chunks in it; now: ``submit`` runs the lookup's own rule
(``KVRag.tokenize`` -> ``ChunkLookup.tokens``, the hot chunks spliced in, with the
scheduler's copy of the tokenizer) and the lookup reuses it. Results: ``--out``/results.json
and a README.md with the tables.

    .venv/bin/python benchmarks/lookup_tokenize.py                       # 4k, 16k, 32k
    .venv/bin/python benchmarks/lookup_tokenize.py --sizes 1000 --repeats 3 --out /tmp/lt
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import tokenizers
import torch
import transformers

from kvrag import KVRag
from kvrag.layout.align import chunk_spans, prompt_tokens
from kvrag.layout.prompt import rag_prompt
from kvrag.query.splice import splice_ids
from kvrag.testing import smollm2_tokenizer, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
TARGET_TOKENS, TARGET_MS = 16_000, 5.0  # the lookup at ~16k tokens should take at most 5 ms
QUESTION = "Which parts of a request does kvrag compute, and which does it read from the cache?"


def passages(tokenizer, tokens: int = 400) -> list[str]:
    """Paragraphs of docs/*.md, joined in order into passages of about ``tokens`` tokens each
    (headings, tables and code fences kept as they are: the text a RAG corpus of docs holds)."""
    out, cur, n = [], [], 0
    for md in sorted((ROOT / "docs").glob("*.md")):
        for para in md.read_text(encoding="utf-8").split("\n\n"):
            para = para.strip()
            m = len(tokenizer(para, add_special_tokens=False)["input_ids"])
            if not para or m > tokens:
                continue  # a whole table or listing: a passage of its own would be far longer
            cur.append(para)
            n += m
            if n >= tokens:
                out.append("\n\n".join(cur))
                cur, n = [], 0
    return list(dict.fromkeys(out))  # a passage twice would be one chunk twice


def prompt_of(rag: KVRag, docs: list[str], target: int) -> tuple[str, list[str]]:
    """The rendered RAG prompt over the first passages of ``docs`` that reach ``target`` tokens."""
    for k in range(1, len(docs) + 1):
        text = rag.render(rag_prompt(rag.tokenizer, docs[:k], QUESTION))
        if rag.count_tokens(text) >= target:
            return text, docs[:k]
    raise SystemExit(f"docs/*.md hold fewer than {target} tokens of passages")


def ms(f, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def summary(pieces) -> list:
    return [(p.kind, p.token_ids.tolist(), p.key, p.span) for p in pieces]


def measure(rag: KVRag, prompt: str, repeats: int) -> dict:
    tok = rag.tokenizer
    whole = prompt_tokens(tok, prompt)
    old_pieces, _ = rag.pieces(prompt, tokens=whole)  # warm-up: the chunks enter the hot tier
    new_pieces, stats = rag.pieces(prompt)
    if summary(new_pieces) != summary(old_pieces):
        raise SystemExit("the spliced lookup and the whole-prompt lookup disagree: not timed")
    spans = list(chunk_spans(rag.segmenter.split(prompt)))
    chunks = []
    for seg, a, b in spans:
        if (entry := rag.hot.get(seg.key)) is None:
            raise SystemExit("a chunk is not in the hot tier after the warm-up: raise the hot tier's budget")
        chunks.append((a, b, entry.token_ids.tolist()))
    spliced = splice_ids(tok, prompt, chunks) is not None
    # The served path: submit (in a caller's thread, with the scheduler's copy of the tokenizer)
    # and the prefill's lookup on what submit made.
    served_tok = copy.deepcopy(tok)
    submitted = rag.tokenize(prompt, served_tok)
    if summary(rag.pieces(prompt, tokens=submitted)[0]) != summary(old_pieces):
        raise SystemExit("the served lookup and the whole-prompt lookup disagree: not timed")
    times: dict[str, list[float]] = {
        "old": [],
        "new": [],
        "served_old": [],
        "served_new": [],
        "served_submit": [],
        "served_prefill": [],
        "tokenize_whole": [],
        "splice": [],
        "segment": [],
    }

    def served_new():
        t = time.perf_counter()
        tokens = rag.tokenize(prompt, served_tok)
        times["served_submit"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        rag.pieces(prompt, tokens=tokens)
        times["served_prefill"].append((time.perf_counter() - t) * 1e3)

    runs = {
        "old": lambda: rag.pieces(prompt, tokens=prompt_tokens(tok, prompt)),
        "new": lambda: rag.pieces(prompt),
        "served_old": lambda: rag.pieces(prompt, tokens=prompt_tokens(served_tok, prompt)),
        "served_new": served_new,
    }
    for i in range(repeats):  # interleaved, the order alternating: load drift hits both alike
        names = ("old", "new", "served_old", "served_new")
        for name in names if i % 2 == 0 else names[::-1]:
            times[name] += ms(runs[name], 1)
        times["tokenize_whole"] += ms(lambda: prompt_tokens(tok, prompt), 1)
        times["splice"] += ms(lambda: splice_ids(tok, prompt, chunks), 1)
        times["segment"] += ms(lambda: rag.segmenter.split(prompt), 1)
    med = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    return {
        "prompt_tokens": sum(int(p.token_ids.numel()) for p in new_pieces),
        "chunks": len(spans),
        "chunks_served": sum(p.key is not None for p in new_pieces),
        "spliced": spliced,
        "chunks_unaligned": stats.chunks_unaligned,
        **med,
        "speedup": med["old_ms"] / med["new_ms"],
        "served_speedup": med["served_old_ms"] / med["served_new_ms"],
    }


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
    }


def write_report(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = result["rows"]
    lines = [
        "# The lookup without tokenizing the whole prompt",
        "",
        "`benchmarks/lookup_tokenize.py`: `ChunkLookup.pieces` as it runs (plain spans tokenized in",
        "context, stored chunk ids spliced in: `kvrag/query/splice.py`) against the whole-prompt path",
        "(tokenize the whole prompt, then align the chunks in it), on kvrag's RAG prompts over passages",
        "of ~400 tokens of this repository's docs, chunks in the hot tier. Medians over "
        f"{result['repeats']} interleaved runs, ms.",
        "",
        f"Tokenizer: {result['tokenizer']}. Machine: {result['machine']['processor']}, "
        f"{result['machine']['cpus']} CPUs, load {result['machine']['load_avg_1m']}, "
        f"tokenizers {result['machine']['tokenizers']}, transformers {result['machine']['transformers']}.",
        "",
        "| prompt tokens | chunks | spliced | lookup, whole-prompt path | lookup, spliced | speed-up "
        "| tokenize whole | splice alone | segmentation |",
        "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']} | {r['chunks']} | {'yes' if r['spliced'] else 'no'} | {r['old_ms']:.2f} "
            f"| {r['new_ms']:.2f} | {r['speedup']:.1f}x | {r['tokenize_whole_ms']:.2f} | {r['splice_ms']:.2f} "
            f"| {r['segment_ms']:.2f} |"
        )
    lines += [
        "",
        "The served path's host work per request before the model runs (`kvrag serve`: the",
        "scheduler's `submit` counts the prompt's tokens, its prefill's lookup reads them). Before:",
        "`submit` tokenized the whole prompt and the lookup aligned the chunks in it; now: `submit`",
        "runs the lookup's own rule (`KVRag.tokenize`: the hot chunks' stored ids spliced in) and",
        "the lookup reuses it. Medians, ms.",
        "",
        "| prompt tokens | served, before | served, now | speed-up | now: submit | now: lookup at the prefill |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']} | {r['served_old_ms']:.2f} | {r['served_new_ms']:.2f} "
            f"| {r['served_speedup']:.1f}x | {r['served_submit_ms']:.2f} | {r['served_prefill_ms']:.2f} |"
        )
    if result.get("target") is not None:
        t = result["target"]
        verdict = "met" if t["met"] else "not met"
        lines += ["", f"Target, lookup <= {TARGET_MS:g} ms at ~16k tokens: {verdict} ({t['new_ms']:.2f} ms)."]
    lines += [
        "",
        "Both paths give the same pieces (checked before timing). Reproduce:",
        "`.venv/bin/python benchmarks/lookup_tokenize.py` (`--tokenizer gemma3-270m` for Gemma 3's).",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4000,16000,32000", help="prompt sizes in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tokenizer", default="smollm2", choices=["smollm2", "gemma3-270m"])
    ap.add_argument("--out", type=Path, help="default: docs/bench/lookup_tokenize[/<tokenizer>, if not smollm2]")
    args = ap.parse_args()
    if args.out is None:
        args.out = ROOT / "docs" / "bench" / "lookup_tokenize"
        if args.tokenizer != "smollm2":
            args.out /= args.tokenizer
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.tokenizer == "smollm2":
        tok = smollm2_tokenizer()
    else:
        from kvrag.model.packaged import default_tokenizer

        tok = default_tokenizer(model=args.tokenizer)
    handle = tiny_llama(seed=0, tokenizer=tok, max_position_embeddings=max(sizes) * 2 + 4096)
    docs = passages(tok)
    rows = []
    with tempfile.TemporaryDirectory() as store:
        rag = KVRag(handle, cache_dir=store)
        for size in sizes:
            prompt, used = prompt_of(rag, docs, size)
            rag.precompute(used)
            row = {"target_tokens": size, **measure(rag, prompt, args.repeats)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    near = min(rows, key=lambda r: abs(r["prompt_tokens"] - TARGET_TOKENS))
    target = None
    if abs(near["prompt_tokens"] - TARGET_TOKENS) <= TARGET_TOKENS // 4:
        target = {"prompt_tokens": near["prompt_tokens"], "new_ms": near["new_ms"], "met": near["new_ms"] <= TARGET_MS}
    result = {
        "tokenizer": args.tokenizer,
        "repeats": args.repeats,
        "machine": machine(),
        "rows": rows,
        "target": target,
    }
    write_report(args.out, result)
    print(f"wrote {args.out}/README.md and results.json")


if __name__ == "__main__":
    main()
