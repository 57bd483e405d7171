"""Where a request's time goes once reuse has removed the prefill, and how close decoding runs
to what the memory bus allows: kvrag eager and compiled against ``transformers``' own paths
and llama.cpp on the same weights, in one run.

On a RAG prompt of ~``--tokens`` tokens (passages of docs/*.md, kvrag's RAG layout, SmolLM2's
chat template), the chunks precomputed and warm in the hot tier:

* TTFT per policy, split: the lookup (segmentation, token splice, reading the chunks), the
  fused prefill's forward, and the first token; medians over ``--repeats``.
* Decode tokens/s at batch 1, 4 and 8 (the batch: the prompt's cache, copied per request, as
  ``kvrag serve`` holds it in its ``DecodeArena``): eager (``decode_step`` op by op) and
  compiled (``kvrag.query.compiled``, after its warm-up; the compile time reported), steps
  interleaved, over ``--steps`` steps each.
* ``transformers``' ``generate`` on the same weights at batch 1, dynamic cache and static
  cache + ``torch.compile`` (its documented fastest path), per-token time from the difference
  of two lengths, so the prompt's prefill cancels.
* llama.cpp on the same GGUF (``llama-cpp-python``, where it is installed: its version said),
  n_threads = torch's threads.
* The physical limit, measured in the same run: the bytes a decode step reads (weights + the
  cache at this length, in the dtype it runs) over the memory bandwidth a reduction over 1 GiB
  measures; and the question forward's FLOPs over the matmul rate measured on its shapes.

Results: ``--out``/results.json (written after every section: ``--resume`` skips the sections
done), README.md and decode.png.

    .venv/bin/python benchmarks/host_floor.py
    .venv/bin/python benchmarks/host_floor.py --tokens 800 --steps 8 --repeats 2 --out /tmp/hf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from lookup_tokenize import passages  # this folder is the script's first import path

from kvrag import KVRag
from kvrag.layout.prompt import rag_prompt
from kvrag.query.batch import DecodeArena, DecodeCache, decode_step

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Which parts of a request does kvrag compute, and which does it read from the cache?"
POLICIES = ("full_prefill", "naive_reuse", "auto")


def build_prompt(rag: KVRag, target: int) -> tuple[str, list[str]]:
    docs = passages(rag.tokenizer, 300)
    for k in range(1, len(docs) + 1):
        text = rag.render(rag_prompt(rag.tokenizer, docs[:k], QUESTION))
        if rag.count_tokens(text) >= target:
            return text, docs[:k]
    raise SystemExit(f"docs/*.md hold fewer than {target} tokens of passages")


def median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 2)


def bandwidth_gbs() -> float:
    """Memory read rate: a float32 sum over 1 GiB (no cache holds it), best of 5."""
    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def matmul_gflops(rows: int, dim: int, out_dim: int, dtype) -> float:
    a, w = torch.randn(rows, dim, dtype=dtype), torch.randn(out_dim, dim, dtype=dtype)
    torch.nn.functional.linear(a, w)
    t, n = time.perf_counter(), 20
    for _ in range(n):
        torch.nn.functional.linear(a, w)
    return 2 * rows * dim * out_dim * n / (time.perf_counter() - t) / 1e9


def section_ttft(rag: KVRag, prompt: str, repeats: int) -> dict:
    out = {}
    for policy in POLICIES:
        pol = None if policy == "auto" else policy
        rag.generate(prompt, policy=pol, max_new_tokens=1)  # warm: chunks in the hot tier, prefix cache filled
        lookup, prefill, ttft = [], [], []
        for _ in range(repeats):
            g = rag.generate(prompt, policy=pol, max_new_tokens=1)
            lookup.append(g.stats.load_s)
            prefill.append(g.stats.prefill_s)
            ttft.append(g.stats.ttft_s)
        out[g.stats.policy if policy == "auto" else policy] = {
            "lookup_ms": median_ms(lookup),
            "forward_ms": median_ms(prefill),
            "ttft_ms": median_ms(ttft),
            "computed_tokens": g.stats.computed_tokens,
            "prompt_tokens": g.stats.prompt_tokens,
        }
    return out


def section_decode(rag: KVRag, prompt: str, steps: int, batches: tuple[int, ...]) -> dict:
    """Tokens/s of the arena's step, eager and compiled, interleaved per batch size."""
    pre = rag.prefill(prompt, "full_prefill")
    out: dict = {"compile_s": 0.0, "batches": {}}
    if rag.compiled is None:
        raise SystemExit("this model decodes op by op only (no compiled step): nothing to compare")
    out["compile_s"] = round(rag.warm_up(), 1)
    for b in batches:
        runs = {}
        for name, compiled in (("eager", None), ("compiled", rag.compiled)):
            arena = DecodeArena(rag.arch)
            caches = []
            for _ in range(b):
                cache = DecodeCache.from_stepper(rag.arch, pre.stepper, spare=steps + 4)
                assert cache is not None and arena.add(cache)
                caches.append(cache)
            runs[name] = (arena, caches, compiled)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        tokens = [int(pre.logits.argmax())] * b
        for i in range(steps):
            for name, (arena, caches, compiled) in runs.items():
                t = time.perf_counter()
                logits = decode_step(rag.arch, caches, tokens, arena, compiled)
                if i:  # the first step of each (a buffer's first touch) is not timed
                    times[name].append(time.perf_counter() - t)
            tokens = logits.argmax(-1).tolist()
        out["batches"][b] = {
            name: {"step_ms": median_ms(ts), "tokens_per_s": round(b / statistics.median(ts), 2)}
            for name, ts in times.items()
        }
        print(f"decode batch {b}: {out['batches'][b]}", flush=True)
    return out


