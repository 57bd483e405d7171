"""What the serving options cost per decoded token: the same greedy answers through
``kvrag serve``'s scheduler with nothing asked, with log-probabilities, with OpenAI's penalties
and with a JSON schema, timed interleaved in one process.

A run is one request alone on the scheduler (its prefill, then one decode step per token); its
cost per token is (end - first token) / (tokens - 1), the time per output token a client sees.
Per setting: the median over ``--rounds`` rounds (the settings' order rotates each round) of
the median over the prompts. Every setting decodes exactly ``--tokens`` tokens (``ignore_eos``,
``min_tokens``) except the JSON one, which ends with its document. Results: a table on stdout
and ``--out`` (JSON).

    .venv/bin/python benchmarks/decode_options_ab.py --out docs/bench/decode_options/ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path

from kvrag import KVRag
from kvrag.layout.prompt import rag_messages
from kvrag.serve.scheduler import GenerationRequest, Scheduler

#: An answer as a document: a free string and a number, the shapes RAG extraction asks for.
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "year": {"type": "integer"}, "sources": {"type": "integer"}},
    "required": ["answer", "year", "sources"],
    "additionalProperties": False,
}
SETTINGS = {
    "plain": {},
    "logprobs=5": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "json_schema": {"json_schema": SCHEMA},
}


def per_token(sched: Scheduler, prompt, tokens: int, options: dict) -> tuple[float, int]:
    """(seconds per token after the first, tokens) of one request alone."""
    fixed = {} if "json_schema" in options else {"ignore_eos": True, "min_tokens": tokens}
    ticket = sched.submit(GenerationRequest.of(prompt, max_new_tokens=tokens, temperature=0.0, **fixed, **options))
    t_first = None
    for _ in ticket:
        if t_first is None:
            t_first = time.perf_counter()
    end = time.perf_counter()
    fin = ticket.result(timeout=600)
    n = fin.completion_tokens
    return ((end - t_first) / (n - 1) if t_first is not None and n > 1 else float("nan")), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model name (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    corpus = json.loads(resources.files("kvrag.data").joinpath("demo_corpus.json").read_text())
    docs = corpus["documents"]
    prompts = [rag_messages(docs[i : i + 3], q) for i, q in enumerate(corpus["questions"][:3])]
    records = []
    with tempfile.TemporaryDirectory() as store:
        rag = KVRag(args.model, cache_dir=store, policy="cacheblend")
        rag.precompute(docs)
        names = list(SETTINGS)
        with Scheduler(rag, max_concurrency=1) as sched:
            for p in prompts:  # warm-up: the prefix cache, the grammar engine's tokenizer
                for name in names:
                    per_token(sched, p, 4, SETTINGS[name])
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    runs = [per_token(sched, p, args.tokens, SETTINGS[name]) for p in prompts]
                    s = statistics.median(t for t, _ in runs)
                    records.append({"round": r, "setting": name, "s_per_token": s, "tokens": [n for _, n in runs]})
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(records, indent=1))
    base = statistics.median(x["s_per_token"] for x in records if x["setting"] == "plain")
    print(f"{'setting':<14} {'ms/token':>9} {'vs plain':>9}  tokens")
    for name in names:
        ms = statistics.median(x["s_per_token"] for x in records if x["setting"] == name)
        toks = sorted({n for x in records if x["setting"] == name for n in x["tokens"]})
        print(f"{name:<14} {ms * 1e3:>9.1f} {ms / base:>8.2f}x  {toks}")


if __name__ == "__main__":
    main()
