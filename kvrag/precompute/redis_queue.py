"""Precompute across machines: the Redis Stream of chunk texts replicas queue (``RedisQueue``).

A replica built with ``KVRag(shared="redis://...", precompute_via="queue")`` hands the chunks
it ingests to ``RedisQueue.submit`` (``KVRag.precompute`` and so the ``Precomputer`` and every
ingestion hook call it) instead of computing them; ``kvrag worker --redis URL`` processes
(``kvrag.precompute.worker.Worker``), on any machine with the model, compute them into the shared store.

Redis Streams with a consumer group give the guarantees (no hand-rolled queue):

* **at-least-once**: a worker reads jobs with ``XREADGROUP`` and acknowledges one
  (``XACK``, then ``XDEL``, so the stream's length is the work left) only once its entry is
  whole in the shared store; a worker that dies leaves its jobs pending, and another takes
  them over with ``XAUTOCLAIM`` once they have been idle ``claim_idle_s``.
* **dedup**: ``submit`` skips a chunk already in the shared store and one that another
  replica queued (a ``SET NX`` claim with a TTL, removed when the job is done), so N replicas
  ingesting the same document queue it once; a worker skips a job whose chunk is stored.
* **no partial entry**: an entry becomes visible only with its meta, written after all its
  parts in one transaction (``kvrag.store.redis_store``).

One stream per cache fingerprint (``<prefix>q:{<fingerprint>}``): a worker only takes jobs
for the model and anchor it runs. The stream, its counters, its failures and its claims
(``<prefix>q:{<fingerprint>}:claim:<key>``) share the hash tag ``{<fingerprint>}``, so the
transaction that acknowledges a job stays in one slot of a Redis Cluster.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from kvrag.checks import check_texts_iterable
from kvrag.errors import ChunkError, KVRagError

log = logging.getLogger(__name__)

GROUP = "kvrag-workers"


def streams_key(prefix: str) -> str:
    """The set of the fingerprints that have a queue under ``prefix`` (for ``kvrag cache stats``)."""
    return f"{prefix}q:streams"


class RedisQueue:
    """The precompute queue of one cache fingerprint on the shared store's Redis.

    store: a ``kvrag.store.redis_store.RedisStore`` (its connection and key prefix are used).
    claim_ttl_s: how long a queued chunk is not queued again by another replica (the claim
    is removed when it is done; the TTL only matters if the job itself is lost)."""

    def __init__(self, store, fingerprint: str, *, claim_ttl_s: int = 3600) -> None:
        if not hasattr(store, "client") or not hasattr(store, "prefix"):
            raise TypeError(f"precompute_via='queue' needs a Redis shared store, got {type(store).__name__}")
        if not isinstance(fingerprint, str) or not fingerprint or "{" in fingerprint or "}" in fingerprint:
            raise ValueError(f"fingerprint must be a non-empty string without braces, got {fingerprint!r}")
        self.store = store
        self.fingerprint = fingerprint
        self.claim_ttl_s = int(claim_ttl_s)
        p = store.prefix
        # One hash tag for every key of this queue: _ack's transaction touches four of them.
        self.stream = f"{p}q:{{{fingerprint}}}"
        self.claim_prefix = f"{self.stream}:claim:"
        self.counts_key = f"{self.stream}:counts"
        self.failed_key = f"{self.stream}:failed"
        self.streams_index = streams_key(p)
        self.group_ready = False

    @property
    def client(self):
        return self.store.client  # a cluster's client is made at first use (RedisStore.client)

    def ensure_group(self) -> None:
        import redis

        if self.group_ready:
            return
        try:
            self.client.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self.client.sadd(self.streams_index, self.fingerprint)
        self.group_ready = True

    def repair(self) -> list[str]:
        """Delete this queue's keys that hold a type kvrag does not write there (a crafted or
        clashing value would fail every command on them, for good); returns their names. The
        jobs of a stream replaced this way were not kvrag's to begin with."""
        expected = {self.stream: "stream", self.counts_key: "hash", self.failed_key: "hash", self.streams_index: "set"}
        p = self.client.pipeline(transaction=False)
        for name in expected:
            p.type(name)
        found = [t.decode() if isinstance(t, bytes) else str(t) for t in p.execute()]
        bad = [n for (n, want), t in zip(expected.items(), found) if t not in (want, "none")]
        for n in bad:
            self.client.delete(n)
            log.warning("kvrag queue: %s held a value kvrag does not write there; deleted it", n)
        if bad:
            self.group_ready = False
        return bad

    # ---- producer ------------------------------------------------------------------
    def submit(self, texts: Iterable[str], ingestor) -> list[str]:
        """Queue the texts whose chunk is neither stored nor queued; returns every text's key.
        ``ingestor``: the replica's ``kvrag.precompute.ingest.Ingestor`` (tokenization, keys, listing).
        Raises ``kvrag.store.redis_store.SharedStoreDown`` if Redis cannot be reached: nothing
        is lost silently (the ``Precomputer`` keeps the texts as retryable failures)."""
        from kvrag.store.redis_store import SharedStoreDown, SharedStoreRefused, error_cause

        check_texts_iterable(texts, "precompute")
        texts = list(texts)
        keys = []
        for i, t in enumerate(texts):
            try:
                keys.append(ingestor.key(ingestor.chunk_ids(t)))
            except (ChunkError, TypeError, ValueError) as e:
                raise type(e)(f"text {i} of {len(texts)}: {e}") from e
        try:
            self.ensure_group()
            queued = 0
            for key, text in dict(zip(keys, texts)).items():
                if ingestor.ensure_listed(key, text):
                    continue  # stored (by anyone): registered with the segmenter, nothing to do
                if not self.client.set(self.claim_prefix + key, os.getpid(), nx=True, ex=self.claim_ttl_s):
                    continue  # queued by another replica (or by us) and not done yet
                self.client.xadd(self.stream, {"key": key, "text": text.encode("utf-8")})
                queued += 1
            if queued:
                self.client.hincrby(self.counts_key, "queued", queued)
        except KVRagError:
            raise
        except Exception as e:
            import redis
            from redis.exceptions import ClusterError, RedisClusterException

            if isinstance(e, (redis.ConnectionError, redis.TimeoutError, ClusterError, RedisClusterException)):
                raise SharedStoreDown(f"cannot queue chunks on {self.store.outage.what}: {e}") from e
            if isinstance(e, redis.RedisError):  # an error reply (OOM, READONLY, WRONGTYPE, ...)
                if error_cause(e) == "WRONGTYPE":
                    try:
                        self.repair()
                    except redis.RedisError:
                        pass
                raise SharedStoreRefused(
                    f"cannot queue chunks on {self.store.outage.what}: {error_cause(e)}: {e}"
                ) from e
            raise
        return keys

    def progress(self) -> dict[str, Any]:
        """queued (jobs not done: in the stream, read or not), pending (read by a worker, not
        acknowledged yet), done, failed, consumers (workers seen)."""
        import redis

        p = self.client.pipeline(transaction=False)
        p.xlen(self.stream)
        p.hgetall(self.counts_key)
        length, counts = p.execute()
        try:
            groups = self.client.xinfo_groups(self.stream)
        except redis.ResponseError:  # no stream yet
            groups = []
        group: dict = next((g for g in groups if g.get("name") in (GROUP, GROUP.encode())), {})
        c = {k.decode(): int(v) for k, v in counts.items()}
        return {
            "stream": self.stream,
            "queued": int(length),
            "pending": int(group.get("pending", 0)),
            "consumers": int(group.get("consumers", 0)),
            "submitted": c.get("queued", 0),
            "done": c.get("done", 0),
            "failed": c.get("failed", 0),
        }

    def failures(self) -> dict[str, str]:
        """key -> error of the jobs that failed for good (a text the model cannot take)."""
        return {k.decode(): json.loads(v)["error"] for k, v in self.client.hgetall(self.failed_key).items()}

    def wait(self, keys: Iterable[str] | None = None, timeout: float | None = None, poll_s: float = 0.1) -> bool:
        """Block until ``keys`` are in the shared store (None: until the stream is empty);
        False if ``timeout`` passed first. Keys that failed for good count as finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = list(dict.fromkeys(keys)) if keys is not None else None
        while True:
            if left is None:
                if self.client.xlen(self.stream) == 0:
                    return True
            else:
                failed = set(self.failures()) if left else set()
                left = [k for k in left if k not in failed and not self.store.ensure_indexed(k)]
                if not left:
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
