"""``Worker``: consumes one cache fingerprint's precompute stream (``kvrag.precompute.redis_queue``)
and computes its chunks into the shared store, with at-least-once delivery (``XREADGROUP``,
``XACK`` once the entry is whole, ``XAUTOCLAIM`` of a dead worker's jobs)."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading

from kvrag.errors import ChunkError, StoreError
from kvrag.precompute.redis_queue import GROUP, RedisQueue
from kvrag.store.redis_store import error_cause

log = logging.getLogger(__name__)


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
                err = errors[key]
                if isinstance(err, ChunkError):  # the text itself: it will never succeed
                    bad.append((mid, key, err))
                else:
                    log.error("kvrag worker %s: job %s failed (left pending, retried): %s", self.name, key, err)
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
        for mid, key, err in bad:
            log.error("kvrag worker %s: job %s dropped: %s", self.name, key, err)
            self.client.hset(self.queue.failed_key, key, json.dumps({"error": f"{type(err).__name__}: {err}"}))
            self._ack(mid, key, "failed")
        self.done += finished
        return finished

    def _ack(self, mid, key: str, outcome: str) -> None:
        q = self.queue
        t = self.client.pipeline(transaction=True)
        t.xack(q.stream, GROUP, mid)
        t.xdel(q.stream, mid)
        t.delete(q.claim_prefix + key)
        t.hincrby(q.counts_key, outcome, 1)
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
        self.errors += 1
        self.queue.group_ready = False
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
