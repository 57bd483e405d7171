"""Load benchmark of ``kvrag serve``: N concurrent clients sending RAG prompts over ingested
chunks, beside servers that do no reuse, and a robustness phase.

    python benchmarks/serve_load.py --out DIR [--model smollm2] [--clients 1,4,8,16] [--quick] [--resume]

All traffic goes to servers this script starts on 127.0.0.1 (free ports), each stopped after
its phase; every phase is bounded in requests and in time (``--time-limit`` for the whole run,
``--request-timeout`` per request). Servers, each on the same model and the same prompts:

* ``kvrag`` -- ``kvrag serve --policy POLICY`` (default cacheblend) with every passage
  ingested through ``POST /v1/chunks``;
* ``kvrag-full_prefill`` -- ``kvrag serve --policy full_prefill``: the same server, no reuse;
* ``llama.cpp`` -- ``python -m llama_cpp.server`` on the model's GGUF, where
  ``llama-cpp-python[server]`` is installed;
* ``transformers`` -- ``transformers serve`` on the model's weights directory, where it runs.

A server that cannot start is recorded with the reason, never silently left out. For each
server and each number of clients N: TTFT p50/p95 (client side: request sent -> first content
delta), aggregate output tokens/s (completion tokens / wall time of the cell). Also one-client
in-process ``KVRag.stream`` TTFT on the same prompts (the "server within 10% of in-process"
target), and the robustness phase against the kvrag server: malformed bodies, 1M-character
prompts, over-context prompts and streams dropped mid-answer, ``--robustness`` requests in all
(1,000 by default), with the server's RSS before and after and a check that it still answers.

Results are appended to ``DIR/results.jsonl`` as each cell ends (``--resume`` skips the cells
there); ``DIR/report.md``, ``DIR/report.json`` and ``DIR/serve_load.png`` are written from it at
the end (``--report-only`` rewrites them). Rehearse with ``--quick`` (tiny scale); the real
measurement wants a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FULL = dict(clients="1,4,8,16", items=32, requests_per_client=4, max_tokens=32, passages=6, passage_tokens=200)
QUICK = dict(clients="1,2", items=4, requests_per_client=2, max_tokens=8, passages=3, passage_tokens=100)


# ---- servers -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on 127.0.0.1; ``start`` waits (bounded) for it to answer."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, ready_path: str = "/health"):
        self.name, self.cmd, self.port, self.log, self.ready_path = name, cmd, port, log, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> None:
        import httpx

        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with code {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"not answering after {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 600) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        if getattr(self, "_log", None):
            self._log.close()


def kvrag_server(out: Path, a, policy: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "kvrag", "serve", "--model", a.model, "--cache-dir", str(out / "store")]
    cmd += ["--policy", policy, "--port", str(port), "--max-concurrency", str(max(a.client_counts))]
    cmd += ["--max-queue", str(4 * max(a.client_counts)), "--log-level", "warning", "--device", a.device]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    # /ready, not /health: the server takes requests only once its warm-up (the compiled step) is done.
    name = f"kvrag-{policy}" if policy == "full_prefill" else "kvrag"
    return Server(name, cmd, port, out / f"server-{policy}.log", ready_path="/ready")


def llamacpp_server(out: Path, gguf: str | None, a) -> Server:
    python = a.llama_cpp_python
    probe = subprocess.run([python, "-c", "import llama_cpp.server"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(
            f"llama-cpp-python[server] is not importable by {python} ({probe.stderr.strip()[-200:]}); PyPI has "
            "only its source distribution (a CMake build of llama.cpp): `pip install 'llama-cpp-python[server]'` "
            "builds it (in any venv: pass its python as --llama-cpp-python)"
        )
    if gguf is None:
        raise RuntimeError(f"model {a.model!r} is not a GGUF: llama.cpp needs one")
    port = free_port()
    cmd = [python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port)]
    # interrupt_requests False: its default aborts the running stream when a new request
    # arrives; a server under N concurrent clients must queue them instead.
    cmd += ["--n_ctx", "8192", "--model_alias", "bench", "--interrupt_requests", "False"]
    return Server("llama.cpp", cmd, port, out / "server-llamacpp.log", ready_path="/v1/models")


def transformers_server(out: Path, weights_dir: str, a) -> Server:
    exe = Path(sys.executable).with_name("transformers")
    if not exe.exists():
        raise RuntimeError("the `transformers` command is not installed beside this Python")
    port = free_port()
    cmd = [str(exe), "serve", weights_dir, "--host", "127.0.0.1", "--port", str(port), "--device", a.device]
    cmd += ["--dtype", "float32", "--log-level", "warning"]
    return Server("transformers", cmd, port, out / "server-transformers.log")


# ---- the load --------------------------------------------------------------------------------
async def one_request(http, url: str, body: dict, timeout: float) -> dict:
    """One streamed chat completion: client-side TTFT (to the first content delta), tokens."""
    t0 = time.perf_counter()
    ttft, deltas, usage, status = None, 0, None, None
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            status = r.status_code
            if status != 200:
                await r.aread()
                return {"ok": False, "status": status, "error": r.text[:200]}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = obj["usage"]
                for c in obj.get("choices") or []:
                    if (c.get("delta") or {}).get("content"):
                        deltas += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a bounded benchmark records a failed request and goes on
        return {"ok": False, "status": status, "error": f"{type(e).__name__}: {e}"[:200]}
    tokens = usage["completion_tokens"] if usage else deltas
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {
        "ok": ttft is not None,
        "ttft_s": ttft,
        "total_s": time.perf_counter() - t0,
        "tokens": tokens,
        "tokens_counted": "usage" if usage else "deltas",
        "cached_tokens": cached,
    }


async def load_cell(
    url: str, model: str, prompts: list, n: int, per_client: int, a, deadline: float, extra: dict | None = None
) -> dict:
    """``n`` streaming clients, each sending ``per_client`` requests one after the other (client
    ``i``'s ``j``-th sends ``prompts[(i * per_client + j) % len(prompts)]``); ``extra``: fields
    added to every body (another server's options, e.g. a ``logit_bias``)."""
    import httpx

    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(limits=limits) as http:

        async def client(i: int) -> list[dict]:
            out = []
            for j in range(per_client):
                if time.monotonic() > deadline:
                    break
                k = (i * per_client + j) % len(prompts)
                body = {
                    "model": model,
                    "messages": prompts[k],
                    "max_tokens": a.max_tokens,
                    "temperature": 0,
                    **({"ignore_eos": True} if a.ignore_eos else {}),
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    **(extra or {}),
                }
                out.append({**await one_request(http, url, body, a.request_timeout), "prompt": k})
            return out

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(i) for i in range(n))) for r in rs]
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft_s"] for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": sorted({r.get("error") or str(r.get("status")) for r in results if not r["ok"]})[:5],
        "wall_s": wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "output_tokens": sum(r["tokens"] for r in ok),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else None,
        "tokens_counted": sorted({r["tokens_counted"] for r in ok}),
        "cached_tokens_mean": statistics.fmean([r["cached_tokens"] or 0 for r in ok]) if ok else None,
        # Per prompt (its index): the one-client cell is compared with the in-process TTFT of
        # the same prompts, not of others (prompts differ in length, and so in prefill time).
        "ttft_by_prompt": {str(r["prompt"]): r["ttft_s"] for r in ok},
    }


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---- robustness -------------------------------------------------------------------------------
async def robustness(server: Server, model: str, prompt: list, n: int, a, deadline: float) -> dict:
    """``n`` hostile requests (four kinds in turn); RSS after a first tenth (the allocators'
    settling) and at the end; the server must still answer a good request."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        ctx = (await http.get(server.url + "/v1/models")).json()["data"][0].get("max_model_len") or 8192
    # One token per " word": over the context by a quarter, yet short enough in characters to
    # be tokenized (the 1M-character case is refused before that).
    over = [{"role": "user", "content": "word " * (ctx + ctx // 4)}]
    kinds = {
        "malformed": lambda: {"content": b'{"messages": [', "headers": {"content-type": "application/json"}},
        "1M_chars": lambda: {"json": {"model": model, "messages": [{"role": "user", "content": "x" * 1_000_000}]}},
        "over_context": lambda: {"json": {"model": model, "messages": over, "max_tokens": 4}},
    }
    statuses: dict[str, dict[str, int]] = {k: {} for k in [*kinds, "disconnect"]}
    rss_start = rss_settled = None
    t0 = time.perf_counter()
    sent = 0
    async with httpx.AsyncClient(timeout=a.request_timeout) as http:
        rss_start = server.rss_bytes()
        for i in range(n):
            if time.monotonic() > deadline:
                break
            if i == max(1, n // 10):
                rss_settled = server.rss_bytes()
            kind = [*kinds, "disconnect"][i % 4]
            if kind == "disconnect":
                body = {"model": model, "messages": prompt, "max_tokens": 512, "stream": True}
                async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
                    code = str(r.status_code)
                    async for line in r.aiter_lines():
                        if '"content"' in line:
                            break  # leave mid-answer: the connection closes here
            else:
                r = await http.post(server.url + "/v1/chat/completions", **kinds[kind]())
                code = str(r.status_code)
            statuses[kind][code] = statuses[kind].get(code, 0) + 1
            sent += 1
        await asyncio.sleep(2)  # let cancelled requests leave their slots
        health = (await http.get(server.url + "/health")).json()
        good = await one_request(
            http, server.url, {"model": model, "messages": prompt, "max_tokens": 4, "stream": True}, a.request_timeout
        )
        rss_end = server.rss_bytes()
    return {
        "requests": sent,
        "seconds": time.perf_counter() - t0,
        "statuses": statuses,
        "rss_start_mb": rss_start / 2**20,
        "rss_settled_mb": (rss_settled or rss_start) / 2**20,
        "rss_end_mb": rss_end / 2**20,
        "health_after": health,
        "good_request_after_ok": good["ok"],
    }


# ---- the run ----------------------------------------------------------------------------------
def start_server(out: Path, name: str, make, timeout: float) -> Server | None:
    """``make()``'s server, started within ``timeout`` s; None (recorded in ``out``'s journal as
    a row of the report) if it cannot start."""
    try:
        server = make()
        print(f"starting {name} ...", flush=True)
        server.start(timeout)
    except Exception as e:  # noqa: BLE001 - a server that cannot start is a row of the report
        record(out, {"phase": "unavailable", "server": name, "reason": str(e)[:1000]})
        print(f"{name}: not run: {str(e)[:300]}", flush=True)
        return None
    return server


def journal(out: Path) -> list[dict]:
    p = out / "results.jsonl"
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def record(out: Path, rec: dict) -> None:
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def build_prompts(rag, a) -> tuple[list, list[str]]:
    from kvrag.layout.prompt import rag_prompt
    from kvrag.qa.synthetic import generate

    count = lambda t: len(rag.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    items = generate(a.items, seed=0, n_passages=a.passages, passage_tokens=a.passage_tokens, count_tokens=count)
    prompts, passages = [], []
    for it in items:
        texts = [c["text"] for c in it["ctxs"]]
        passages += texts
        p = rag_prompt(rag.tokenizer, texts, it["question"])
        if isinstance(p, str):  # a base model (no chat template): the text as one user turn is not it
            raise SystemExit("serve_load.py sends chat requests: use a model with a chat template")
        prompts.append(p)
    return prompts, list(dict.fromkeys(passages))


def in_process_ttft(rag, prompts: list, a) -> dict:
    """One client in process: ``KVRag.stream`` from the call to its first delta, same prompts,
    after one untimed pass (the server's prompts are warm too)."""

    def once(p) -> float:
        t0 = time.perf_counter()
        s = rag.stream(p, max_new_tokens=a.max_tokens, temperature=0.0)
        next(iter(s), None)
        t = time.perf_counter() - t0
        for _ in s:
            pass
        return t

    for p in prompts:
        once(p)
    by_prompt = [once(p) for p in prompts]
    ttfts = sorted(by_prompt)
    return {
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "requests": len(ttfts),
        "ttft_by_prompt": {str(k): t for k, t in enumerate(by_prompt)},
    }


def run(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    done = {(r["phase"], r.get("server"), r.get("clients")) for r in journal(out)} if a.resume else set()
    if not a.resume and (out / "results.jsonl").exists():
        (out / "results.jsonl").unlink()
    deadline = time.monotonic() + a.time_limit
    import torch

    from kvrag.engine import KVRag

    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"loading {a.model} in process ...", flush=True)
    rag = KVRag(a.model, cache_dir=out / "store", policy=a.policy, device=a.device)
    prompts, passages = build_prompts(rag, a)
    if ("meta", None, None) not in done:
        record(
            out,
            {
                "phase": "meta",
                "model": a.model,
                "policy": a.policy,
                "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
                "torch_threads": torch.get_num_threads(),
                "device": a.device,
                "items": len(prompts),
                "passages": len(passages),
                "prompt_tokens_mean": statistics.fmean(rag.count_tokens(p) for p in prompts),
                "max_tokens": a.max_tokens,
                "ignore_eos": a.ignore_eos,
                "requests_per_client": a.requests_per_client,
                "command": " ".join(sys.argv),
                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            },
        )
    print(f"ingesting {len(passages)} passages ...", flush=True)
    rag.precompute(passages)
    if ("in_process", "kvrag", 1) not in done:
        rec = in_process_ttft(rag, prompts, a)
        record(out, {"phase": "in_process", "server": "kvrag", "clients": 1, **rec})
        print(f"in process: TTFT p50 {rec['ttft_p50_s'] * 1000:.0f} ms", flush=True)
    gguf = rag.handle.source if str(rag.handle.source or "").endswith(".gguf") else None
    weights_dir = rag.handle.load_info.get("weights_dir")
    del rag

    makers = {
        "kvrag": lambda: kvrag_server(out, a, a.policy),
        "kvrag-full_prefill": lambda: kvrag_server(out, a, "full_prefill"),
        "llama.cpp": lambda: llamacpp_server(out, gguf, a),
        "transformers": lambda: transformers_server(out, weights_dir, a),
    }
    for name in a.server_names:
        cells = [n for n in a.client_counts if ("load", name, n) not in done]
        want_robust = name == "kvrag" and a.robustness and ("robustness", name, None) not in done
        if not cells and not want_robust:
            continue
        if time.monotonic() > deadline:
            record(out, {"phase": "cut", "server": name, "clients": None, "reason": "--time-limit reached"})
            print(f"time limit reached: {name} not run", flush=True)
            continue
        server = start_server(out, name, makers[name], a.start_timeout)
        if server is None:
            continue
        try:
            model = "bench" if name == "llama.cpp" else (weights_dir if name == "transformers" else "kvrag")
            if name.startswith("kvrag"):
                ingest(server.url, passages)
            # Warm-up: every prompt once, one at a time (loads, allocations, hot tiers).
            asyncio.run(load_cell(server.url, model, prompts, 1, len(prompts), a, deadline))
            for n in cells:
                if time.monotonic() > deadline:
                    record(out, {"phase": "cut", "server": name, "clients": n, "reason": "--time-limit reached"})
                    continue
                # One client sends every prompt (at least): its TTFTs are compared prompt by prompt
                # with the in-process ones, and its tokens/s is the baseline of the others.
                per = max(a.requests_per_client, len(prompts)) if n == 1 else a.requests_per_client
                rec = asyncio.run(load_cell(server.url, model, prompts, n, per, a, deadline))
                record(out, {"phase": "load", "server": name, "clients": n, **rec})
                print(
                    f"{name} x{n}: TTFT p50 {fmt_ms(rec['ttft_p50_s'])} p95 {fmt_ms(rec['ttft_p95_s'])}, "
                    f"{rec['tokens_per_s'] or 0:.1f} tok/s, {rec['ok']}/{rec['requests']} ok",
                    flush=True,
                )
            if want_robust and time.monotonic() > deadline:
                record(out, {"phase": "cut", "server": name, "clients": None, "reason": "--time-limit reached"})
            elif want_robust:
                rec = asyncio.run(robustness(server, model, prompts[0], a.robustness, a, deadline))
                record(out, {"phase": "robustness", "server": name, **rec})
                print(
                    f"robustness: {json.dumps(rec['statuses'])}, RSS {rec['rss_settled_mb']:.0f} -> "
                    f"{rec['rss_end_mb']:.0f} MB",
                    flush=True,
                )
        finally:
            server.stop()
    write_report(out)
    return 0


def ingest(url: str, passages: list[str], timeout: float = 600) -> None:
    import httpx

    keys = []
    for i in range(0, len(passages), 256):
        r = httpx.post(url + "/v1/chunks", json={"texts": passages[i : i + 256]}, timeout=timeout)
        r.raise_for_status()
        keys += [d["key"] for d in r.json()["data"] if d.get("key")]
    deadline = time.monotonic() + timeout
    for k in keys:
        while not httpx.get(f"{url}/v1/chunks/{k}", timeout=30).json()["stored"]:
            if time.monotonic() > deadline:
                raise RuntimeError("chunks not stored in time")
            time.sleep(0.2)


def fmt_ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


# ---- report ---------------------------------------------------------------------------------
def write_report(out: Path) -> None:
    recs = journal(out)
    meta = next((r for r in recs if r["phase"] == "meta"), {})
    load = [r for r in recs if r["phase"] == "load"]
    servers = list(dict.fromkeys(r["server"] for r in load))
    cell = {(r["server"], r["clients"]): r for r in load}
    inproc = next((r for r in recs if r["phase"] == "in_process"), None)
    targets = {}
    k1, k8 = cell.get(("kvrag", 1)), cell.get(("kvrag", 8))
    f8 = cell.get(("kvrag-full_prefill", 8))
    if k1 and k8 and k1["tokens_per_s"]:
        targets["tokens_per_s_8_over_1"] = k8["tokens_per_s"] / k1["tokens_per_s"]
    if k8 and f8 and f8["ttft_p95_s"]:
        targets["p95_ttft_8_reuse_over_full"] = k8["ttft_p95_s"] / f8["ttft_p95_s"]
    if k1 and inproc and inproc["ttft_p50_s"]:
        # The same prompts on both sides where the records say which (older records do not).
        served, local = k1.get("ttft_by_prompt"), inproc.get("ttft_by_prompt")
        same = sorted(set(served or {}) & set(local or {}))
        if same and served and local:
            ratios = sorted(served[k] / local[k] for k in same)
            targets["server_over_in_process_ttft_p50"] = percentile(ratios, 50)
        else:
            targets["server_over_in_process_ttft_p50"] = k1["ttft_p50_s"] / inproc["ttft_p50_s"]
    report = {"meta": meta, "load": load, "in_process": inproc, "targets": targets}
    report["unavailable"] = [r for r in recs if r["phase"] == "unavailable"]
    report["robustness"] = next((r for r in recs if r["phase"] == "robustness"), None)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    lines = [
        "# kvrag serve load benchmark",
        "",
        f"Model `{meta.get('model')}`, policy `{meta.get('policy')}`, {meta.get('items')} prompts of "
        f"~{meta.get('prompt_tokens_mean', 0):.0f} tokens, {meta.get('max_tokens')} output tokens each"
        f"{' (ignore_eos: exactly that many)' if meta.get('ignore_eos') else ' at most'}; "
        f"machine: {meta.get('machine')}; started {meta.get('started')}.",
        f"Command: `{meta.get('command')}`",
        "",
        "| server | clients | TTFT p50 | TTFT p95 | output tok/s | ok/requests | cached tokens (mean) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in servers:
        for r in sorted((r for r in load if r["server"] == s), key=lambda r: r["clients"]):
            cached = "-" if r.get("cached_tokens_mean") is None else f"{r['cached_tokens_mean']:.0f}"
            lines.append(
                f"| {s} | {r['clients']} | {fmt_ms(r['ttft_p50_s'])} | {fmt_ms(r['ttft_p95_s'])} | "
                f"{r['tokens_per_s'] or 0:.1f} | {r['ok']}/{r['requests']} | {cached} |"
            )
    if inproc:
        lines += [
            "",
            f"In process (`KVRag.stream`, one client): TTFT p50 {fmt_ms(inproc['ttft_p50_s'])}, "
            f"p95 {fmt_ms(inproc['ttft_p95_s'])}.",
        ]
    if targets:
        lines += ["", "Targets (ratios from this run):"]
        names = {
            "tokens_per_s_8_over_1": "8 clients' output tok/s over 1 client's (target >= 3)",
            "p95_ttft_8_reuse_over_full": "p95 TTFT at 8 clients, reuse over full_prefill (target <= 1/3)",
            "server_over_in_process_ttft_p50": (
                "one-client TTFT, server over in-process on the same prompts, median (target <= 1.10)"
            ),
        }
        lines += [f"- {names[k]}: **{v:.2f}**" for k, v in targets.items()]
    for r in report["unavailable"]:
        lines += ["", f"Not run: **{r['server']}**: {r['reason']}"]
    ran = {(r["server"], r.get("clients")) for r in recs if r["phase"] in ("load", "robustness")}
    cut = [r for r in recs if r["phase"] == "cut" and (r["server"], r["clients"]) not in ran]
    if cut:
        what = ", ".join(f"{r['server']} x{r['clients']}" if r["clients"] else f"{r['server']}" for r in cut)
        lines += ["", f"Cut by `--time-limit` (rerun with `--resume` and more time): {what}."]
    rb = report["robustness"]
    if rb:
        lines += [
            "",
            f"Robustness ({rb['requests']} requests in {rb['seconds']:.0f} s): statuses {json.dumps(rb['statuses'])}; "
            f"server RSS {rb['rss_start_mb']:.0f} MB at start, {rb['rss_settled_mb']:.0f} MB after the first tenth, "
            f"{rb['rss_end_mb']:.0f} MB at the end; health after: {rb['health_after'].get('status')}, "
            f"a good request after: {'ok' if rb['good_request_after_ok'] else 'FAILED'}.",
        ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plot(out, load, servers)
    print(f"report: {out / 'report.md'}", flush=True)


def plot(out: Path, load: list[dict], servers: list[str]) -> None:
    if not load:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for s in servers:
        rs = sorted((r for r in load if r["server"] == s and r["ttft_p50_s"] is not None), key=lambda r: r["clients"])
        n = [r["clients"] for r in rs]
        (line,) = ax1.plot(n, [r["ttft_p50_s"] * 1000 for r in rs], marker="o", label=f"{s} p50")
        ax1.plot(n, [r["ttft_p95_s"] * 1000 for r in rs], marker="x", ls="--", color=line.get_color(), label=f"{s} p95")
        ax2.plot(n, [r["tokens_per_s"] for r in rs], marker="o", label=s)
    ax1.set(xlabel="concurrent clients", ylabel="TTFT (ms)", title="time to first token", yscale="log")
    ax2.set(xlabel="concurrent clients", ylabel="output tokens/s", title="aggregate throughput")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "serve_load.png", dpi=120)
    plt.close(fig)


def add_run_options(p: argparse.ArgumentParser, *, time_limit: float, start_timeout: float, quick_help: str) -> None:
    """The options a load benchmark's run takes (this one's and ``serve_vs_llamacpp``'s): its
    time bounds, a quick rehearsal, resuming a journal, and the report alone."""
    p.add_argument(
        "--time-limit", type=float, default=time_limit, help=f"seconds for the whole run (default {time_limit:.0f})"
    )
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument(
        "--start-timeout",
        type=float,
        default=start_timeout,
        help=f"seconds a server may take to be ready (default {start_timeout:.0f})",
    )
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--resume", action="store_true", help="keep results.jsonl and skip the cells it has")
    p.add_argument("--report-only", action="store_true", help="rewrite the report from results.jsonl")


def fill_profile(a: argparse.Namespace, profile: dict) -> None:
    """Every option of ``profile`` (``QUICK`` or ``FULL``) the command line left unset."""
    for k, v in profile.items():
        if getattr(a, k) is None:
            setattr(a, k, v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (results.jsonl, report.md/json, serve_load.png)")
    p.add_argument("--model", default="smollm2", help="kvrag model name, .gguf or HF dir (default smollm2)")
    p.add_argument("--policy", default="cacheblend", help="the reuse server's policy (default cacheblend)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads in process and in the kvrag servers (default: torch's)")
    p.add_argument(
        "--clients", help=f"comma-separated client counts (default {FULL['clients']}; quick {QUICK['clients']})"
    )
    p.add_argument("--items", type=int, help="distinct RAG prompts")
    p.add_argument("--requests-per-client", type=int)
    p.add_argument("--max-tokens", type=int, help="output tokens per request (at most, or exactly with --ignore-eos)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every answer runs to --max-tokens (vLLM's ignore_eos, as vLLM's serving benchmark sends it): "
        "throughput at a fixed answer length instead of where each answer happens to end",
    )
    p.add_argument("--passages", type=int, help="passages per prompt")
    p.add_argument("--passage-tokens", type=int)
    p.add_argument(
        "--servers",
        default="kvrag,kvrag-full_prefill,llama.cpp,transformers",
        help="which servers (default all four; one that cannot start is recorded as not run)",
    )
    p.add_argument(
        "--llama-cpp-python",
        default=sys.executable,
        metavar="PYTHON",
        help="the interpreter that has llama-cpp-python[server] (default this one)",
    )
    p.add_argument("--robustness", type=int, help="hostile requests in the robustness phase (default 1000; quick 20)")
    add_run_options(p, time_limit=3600, start_timeout=300, quick_help="tiny-scale rehearsal")
    a = p.parse_args(argv)
    if a.report_only:
        write_report(Path(a.out))
        return 0
    fill_profile(a, QUICK if a.quick else FULL)
    if a.robustness is None:
        a.robustness = 20 if a.quick else 1000
    a.client_counts = [int(x) for x in a.clients.split(",") if x.strip()]
    a.server_names = [s.strip() for s in a.servers.split(",") if s.strip()]
    unknown = set(a.server_names) - {"kvrag", "kvrag-full_prefill", "llama.cpp", "transformers"}
    if unknown or not a.client_counts or min(a.client_counts) < 1:
        p.error(f"bad --servers {sorted(unknown)} or --clients {a.clients!r}")
    return run(a)


if __name__ == "__main__":
    raise SystemExit(main())
