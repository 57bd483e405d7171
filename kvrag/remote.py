"""Precompute across machines: a Redis Stream of chunk texts and the workers that consume it.

A replica built with ``KVRag(shared="redis://...", precompute_via="queue")`` hands the chunks
it ingests to ``RedisQueue.submit`` (``KVRag.precompute`` and so the ``Precomputer`` and every
ingestion hook call it) instead of computing them; ``kvrag worker --redis URL`` processes
(``Worker``), on any machine with the model, compute them into the shared store.

Redis Streams with a consumer group give the guarantees (no hand-rolled queue):

* **at-least-once**: a worker reads jobs with ``XREADGROUP`` and acknowledges one
  (``XACK``, then ``XDEL``, so the stream's length is the work left) only once its entry is
  whole in the shared store; a worker that dies leaves its jobs pending, and another takes
  them over with ``XAUTOCLAIM`` once they have been idle ``claim_idle_s``.
* **dedup**: ``submit`` skips a chunk already in the shared store and one that another
  replica queued (a ``SET NX`` claim with a TTL, removed when the job is done), so N replicas
  ingesting the same document queue it once; a worker skips a job whose chunk is stored.
* **no partial entry**: an entry becomes visible only with its meta, written after all its
  parts in one transaction (``kvrag.store.shared``).

One stream per cache fingerprint (``<prefix>q:{<fingerprint>}``): a worker only takes jobs
for the model and anchor it runs. The stream, its counters, its failures and its claims
(``<prefix>q:{<fingerprint>}:claim:<key>``) share the hash tag ``{<fingerprint>}``, so the
transaction that acknowledges a job stays in one slot of a Redis Cluster.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from kvrag.checks import check_texts_iterable
from kvrag.errors import ChunkError, KVRagError, StoreError

log = logging.getLogger("kvrag.remote")

GROUP = "kvrag-workers"


def streams_key(prefix: str) -> str:
    """The set of the fingerprints that have a queue under ``prefix`` (for ``kvrag cache stats``)."""
    return f"{prefix}q:streams"


class RedisQueue:
    """The precompute queue of one cache fingerprint on the shared store's Redis.

    store: a ``kvrag.store.shared.RedisStore`` (its connection and key prefix are used).
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
        self._claim = f"{self.stream}:claim:"
        self._counts = f"{self.stream}:counts"
        self._failed = f"{self.stream}:failed"
        self._streams = streams_key(p)
        self._group_ready = False

    @property
    def client(self):
        return self.store.client  # a cluster's client is made at first use (RedisStore.client)

    def ensure_group(self) -> None:
        import redis

        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self.client.sadd(self._streams, self.fingerprint)
        self._group_ready = True

    def repair(self) -> list[str]:
        """Delete this queue's keys that hold a type kvrag does not write there (a crafted or
        clashing value would fail every command on them, for good); returns their names. The
        jobs of a stream replaced this way were not kvrag's to begin with."""
        expected = {self.stream: "stream", self._counts: "hash", self._failed: "hash", self._streams: "set"}
        p = self.client.pipeline(transaction=False)
        for name in expected:
            p.type(name)
        found = [t.decode() if isinstance(t, bytes) else str(t) for t in p.execute()]
        bad = [n for (n, want), t in zip(expected.items(), found) if t not in (want, "none")]
        for n in bad:
            self.client.delete(n)
            log.warning("kvrag queue: %s held a value kvrag does not write there; deleted it", n)
        if bad:
            self._group_ready = False
        return bad

    # ---- producer ------------------------------------------------------------------
    def submit(self, texts: Iterable[str], ingestor) -> list[str]:
        """Queue the texts whose chunk is neither stored nor queued; returns every text's key.
        ``ingestor``: the replica's ``kvrag.ingest.Ingestor`` (tokenization, keys, listing).
        Raises ``kvrag.store.shared.SharedStoreDown`` if Redis cannot be reached: nothing
        is lost silently (the ``Precomputer`` keeps the texts as retryable failures)."""
        from kvrag.store.shared import SharedStoreDown

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
                if not self.client.set(self._claim + key, os.getpid(), nx=True, ex=self.claim_ttl_s):
                    continue  # queued by another replica (or by us) and not done yet
                self.client.xadd(self.stream, {"key": key, "text": text.encode("utf-8")})
                queued += 1
            if queued:
                self.client.hincrby(self._counts, "queued", queued)
        except KVRagError:
            raise
        except Exception as e:
            import redis
            from redis.exceptions import ClusterError, RedisClusterException

            from kvrag.store.shared import SharedStoreRefused, error_cause

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
        p.hgetall(self._counts)
        length, counts = p.execute()
        try:
            groups = self.client.xinfo_groups(self.stream)
        except redis.ResponseError:  # no stream yet
            groups = []
        group = next((g for g in groups if g.get("name") in (GROUP, GROUP.encode())), {})
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
        return {k.decode(): json.loads(v)["error"] for k, v in self.client.hgetall(self._failed).items()}

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


