"""``kvrag worker --redis URL``: compute the chunks that replicas queued (``kvrag.precompute.redis_queue``).

Run any number of them, on any machine that has the model: they share the queue through a
Redis consumer group, and a job a worker was on when it died is taken over by another once
it has been idle ``--claim-idle`` seconds. Stop one with Ctrl-C / SIGTERM: its unfinished
jobs stay pending for the others.
"""

from __future__ import annotations

import logging
import signal
import threading

from kvrag.cli._options import MODEL_HELP
from kvrag.defaults import DEFAULT_POLICY, DEFAULT_SHARED_PREFIX, DEFAULT_STORAGE_DTYPE


def register(sub) -> None:
    p = sub.add_parser(
        "worker",
        help="compute queued chunks into a shared Redis store",
        description="Consume the precompute queue that replicas built with "
        "KVRag(shared=URL, precompute_via='queue') fill (docs/deploy.md).",
    )
    p.add_argument(
        "--redis",
        required=True,
        metavar="URL",
        help="the shared store, e.g. redis://host:6379/0 (rediss:// for TLS, redis+cluster://host:6379 "
        "for a Redis Cluster; the password in the URL or in $KVRAG_REDIS_PASSWORD)",
    )
    p.add_argument(
        "--prefix",
        default=DEFAULT_SHARED_PREFIX,
        help=f"key prefix of the shared store (default {DEFAULT_SHARED_PREFIX})",
    )
    p.add_argument("--model", default=None, help=f"{MODEL_HELP}; the replicas' model: jobs are per model fingerprint")
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help="the replicas' default policy (default auto): a default that runs the model's KVLink "
        "adapter (kvlink) has chunks of its own, so the worker must compute those",
    )
    p.add_argument("--cache-dir", default=None, help="the worker's local store (default: $KVRAG_HOME/store)")
    p.add_argument(
        "--storage-dtype",
        default=DEFAULT_STORAGE_DTYPE,
        help=f"dtype of stored K/V, as the replicas' ({DEFAULT_STORAGE_DTYPE})",
    )
    p.add_argument(
        "--ingest-policies",
        default="",
        help="comma-separated policies whose per-chunk extras the replicas store (e.g. a2ats)",
    )
    p.add_argument("--batch", type=int, default=8, help="jobs taken and computed together (default 8)")
    p.add_argument(
        "--claim-idle",
        type=float,
        default=60.0,
        help="seconds after which a job pending on a silent worker is taken over (default 60)",
    )
    p.add_argument("--until-idle", action="store_true", help="exit once the queue is empty")
    p.add_argument("--name", default=None, help="consumer name (default host:pid)")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvrag.engine import KVRag
    from kvrag.precompute.worker import Worker
    from kvrag.store import open_shared

    if args.batch < 1 or args.claim_idle <= 0:
        raise ValueError("--batch must be >= 1 and --claim-idle > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    policies = [p for p in args.ingest_policies.split(",") if p]
    rag = KVRag(
        args.model,
        cache_dir=args.cache_dir,
        policy=args.policy,
        storage_dtype=args.storage_dtype,
        ingest_policies=policies,
        shared=open_shared(args.redis, prefix=args.prefix),
    )
    worker = Worker(rag, name=args.name, batch=args.batch, claim_idle_s=args.claim_idle)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"kvrag worker {worker.name}: consuming {worker.queue.stream}", flush=True)
    done = worker.run(stop, until_idle=args.until_idle)
    print(f"kvrag worker {worker.name}: {done} job(s) done", flush=True)
    return 0