def section_transformers(rag: KVRag, prompt_ids: list[int], steps: int) -> dict:
    """``generate`` with its dynamic cache, and with a static cache and the forward compiled
    (transformers' documented fastest path; on a CPU ``generate`` does not compile by itself)."""
    model = rag.handle.model
    ids = torch.tensor([prompt_ids])
    out = {}
    eager_forward = model.forward
    for name, kwargs in (("dynamic", {}), ("static_compiled", {"cache_implementation": "static"})):
        if name == "static_compiled":
            model.forward = torch.compile(eager_forward)

        def run(n: int, kwargs=kwargs) -> float:
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    **kwargs,
                )
            return time.perf_counter() - t

        try:
            t0 = time.perf_counter()
            run(2)
            run(3)  # the compiled forward's graphs: the prompt's and a step's
            warm_s = time.perf_counter() - t0
            short, long = run(2), run(steps + 2)
        finally:
            model.forward = eager_forward
        out[name] = {"tokens_per_s": round(steps / (long - short), 2), "first_call_s": round(warm_s, 1)}
        print(f"transformers {name}: {out[name]}", flush=True)
    return out


def section_llamacpp(gguf: str, prompt_ids: list[int], steps: int, threads: int) -> dict:
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python, a source build)"}
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(prompt_ids) + steps + 16, n_threads=threads, verbose=False)

    def run(n: int) -> tuple[float, float]:
        """(prefill s, decode s per token) of one generation of ``n`` tokens."""
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt_ids)
        t1 = time.perf_counter()
        for _ in range(n):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        return t1 - t, (time.perf_counter() - t1) / n

    run(2)
    prefill_s, per_token = run(steps)
    return {"version": llama_cpp.__version__, "tokens_per_s": round(1 / per_token, 2), "prefill_s": round(prefill_s, 2)}


def physical_limit(rag: KVRag, context: int, question_tokens: int) -> dict:
    cfg = rag.handle.config
    item = rag.arch.dtype.itemsize
    params = sum(p.numel() for p in rag.handle.model.parameters())
    embed = rag.arch.body.embed_tokens.weight.numel()
    tied = rag.handle.model.lm_head.weight.data_ptr() == rag.arch.body.embed_tokens.weight.data_ptr()
    # A step reads every weight once (the embedding only a row, unless tied to the LM head,
    # which reads it whole) and the cache's K/V at this length.
    weight_bytes = (params - (0 if tied else embed)) * item
    kv_bytes = 2 * rag.arch.n_layers * rag.arch.n_kv_heads * rag.arch.head_dim * context * item
    bw = bandwidth_gbs()
    gflops = matmul_gflops(question_tokens, cfg.hidden_size, cfg.intermediate_size, rag.arch.dtype)
    flops = 2 * (params - embed) * question_tokens
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "bandwidth_gb_s": round(bw, 1),
        "decode_limit_tokens_per_s": round(bw * 1e9 / (weight_bytes + kv_bytes), 1),
        "matmul_gflops": round(gflops, 1),
        "question_forward_floor_ms": round(flops / (gflops * 1e9) * 1e3, 2),
    }


