"""``kvrag worker --redis URL``: compute the chunks that replicas queued (``kvrag.precompute.redis_queue``).

Run any number of them, on any machine that has the model: they share the queue through a
Redis consumer group, and a job a worker was on when it died is taken over by another once
it has been idle ``--claim-idle`` seconds. Stop one with Ctrl-C / SIGTERM: its unfinished
jobs stay pending for the others.

The queue is one stream per cache fingerprint, and one model has several: the base model's,
and a KVLink-adapted copy's (an adapter with LoRA weights, shipped, trained into
``$KVRAG_HOME`` or named with ``--kvlink-adapter``), used by replicas whose policy is
``kvlink``. By default (``--serve all``) a worker serves every one of them, so replicas of any
policy get their chunks; ``--serve policy`` serves only the fingerprint of ``--policy``.
"""

from __future__ import annotations

import logging
import signal
import threading

from kvrag.cli._options import MODEL_HELP
from kvrag.defaults import (
    AUTO_POLICY,
    DEFAULT_CHUNK_ANCHOR,
    DEFAULT_COMPUTE_DTYPE,
    DEFAULT_SHARED_PREFIX,
    DEFAULT_STORAGE_DTYPE,
    STORAGE_DTYPES,
)


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
        default=AUTO_POLICY,
        help="the policy the worker's first KVRag is built with (default auto): its chunk extras are "
        "stored, and with --serve policy its fingerprint is the only one served",
    )
    p.add_argument(
        "--serve",
        choices=("all", "policy"),
        default="all",
        help="all (default): the jobs of every cache fingerprint the model can produce -- the base "
        "model's and its KVLink-adapted copy's (a LoRA adapter found for the model or given with "
        "--kvlink-adapter) -- so replicas of any policy get their chunks; policy: only --policy's",
    )
    p.add_argument(
        "--kvlink-adapter",
        default=None,
        metavar="DIR",
        help="also serve the replicas built with KVRag(kvlink_adapter=DIR) (default: the adapter found "
        "for the model, $KVRAG_HOME/kvlink/<key>/ or the one shipped)",
    )
    p.add_argument(
        "--dtype",
        default=DEFAULT_COMPUTE_DTYPE,
        help=f"compute dtype, as the replicas' KVRag(dtype=...) (default {DEFAULT_COMPUTE_DTYPE}): part of "
        "the cache fingerprint",
    )
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:1, ...)")
    p.add_argument(
        "--chunk-anchor",
        default=DEFAULT_CHUNK_ANCHOR,
        help="as the replicas' KVRag(chunk_anchor=...): auto (default), none, or comma-separated token ids",
    )
    p.add_argument("--cache-dir", default=None, help="the worker's local store (default: $KVRAG_HOME/store)")
    p.add_argument(
        "--storage-dtype",
        default=DEFAULT_STORAGE_DTYPE,
        choices=STORAGE_DTYPES,
        help=f"format of stored K/V, as the replicas' ({DEFAULT_STORAGE_DTYPE})",
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


def _anchor(text: str):
    if text in ("auto", "none"):
        return text
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--chunk-anchor must be auto, none or comma-separated token ids, got {text!r}") from None


def serving_rags(args, far) -> list:
    """The KVRags of every cache fingerprint the worker serves (one per fingerprint): the one
    ``--policy`` builds, then (``--serve all``) the base model's and the KVLink-adapted copy's."""
    from kvrag.engine import KVRag
    from kvrag.model import ModelHandle
    from kvrag.policies.kvlink.adapter import find_adapter
    from kvrag.policies.model_defaults import fallback

    handle = ModelHandle.load(args.model, dtype=args.dtype, device=args.device)
    common = dict(
        cache_dir=args.cache_dir,
        storage_dtype=args.storage_dtype,
        ingest_policies=[p for p in args.ingest_policies.split(",") if p],
        chunk_anchor=_anchor(args.chunk_anchor),
        shared=far,
    )
    adapter = args.kvlink_adapter or "default"
    rags: dict[str, KVRag] = {}

    def add(policy: str, kvlink_adapter) -> None:
        rag = KVRag(handle, policy=policy, kvlink_adapter=kvlink_adapter, **common)
        rags.setdefault(rag.fingerprint, rag)

    add(args.policy, adapter)
    if args.serve == "all":
        # The base model: a policy that applies no LoRA (the fallback default; links-only
        # adapters change no fingerprint) ...
        add(fallback().policy, "links")
        # ... and the adapted copy, when there is an adapter to apply.
        if args.kvlink_adapter is not None or find_adapter(handle) is not None:
            add("kvlink", adapter)
    return list(rags.values())


def run(args) -> int:
    from kvrag.policies.kvlink.policy import ADAPTER_ATTR
    from kvrag.precompute.worker import Worker
    from kvrag.store import open_shared

    if args.batch < 1 or args.claim_idle <= 0:
        raise ValueError("--batch must be >= 1 and --claim-idle > 0")
    _anchor(args.chunk_anchor)  # a bad value fails before the model load
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rags = serving_rags(args, open_shared(args.redis, prefix=args.prefix))
    worker = Worker(rags, name=args.name, batch=args.batch, claim_idle_s=args.claim_idle)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    for lane in worker.lanes:
        ad = getattr(lane.rag.handle.model, ADAPTER_ATTR, None)
        what = f"KVLink adapter {ad.path}" if ad is not None and ad.has_lora else "the base model"
        print(
            f"kvrag worker {worker.name}: consuming {lane.queue.stream} ({what}, fingerprint "
            f"{lane.rag.fingerprint[:16]}...)",
            flush=True,
        )
    done = worker.run(stop, until_idle=args.until_idle)
    print(f"kvrag worker {worker.name}: {done} job(s) done", flush=True)
    return 0
