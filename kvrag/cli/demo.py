"""``kvrag demo``: ingest a small corpus, ask questions, compare answers and TTFT per policy."""
from __future__ import annotations

import json
import tempfile
import time
from importlib import resources

DEFAULT_POLICIES = "full_prefill,naive_reuse,cacheblend,kvlink"


def register(sub) -> None:
    p = sub.add_parser("demo", help="ingest a demo corpus, ask questions, print answers and TTFT per policy")
    p.add_argument("--model", default=None, help="HF model dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", default=None, help="KV store directory (default: a fresh temporary one)")
    p.add_argument("--corpus", default=None, help="JSON with instruction, documents, questions")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policy names")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.set_defaults(func=run)


def load_corpus(path: str | None) -> dict:
    if path:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return json.loads(resources.files("kvrag.data").joinpath("demo_corpus.json").read_text(encoding="utf-8"))


def run(args) -> int:
    from kvrag.engine import KVRag
    from kvrag.prompt import DEFAULT_INSTRUCTION, rag_messages

    corpus = load_corpus(args.corpus)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    tmp = None
    cache_dir = args.cache_dir
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvrag-demo-")
        cache_dir = tmp.name
    print("loading model ...", flush=True)
    rag = KVRag(args.model, cache_dir=cache_dir)
    # kvlink runs as a user gets it with KVRag(policy="kvlink"): with the model's KVLink adapter
    # (a LoRA adapter ships for the default model), i.e. a model copy with chunk caches of its
    # own; without an adapter it is the same model and the same caches.
    rags = {p: rag for p in policies}
    if "kvlink" in policies:
        rags["kvlink"] = KVRag(rag.handle, cache_dir=cache_dir, policy="kvlink")
        if rags["kvlink"].handle is not rag.handle:
            print("kvlink runs trained: the model's KVLink adapter (LoRA + link tokens) on a model copy", flush=True)
    docs = corpus["documents"]
    instruction = corpus.get("instruction") or DEFAULT_INSTRUCTION
    t0 = time.perf_counter()
    for r in {id(r): r for r in rags.values()}.values():
        r.precompute(docs, progress=True)
    n_tok = sum(len(rag.chunk_ids(d)) for d in docs)
    print(f"ingested {len(docs)} documents ({n_tok} tokens) in {time.perf_counter() - t0:.1f}s\n")
    # Warm-up: the first call pays one-off costs (allocations, kernels) for every policy alike.
    for pol, r in rags.items():
        r.generate(rag_messages(docs, "warm-up", instruction), policy=pol, max_new_tokens=1)
    ttft = {p: [] for p in policies}
    for q in corpus["questions"]:
        msgs = rag_messages(docs, q, instruction)
        print(f"Q: {q}")
        for pol in policies:
            out = rags[pol].generate(msgs, policy=pol, max_new_tokens=args.max_new_tokens, stop=["\n"])
            s = out.stats
            ttft[pol].append(s.ttft_s)
            print(f"  {pol:<13} TTFT {s.ttft_s * 1000:7.0f} ms  cached {s.cached_tokens:5d}  "
                  f"recomputed {s.recompute_fraction:5.1%}  | {out.text.strip()!r}")
        print()
    base = sorted(ttft.get("full_prefill", []))
    print("median TTFT" + (" (speed-up vs full_prefill)" if base else ""))
    for pol, xs in ttft.items():
        med = sorted(xs)[len(xs) // 2]
        ratio = f"  x{base[len(base) // 2] / med:5.1f}" if base and med > 0 else ""
        print(f"  {pol:<13} {med * 1000:7.0f} ms{ratio}")
    if tmp is not None:
        tmp.cleanup()
    return 0
