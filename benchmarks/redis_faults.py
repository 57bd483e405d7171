"""The cost of the fault audit's crafted values on the shared tier (docs/bench/redis_faults):
peak RSS growth and wall time of the call that meets each one, each case in its own process
(ru_maxrss is a process's peak). Against the Redis at $KVRAG_BENCH_REDIS (default the local
one), under a throwaway prefix deleted afterwards.

    python benchmarks/redis_faults.py            # every case, one JSON line each
    python benchmarks/redis_faults.py meta-huge  # one case
"""
# ruff: noqa: E402, E501

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import redis
from test_shared_store import FP, entry

from kvrag.store.redis_store import RedisStore


def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


URL = os.environ.get("KVRAG_BENCH_REDIS", "redis://127.0.0.1:6379/0")
CASES = [
    "meta-huge",
    "meta-bounded-noparts",
    "meta-2^31",
    "index-200k",
    "job-alone",
    "job-with-mates",
    "chunk_ids-20MB",
]
if len(sys.argv) < 2:
    for name in CASES:
        subprocess.run([sys.executable, __file__, name], check=True)
    sys.exit(0)
prefix = f"kvrag-measure:{uuid.uuid4().hex[:8]}:"
c = redis.Redis.from_url(URL)
case = sys.argv[1]
BOUND = 412_483_584  # entry_bytes_bound(SmolLM2-135M, 8192 tokens, fp16)
res = {"case": case}
try:
    if case.startswith("meta"):
        s = RedisStore(URL, prefix=prefix, max_entry_bytes=BOUND)
        key, e = entry(1, t=40)
        s.put(key, e)
        s.get(key, FP)
        fields = {
            "meta-huge": {"size": 2**34, "part_size": 1024, "parts": 2**24},
            "meta-bounded-noparts": {"ver": "abc", "size": BOUND, "part_size": 1024, "parts": -(-BOUND // 1024)},
            "meta-2^31": {"size": 2**31},
        }[case]
        for what in ("get", "ensure_indexed"):
            s.put(key, e)
            c.hset(s._meta(key), mapping=fields)
            p0, t0 = peak(), time.perf_counter()
            r = s.get(key, FP) if what == "get" else s.ensure_indexed(key)
            res[what] = {
                "result": r if r in (None, False) else "HIT",
                "s": round(time.perf_counter() - t0, 4),
                "peak_rss_growth_mb": round(peak() - p0, 1),
            }
        res["corrupt"] = s.stats()["corrupt"]
    elif case == "index-200k":
        s = RedisStore(URL, prefix=prefix)
        p = c.pipeline(transaction=False)
        for j in range(0, 200_000, 10_000):
            p.hset(
                s._idx,
                mapping={
                    f"crafted{i}": json.dumps({"text": "x" * 1000 + str(i), "fingerprint": FP})
                    for i in range(j, j + 10_000)
                },
            )
            p.execute()
        c.incr(s._idxv)
        base = peak()
        p0, t0 = peak(), time.perf_counter()
        n = len(s.texts(FP))
        t1 = time.perf_counter()
        s.texts(FP)
        t2 = time.perf_counter()
        res.update(
            listed=n, first_s=round(t1 - t0, 3), second_s=round(t2 - t1, 4), peak_rss_growth_mb=round(peak() - p0, 1)
        )
    elif case.startswith("job"):
        from kvrag.engine import KVRag
        from kvrag.precompute.worker import Worker
        from kvrag.testing import tiny_llama

        d = tempfile.mkdtemp()
        h = tiny_llama(seed=0, max_position_embeddings=8192)
        w = KVRag(h, cache_dir=d + "/w", shared=RedisStore(URL, prefix=prefix))
        prod = KVRag(h, cache_dir=d + "/p", shared=RedisStore(URL, prefix=prefix), precompute_via="queue")
        q = prod.queue
        q.ensure_group()
        worker = Worker(w, block_s=0.1)
        keys = prod.precompute(["warm up the worker's code paths once."])
        worker.step()
        # The 50 MB payload is made in another process: not in this one's peak.
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import redis,sys; redis.Redis.from_url(sys.argv[1]).xadd(sys.argv[2], {'key': '0'*64, 'text': b'a' * (50 * 2**20)})",
                URL,
                q.stream,
            ],
            check=True,
        )
        mates = ["The red fox lives in the forest.", "Mount Kelvar is tall.", "The river Lenne flows east."]
        if case == "job-with-mates":
            keys = q.submit(mates, prod.ingestor)
        p0, t0 = peak(), time.perf_counter()
        done = worker.step()
        res.update(
            s=round(time.perf_counter() - t0, 3),
            peak_rss_growth_mb=round(peak() - p0, 1),
            done=done,
            failed=list(q.failures()),
            stored=sum(k in prod.store.far for k in keys) if case == "job-with-mates" else None,
        )
    elif case == "chunk_ids-20MB":
        from kvrag.engine import KVRag
        from kvrag.testing import tiny_llama

        rag = KVRag(tiny_llama(seed=0, max_position_embeddings=8192), cache_dir=tempfile.mkdtemp())
        rag.ingestor.chunk_ids("warm up")
        text = "word " * (4 * 2**20)
        p0, t0 = peak(), time.perf_counter()
        try:
            rag.ingestor.chunk_ids(text)
        except Exception as ex:  # noqa: BLE001 - each fault case records what it raised
            res.update(
                s=round(time.perf_counter() - t0, 4), peak_rss_growth_mb=round(peak() - p0, 1), error=type(ex).__name__
            )
finally:
    ks = list(c.scan_iter(match=prefix + "*", count=1000))
    for i in range(0, len(ks), 1000):
        c.delete(*ks[i : i + 1000])
print(json.dumps(res))
