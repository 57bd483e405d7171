"""Storage formats per tier: what a ~4k-token RAG prompt's chunks cost to read and expand, and
the TTFT they give, from a cold local disk, the page cache, Redis and the hot tier.

For each ``--formats`` entry, one store of its own (a local directory, write-through to a Redis
under a prefix of its own) is filled with the prompt's passages (``host_floor.build_prompt``:
passages of docs/*.md, kvrag's RAG layout, the model's chat template). Then, per tier:

* ``read_expand_ms``: the prompt's chunks read from the tier and expanded to the compute dtype
  on the compute device as the prefill places them (``fusion.StoredRows``: a layer at a time
  on a CPU, the entries whole on a GPU), every layer's keys and values (median over
  ``--repeats``):
  - ``cold_disk``: the store's files dropped from the page cache first (``gpu_floor.drop_page_cache``:
    the whole page cache as root, else ``posix_fadvise DONTNEED`` per file);
  - ``page_cache``: the same files, read (untimed) just before: another format's cold read
    may have dropped the whole page cache since (as root);
  - ``redis``: the Redis tier alone (``RedisStore.get``: a network read, verified);
  - ``hot``: the entry already in memory (the hot tier keeps packed entries packed): the
    expansion alone.
* ``ttft_ms`` per policy (``naive_reuse`` and the model's default): ``KVRag.generate`` of one
  token with the chunks read from that tier (the hot tier off, except for ``hot``; ``redis``:
  a replica with an empty local disk, reading through).

Rounds interleave the formats (each round measures every format once per tier), so a drift of
the machine's speed reaches all of them alike. Results: ``--out``/results.json, README.md.

    .venv/bin/python benchmarks/kv_tiers.py --out docs/bench/kv_tiers_smollm2
    .venv/bin/python benchmarks/kv_tiers.py --tiny --tokens 300 --repeats 1 --out /tmp/kvt   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
from gpu_floor import drop_page_cache  # this folder is the script's first import path
from host_floor import build_prompt

from kvrag import KVRag
from kvrag.query.fusion import StoredRows
from kvrag.store.factory import open_shared
from kvrag.store.kv_format import bytes_per_token

TIERS = ("cold_disk", "page_cache", "redis", "hot")


class FormatRun:
    """One storage format's stores and KVRags: the local one (disk + Redis write-through) and
    what each tier's measurement reads through."""

    def __init__(self, model, fmt: str, work: Path, redis_url: str, docs: list[str]):
        self.fmt, self.work, self.docs = fmt, work, docs
        self.prefix = f"kvrag-bench-{uuid.uuid4().hex[:8]}:{fmt}:"
        self.redis_url = redis_url
        self.shared = open_shared(redis_url, prefix=self.prefix)
        self.rag = KVRag(model, cache_dir=work / fmt, storage_dtype=fmt, hot_cache=0, shared=self.shared)
        self.keys = self.rag.precompute(docs)
        self.rag.store.flush()  # the write-through to Redis done before anything is timed
        self.hot_rag = KVRag(model, cache_dir=work / fmt, storage_dtype=fmt)
        self.model = model
        #: Tokens the prefill computed, per policy (the same from every tier and format).
        self.computed: dict[str, int] = {}

    def warm_page_cache(self) -> None:
        """Read every chunk of the local store once, so its files are in the page cache."""
        for key in self.keys:
            self.rag.store.get(key, self.rag.fingerprint)

    def read_expand_ms(self, tier: str) -> float:
        dev, dt, fp = self.rag.handle.device, self.rag.handle.dtype, self.rag.fingerprint
        store = self.shared if tier == "redis" else self.rag.store
        if tier == "cold_disk":
            drop_page_cache(self.work / self.fmt)
        elif tier == "page_cache":
            self.warm_page_cache()
        entries = [store.get(k, fp) for k in self.keys] if tier == "hot" else None
        fusion = self.rag.fusion
        by_layer = fusion.layerwise if fusion.layerwise is not None else dev.type == "cpu"
        n_layers = self.rag.arch.n_layers
        t = time.perf_counter()
        read = []
        for i, key in enumerate(self.keys):
            entry = entries[i] if entries is not None else store.get(key, fp)
            if entry is None:
                raise SystemExit(f"{self.fmt}: chunk {key} missing from the {tier} tier")
            read.append(entry)
        rows = StoredRows(read, dev, dt, by_layer)
        for kind in ("keys", "values"):
            if by_layer:
                for layer in range(n_layers):
                    rows.layer(kind, layer)
            else:
                rows.block(kind)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t) * 1e3

    def ttft_ms(self, tier: str, prompt: str, policy: str | None) -> float:
        if tier == "hot":
            rag = self.hot_rag  # its chunks stay in the hot tier from the untimed warm-up round
        elif tier == "redis":
            local = Path(tempfile.mkdtemp(dir=self.work))
            rag = KVRag(self.model, cache_dir=local, storage_dtype=self.fmt, hot_cache=0, shared=self.shared)
        else:
            rag = self.rag
            if tier == "cold_disk":
                drop_page_cache(self.work / self.fmt)
            elif tier == "page_cache":
                self.warm_page_cache()
        g = rag.generate(prompt, policy=policy, max_new_tokens=1)
        if g.stats.chunks_hit != len(self.docs):
            raise SystemExit(f"{self.fmt}/{tier}/{policy}: {g.stats.chunks_hit} of {len(self.docs)} chunks read")
        self.computed[policy or "default"] = g.stats.computed_tokens
        if tier == "redis":
            rag.store.flush()  # its background promotion to the local disk, not into the next timing
        return g.stats.ttft_s * 1e3

    def close(self) -> None:
        self.shared.clear()  # this run's prefix only
        for rag in (self.rag, self.hot_rag):
            rag.store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model id or path (default: the packaged SmolLM2)")
    ap.add_argument("--tiny", action="store_true", help="the tiny random-weight test model (a smoke run)")
    ap.add_argument("--formats", default="float16,int8,int4")
    ap.add_argument("--policies", default="naive_reuse,auto", help="'auto': the model's default policy")
    ap.add_argument("--tokens", type=int, default=3700, help="prompt length to reach")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.tiny:
        from kvrag.testing import tiny_llama

        model = tiny_llama(seed=0)
    else:
        from kvrag.model import ModelHandle

        # The base model, shared by every KVRag here (each applies the model's default adapter
        # to its own copy: a KVRag's ``handle`` may carry one and is not passed on).
        model = ModelHandle.load(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    formats = args.formats.split(",")
    policies = [None if p == "auto" else p for p in args.policies.split(",")]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        first = KVRag(model, cache_dir=Path(tmp) / "probe", hot_cache=0)
        prompt, docs = build_prompt(first, args.tokens)
        default = first.policy.name
        n_tokens = first.count_tokens(prompt)
        first.store.close()
        runs = [FormatRun(model, fmt, Path(tmp), args.redis, docs) for fmt in formats]
        shape = (first.handle.n_layers, first.handle.n_kv_heads, first.handle.head_dim)
        read: dict = {r.fmt: {t: [] for t in TIERS} for r in runs}
        ttft: dict = {r.fmt: {t: {} for t in TIERS} for r in runs}
        for r in runs:  # warm-up: every path once, untimed
            for tier in TIERS:
                r.read_expand_ms(tier)
                for p in policies:
                    r.ttft_ms(tier, prompt, p)
        for rnd in range(args.repeats):
            for tier in TIERS:
                for r in runs:
                    read[r.fmt][tier].append(r.read_expand_ms(tier))
                    for p in policies:
                        name = p or "default"
                        ttft[r.fmt][tier].setdefault(name, []).append(r.ttft_ms(tier, prompt, p))
            print(f"round {rnd + 1}/{args.repeats} done", flush=True)
        for r in runs:
            r.close()
    med = statistics.median
    results = {
        "setup": {
            "model": args.model or ("tiny" if args.tiny else "packaged SmolLM2-135M-Instruct"),
            "prompt_tokens": n_tokens,
            "chunks": len(docs),
            "repeats": args.repeats,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "torch": torch.__version__,
            "default_policy": default,
            "computed_tokens": runs[0].computed,
        },
        "formats": {
            fmt: {
                "bytes_per_token": bytes_per_token(fmt, *shape),
                "read_expand_ms": {t: round(med(v), 2) for t, v in read[fmt].items()},
                "ttft_ms": {t: {p: round(med(v), 1) for p, v in ps.items()} for t, ps in ttft[fmt].items()},
            }
            for fmt in formats
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    f16 = results["formats"].get("float16")
    lines = [
        "# Storage formats per tier: read + expand and TTFT",
        "",
        f"Machine: {results['setup']['machine']}; torch {torch.__version__}; model "
        f"{results['setup']['model']} (float32 compute); prompt {n_tokens} tokens, {len(docs)} chunks; "
        f"medians of {args.repeats} rounds, formats interleaved. Command: `python benchmarks/kv_tiers.py "
        f"--formats {args.formats} --policies {args.policies} --tokens {args.tokens} --repeats {args.repeats}`.",
        "",
        "## Read + expand of the prompt's chunks (ms, all chunks, every layer expanded as the prefill places it)",
        "",
        "| format | bytes/token | " + " | ".join(TIERS) + " |",
        "|---|---|" + "---|" * len(TIERS),
    ]
    for fmt, rec in results["formats"].items():
        cells = []
        for t in TIERS:
            ms = rec["read_expand_ms"][t]
            ratio = f" ({ms / f16['read_expand_ms'][t]:.2f}x)" if f16 and fmt != "float16" else ""
            cells.append(f"{ms}{ratio}")
        lines.append(f"| {fmt} | {rec['bytes_per_token']:.0f} | " + " | ".join(cells) + " |")
    lines += ["", "## TTFT (ms; in brackets: against the float16 store's from the same tier)", ""]
    computed = ", ".join(f"{p} {n}" for p, n in results["setup"]["computed_tokens"].items())
    lines += [
        f"default: the model's default policy, here `{default}`. Tokens computed: {computed}. redis: a replica "
        "with an empty local disk reading through (its first query); hot: chunks in the hot tier.",
        "",
    ]
    pols = [p or "default" for p in policies]
    lines += ["| format | policy | " + " | ".join(TIERS) + " |", "|---|---|" + "---|" * len(TIERS)]
    for fmt, rec in results["formats"].items():
        for p in pols:
            cells = []
            for t in TIERS:
                ms = rec["ttft_ms"][t][p]
                ratio = f" ({ms / f16['ttft_ms'][t][p]:.2f}x)" if f16 and fmt != "float16" else ""
                cells.append(f"{ms}{ratio}")
            lines.append(f"| {fmt} | {p} | " + " | ".join(cells) + " |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