class Worker:
    """Consumes one fingerprint's precompute stream for ``rag`` (a ``KVRag`` built with the
    same model and ``shared=`` URL, computing locally).

    name: the consumer name (default host:pid). batch: jobs read at a time (computed in one
    packed pass). claim_idle_s: a job pending that long on a worker is taken over (longer
    than a batch takes). block_s: how long one read waits for new jobs. retry_s: the first
    wait after Redis fails or answers an error, doubled on each failure in a row up to
    ``max_retry_s``."""

    def __init__(
        self,
        rag,
        *,
        name: str | None = None,
        batch: int = 8,
        claim_idle_s: float = 60.0,
        block_s: float = 1.0,
        retry_s: float = 2.0,
        max_retry_s: float = 30.0,
    ) -> None:
        far = getattr(rag.store, "far", None)
        if far is None or not hasattr(far, "client"):
            raise ValueError("a worker needs a KVRag with a Redis shared store (shared='redis://...')")
        if rag.queue is not None:
            raise ValueError("a worker computes its jobs: build its KVRag with precompute_via='local'")
        self.rag = rag
        self.queue = RedisQueue(far, rag.fingerprint)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.batch = batch
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.block_ms = int(block_s * 1000)
        self.retry_s = float(retry_s)
        self.max_retry_s = float(max_retry_s)
        self.done = 0
        self.errors = 0  # Redis failures and error replies waited out
        self._causes: set[str] = set()

    @property
    def client(self):
        return self.queue.client

    def _take(self) -> list[tuple[bytes, dict]]:
        """Up to ``batch`` jobs: first those a dead worker left pending, then new ones."""
        q = self.queue
        claimed = self.client.xautoclaim(
            q.stream, GROUP, self.name, min_idle_time=self.claim_idle_ms, start_id="0-0", count=self.batch
        )
        msgs = [m for m in claimed[1] if m and m[1]]
        if msgs:
            log.info("kvrag worker %s: took over %d job(s) of a worker that stopped", self.name, len(msgs))
            return msgs
        got = self.client.xreadgroup(GROUP, self.name, {q.stream: ">"}, count=self.batch, block=self.block_ms)
        return [m for _, entries in (got or []) for m in entries if m and m[1]]

    def step(self) -> int:
        """Take and process one batch; returns the jobs finished (acknowledged)."""
        self.queue.ensure_group()
        msgs = self._take()
        if not msgs:
            return 0
        ing = self.rag.ingestor
        jobs, bad = [], []
        for mid, fields in msgs:
            try:
                check_job_bytes(fields.get(b"text"), ing.max_chars, self.rag.handle.max_context)
                key, text = fields[b"key"].decode("ascii"), fields[b"text"].decode("utf-8")
                if ing.key(ing.chunk_ids(text)) != key:
                    raise ChunkError("the job's key is not its text's key (another model, or not kvrag's)")
            except (KeyError, UnicodeDecodeError, ChunkError, ValueError, TypeError) as e:
                bad.append((mid, fields.get(b"key", b"?").decode("ascii", "replace"), e))
                continue
            jobs.append((mid, key, text))
        far, near = self.rag.store.far, self.rag.store.near
        todo = []
        for mid, key, text in jobs:
            if far.ensure_indexed(key):
                continue  # stored in Redis meanwhile (another worker, a replica's write-through)
            # On this worker's disk but not in Redis (flushed, evicted, another prefix): copy
            # it up instead of computing it again (``rag.precompute`` would skip it as stored).
            entry = near.get(key, self.rag.fingerprint)
            if entry is not None:
                try:
                    far.put(key, entry)
                except StoreError as e:  # Redis refusing writes: left pending, retried
                    log.error("kvrag worker %s: job %s not copied up (left pending): %s", self.name, key, e)
            else:
                todo.append((mid, key, text))
        errors: dict[str, BaseException] = {}
        if todo:
            try:
                self.rag.precompute([t for _, _, t in todo])
            except Exception:
                for _, key, text in todo:  # find the culprit(s): each alone
                    try:
                        self.rag.precompute([text])
                    except Exception as e:
                        errors[key] = e
        finished = 0
        for mid, key, text in jobs:
            if key in errors:
                e = errors[key]
                if isinstance(e, ChunkError):  # the text itself: it will never succeed
                    bad.append((mid, key, e))
                else:
                    log.error("kvrag worker %s: job %s failed (left pending, retried): %s", self.name, key, e)
                continue
            # Acknowledged only once the entry is whole in the shared store: if the write to
            # Redis failed, the job stays pending and is retried (by us or another worker).
            if not far.ensure_indexed(key):
                log.error(
                    "kvrag worker %s: chunk %s is not in the shared store after computing it; left pending",
                    self.name,
                    key,
                )
                continue
            self._ack(mid, key, "done")
            finished += 1
        for mid, key, e in bad:
            log.error("kvrag worker %s: job %s dropped: %s", self.name, key, e)
            self.client.hset(self.queue._failed, key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
            self._ack(mid, key, "failed")
        self.done += finished
        return finished

    def _ack(self, mid, key: str, outcome: str) -> None:
        q = self.queue
        t = self.client.pipeline(transaction=True)
        t.xack(q.stream, GROUP, mid)
        t.xdel(q.stream, mid)
        t.delete(q._claim + key)
        t.hincrby(q._counts, outcome, 1)
        t.execute()

    def run(self, stop: threading.Event | None = None, *, until_idle: bool = False) -> int:
        """Process jobs until ``stop`` is set (or, with ``until_idle``, until a read finds
        none and nothing is pending); Redis outages are waited out. Returns the jobs done."""
        import redis
        from redis.exceptions import ClusterError, RedisClusterException

        stop = stop or threading.Event()
        wait = self.retry_s
        while not stop.is_set():
            try:
                n = self.step()
                idle = n == 0 and until_idle and self.queue.progress()["queued"] == 0
            except (redis.RedisError, ClusterError, RedisClusterException, StoreError) as e:
                # Unreachable, or an error reply (READONLY after a REPLICAOF, NOGROUP after the
                # stream was evicted, OOM, WRONGTYPE on a key of the queue): wait it out, then
                # start over from the consumer group, which is re-created if it is gone.
                self._failed(e, wait)
                stop.wait(wait)
                wait = min(wait * 2, self.max_retry_s)
                continue
            wait = self.retry_s
            if idle:
                break
        return self.done

    def _failed(self, e: BaseException, wait: float) -> None:
        """Log a failure (a warning the first time for each cause), repair the queue's keys
        after a WRONGTYPE, and make the next step re-create the consumer group."""
        from kvrag.store.shared import error_cause

        self.errors += 1
        self.queue._group_ready = False
        cause = error_cause(e)
        level = logging.INFO if cause in self._causes else logging.WARNING
        self._causes.add(cause)
        log.log(level, "kvrag worker %s: Redis failed (%s: %s); retrying in %g s", self.name, cause, e, wait)
        if cause == "WRONGTYPE":
            try:
                self.queue.repair()
            except Exception as r:  # the next try repairs it
                log.info("kvrag worker %s: could not repair the queue's keys yet: %s", self.name, r)


def check_job_bytes(raw: object, max_chars: int | None, max_tokens: int) -> None:
    """ChunkError for a job whose text is so long in bytes that it cannot fit in the model's
    context (UTF-8: at least one byte a character), before it is decoded or tokenized: one
    crafted 50 MB stream entry must cost a worker neither gigabytes nor its batch-mates."""
    if isinstance(raw, bytes) and max_chars is not None and len(raw) > 4 * max_chars:
        raise ChunkError(
            f"job text of {len(raw)} bytes cannot fit in the model context ({max_tokens} tokens); refused unread"
        )