def report(res: dict, out: Path) -> None:
    lines = [
        "# Host floor: TTFT split and decode against its limit",
        "",
        f"Machine: {res['machine']}; torch {res['torch']}, transformers {res['transformers']}, "
        f"{res['threads']} threads; model {res['model']} ({res['dtype']}); prompt {res['prompt_tokens']} tokens. "
        f"Command: `{res['command']}`.",
        "",
    ]
    if "ttft" in res:
        lines += [
            "## TTFT (ms, medians)",
            "",
            "| policy | lookup | forward | TTFT | computed / prompt tokens |",
            "|---|---|---|---|---|",
        ]
        for pol, r in res["ttft"].items():
            lines.append(
                f"| {pol} | {r['lookup_ms']} | {r['forward_ms']} | {r['ttft_ms']} "
                f"| {r['computed_tokens']} / {r['prompt_tokens']} |"
            )
        lines.append("")
    if "decode" in res:
        lim = res.get("limit", {})
        lines += [
            f"## Decode (tokens/s; compiled step built in {res['decode']['compile_s']} s)",
            "",
            "| batch | eager | compiled | compiled / eager | limit (bytes / bandwidth, batch 1 reads) |",
            "|---|---|---|---|---|",
        ]
        for b, r in res["decode"]["batches"].items():
            e, c = r["eager"]["tokens_per_s"], r["compiled"]["tokens_per_s"]
            lines.append(f"| {b} | {e} | {c} | {c / e:.2f}x | {lim.get('decode_limit_tokens_per_s', '-')} |")
        lines.append("")
    if "hf_generate" in res:
        lines += ["## Beside it, batch 1 (tokens/s)", "", "| path | tokens/s | first call (s) |", "|---|---|---|"]
        for name, r in res["hf_generate"].items():
            lines.append(f"| transformers generate, {name} | {r['tokens_per_s']} | {r['first_call_s']} |")
        ll = res.get("llamacpp", {})
        if "tokens_per_s" in ll:
            lines.append(f"| llama.cpp {ll['version']} (same GGUF, its own kernels) | {ll['tokens_per_s']} | - |")
        elif ll:
            lines.append(f"| llama.cpp | {ll['skipped']} | - |")
        lines.append("")
    if "limit" in res:
        lim = res["limit"]
        lines += [
            "## The physical limit, measured in this run",
            "",
            f"- a decode step reads {lim['weight_bytes'] / 1e6:.0f} MB of weights + "
            f"{lim['kv_bytes'] / 1e6:.0f} MB of K/V; "
            f"the bus reads {lim['bandwidth_gb_s']} GB/s -> {lim['decode_limit_tokens_per_s']} tokens/s at batch 1",
            f"- the question forward: {lim['matmul_gflops']} GFLOP/s on its matmul shapes -> a floor of "
            f"{lim['question_forward_floor_ms']} ms",
            "",
        ]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")
    if "decode" in res:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        bs = list(res["decode"]["batches"])
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in ("eager", "compiled"):
            ax.plot(
                [int(b) for b in bs],
                [res["decode"]["batches"][b][name]["tokens_per_s"] for b in bs],
                "o-",
                label=f"kvrag {name}",
            )
        for name, r in res.get("hf_generate", {}).items():
            ax.axhline(
                r["tokens_per_s"],
                ls="--",
                lw=1,
                label=f"transformers {name} (batch 1)",
                color="grey" if name == "dynamic" else "k",
            )
        if "tokens_per_s" in res.get("llamacpp", {}):
            ax.axhline(res["llamacpp"]["tokens_per_s"], ls=":", label="llama.cpp (batch 1)", color="tab:green")
        if "limit" in res:
            ax.axhline(
                res["limit"]["decode_limit_tokens_per_s"], ls="-.", color="tab:red", label="bandwidth limit (batch 1)"
            )
        ax.set_xlabel("requests decoding together")
        ax.set_ylabel("tokens/s (all requests)")
        ax.set_title(f"{res['model']}, {res['prompt_tokens']}-token prompt, {res['threads']} threads")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "decode.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=3700)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--out", default=str(ROOT / "docs/bench/host_floor"))
    ap.add_argument("--resume", action="store_true", help="keep the sections results.json already holds")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    res = json.loads(path.read_text()) if args.resume and path.exists() else {}

    def save() -> None:
        path.write_text(json.dumps(res, indent=1))
        report(res, out)

    with tempfile.TemporaryDirectory() as tmp:
        rag = KVRag(args.model, cache_dir=Path(tmp) / "kv", dtype=args.dtype, compile="on")
        prompt, docs = build_prompt(rag, args.tokens)
        rag.precompute(docs)
        prompt_ids = rag.tokenize(prompt)[0]
        res.update(
            machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.platform()}",
            torch=torch.__version__,
            transformers=transformers.__version__,
            threads=torch.get_num_threads(),
            model=args.model or "SmolLM2-135M-Instruct",
            dtype=args.dtype,
            prompt_tokens=len(prompt_ids),
            command="python benchmarks/host_floor.py "
            + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k not in ("out", "resume")),
        )
        if "ttft" not in res:
            res["ttft"] = section_ttft(rag, prompt, args.repeats)
            save()
        if "decode" not in res:
            res["decode"] = section_decode(rag, prompt, args.steps, tuple(int(b) for b in args.batches.split(",")))
            save()
        if "limit" not in res:
            # The question forward: the tokens naive reuse computes (all but the chunks').
            res["limit"] = physical_limit(rag, len(prompt_ids), res["ttft"]["naive_reuse"]["computed_tokens"])
            save()
        if "hf_generate" not in res:
            res["hf_generate"] = section_transformers(rag, prompt_ids, args.steps)
            save()
        if "llamacpp" not in res:
            source = str(rag.handle.source or "")
            res["llamacpp"] = (
                section_llamacpp(source, prompt_ids, args.steps, torch.get_num_threads())
                if source.endswith(".gguf")
                else {"skipped": f"the model is not a GGUF file ({source})"}
            )
            save()
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()
