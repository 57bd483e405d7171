"""Precompute: chunk texts -> K/V entries in the store, now or in the background, here or on
other machines.

``ingest`` (``Ingestor``: the one ingestion computation), ``local`` (``Precomputer``: the
in-process thread queue; ``progress``: its counters, failures and errors; ``packs``: one pack's
computation; ``worker_threads``: its threads' torch setting and exit hook), ``redis_queue``
(``RedisQueue``: the Redis Stream replicas queue chunks on), ``worker`` (``Worker``: computes a
Redis queue's jobs). Importing this package loads neither torch nor redis; the names below are
the background queue's public API."""

from kvrag.precompute.local import Precomputer, pending_in_prompt
from kvrag.precompute.progress import PrecomputeFailure, PrecomputeProgress, PrecomputerClosedError, QueueFullError

__all__ = [
    "PrecomputeFailure",
    "PrecomputeProgress",
    "Precomputer",
    "PrecomputerClosedError",
    "QueueFullError",
    "pending_in_prompt",
]
