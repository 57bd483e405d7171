"""``Worker``: consumes the precompute streams (``kvrag.precompute.redis_queue``) of every cache
fingerprint it can compute -- one stream per fingerprint, so one per KVRag it is given (the
base model's, a KVLink-adapted copy's) -- and computes their chunks into the shared store,
with at-least-once delivery (``XREADGROUP``, ``XACK`` once the entry is whole, ``XAUTOCLAIM``
of a dead worker's jobs). It beats on each stream it serves (``RedisQueue.beat``), so a
replica waiting on a stream no worker serves is told so (``QueueUnserved``), and it logs the
streams with jobs that no live worker serves."""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrag.defaults import DEFAULT_BATCH_TOKENS
from kvrag.errors import ChunkError, StoreError
from kvrag.precompute.packs import compute_pack
from kvrag.precompute.redis_queue import GROUP, HEARTBEAT_S, LIVE_S, RedisQueue, queue_stats
from kvrag.store.redis_connection import error_cause, redact

log = logging.getLogger(__name__)


@dataclass
class Lane:
    """One fingerprint a worker serves: the KVRag that computes its chunks and its stream."""

    rag: Any
    queue: RedisQueue


class Worker:
    """Consumes the precompute streams of ``rags``: one ``KVRag`` (built with the replicas'
    model and ``shared=`` URL, computing locally) or several, one per cache fingerprint to
    serve -- e.g. the base model's and its KVLink-adapted copy's (``kvrag worker`` builds every
    one its model can produce); KVRags of the same fingerprint are served once.

    name: the consumer name (default host:pid). batch: jobs read at a time (computed in one
    packed pass). claim_idle_s: a job pending that long on a worker is taken over (longer
    than a batch takes). block_s: how long one read waits for new jobs. retry_s: the first
    wait after Redis fails or answers an error, doubled on each failure in a row up to
    ``max_retry_s``. heartbeat_s: how often ``run`` beats on its streams (and checks for
    streams no worker serves, every ``unserved_check_s``)."""

    def __init__(
        self,
        rags,
        *,
        name: str | None = None,
        batch: int = 8,
        claim_idle_s: float = 60.0,
        block_s: float = 1.0,
        retry_s: float = 2.0,
        max_retry_s: float = 30.0,
        heartbeat_s: float = HEARTBEAT_S,
        unserved_check_s: float = 30.0,
    ) -> None:
        rags = [rags] if not isinstance(rags, Sequence) else list(rags)
        if not rags:
            raise ValueError("a worker needs at least one KVRag to compute with")
        self.lanes: list[Lane] = []
        for rag in rags:
            far = getattr(rag.store, "far", None)
            if far is None or not hasattr(far, "client"):
                raise ValueError("a worker needs a KVRag with a Redis shared store (shared='redis://...')")
            if rag.queue is not None:
                raise ValueError("a worker computes its jobs: build its KVRag with precompute_via='local'")
            if any(lane.rag.fingerprint == rag.fingerprint for lane in self.lanes):
                continue  # one lane per fingerprint: the same jobs
            self.lanes.append(Lane(rag, RedisQueue.for_store(far, rag.fingerprint)))
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.batch = batch
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.block_ms = int(block_s * 1000)
        self.retry_s = float(retry_s)
        self.max_retry_s = float(max_retry_s)
        self.heartbeat_s = float(heartbeat_s)
        self.unserved_check_s = float(unserved_check_s)
        self.done = 0
        self.errors = 0  # Redis failures and error replies waited out
        self.unserved: dict[str, int] = {}  # fingerprint -> backlog last seen on a stream no worker served
        self._causes: set[str] = set()

    @property
    def rag(self):
        """The first lane's KVRag (the one a single-fingerprint worker was given)."""
        return self.lanes[0].rag

    @property
    def queue(self) -> RedisQueue:
        """The first lane's stream."""
        return self.lanes[0].queue

    @property
    def client(self):
        return self.queue.client

    @property
    def streams(self) -> list[str]:
        return [lane.queue.stream for lane in self.lanes]

    def _take(self, lane: Lane, block_ms: int | None) -> list[tuple[bytes, dict]]:
        """Up to ``batch`` jobs of ``lane``: first those a dead worker left pending, then new
        ones (waiting up to ``block_ms`` for them; None: not waiting)."""
        q = lane.queue
        claimed = q.client.xautoclaim(
            q.stream, GROUP, self.name, min_idle_time=self.claim_idle_ms, start_id="0-0", count=self.batch
        )
        msgs = [m for m in claimed[1] if m and m[1]]
        if msgs:
            log.info("kvrag worker %s: took over %d job(s) of a worker that stopped", self.name, len(msgs))
            return msgs
        got = q.client.xreadgroup(GROUP, self.name, {q.stream: ">"}, count=self.batch, block=block_ms)
        return [m for _, entries in (got or []) for m in entries if m and m[1]]

    def step(self) -> int:
        """Take and process one batch of each stream that has jobs (waiting up to ``block_s``
        in all when none has); returns the jobs finished (acknowledged)."""
        for lane in self.lanes:
            lane.queue.ensure_group()
        finished, took = 0, False
        if len(self.lanes) > 1:
            for lane in self.lanes:
                msgs = self._take(lane, None)
                if msgs:
                    took = True
                    finished += self._process(lane, msgs)
            if took:
                return finished
        # Nothing anywhere: wait for new jobs, the wait shared among the streams (one blocking
        # read per stream: streams of different fingerprints are in different cluster slots).
        per = max(1, self.block_ms // len(self.lanes))
        for lane in self.lanes:
            msgs = self._take(lane, per)
            if msgs:
                return self._process(lane, msgs)
        return 0

    def _process(self, lane: Lane, msgs: list[tuple[bytes, dict]]) -> int:
        rag, queue = lane.rag, lane.queue
        ing = rag.ingestor
        jobs, bad = [], []
        for mid, fields in msgs:
            try:
                check_job_bytes(fields.get(b"text"), ing.max_chars, rag.handle.max_context)
                key, text = fields[b"key"].decode("ascii"), fields[b"text"].decode("utf-8")
                if ing.key(ing.chunk_ids(text)) != key:
                    raise ChunkError("the job's key is not its text's key (another model, or not kvrag's)")
            except (KeyError, UnicodeDecodeError, ChunkError, ValueError, TypeError) as e:
                bad.append((mid, fields.get(b"key", b"?").decode("ascii", "replace"), e))
                continue
            jobs.append((mid, key, text))
        far, near = rag.store.far, rag.store.near
        todo = []
        for mid, key, text in jobs:
            if far.ensure_indexed(key):
                continue  # stored in Redis meanwhile (another worker, a replica's write-through)
            # On this worker's disk but not in Redis (flushed, evicted, another prefix): copy
            # it up instead of computing it again (``rag.precompute`` would skip it as stored).
            entry = near.get(key, rag.fingerprint)
            if entry is not None:
                try:
                    far.put(key, entry)
                except StoreError as e:  # Redis refusing writes: left pending, retried
                    log.error("kvrag worker %s: job %s not copied up (left pending): %s", self.name, key, e)
            else:
                todo.append((mid, key, text))
        errors: dict[str, BaseException] = {}
        if todo:  # a failing batch is retried chunk by chunk to find the culprit(s)
            failed = compute_pack(rag, [t for _, _, t in todo], [k for _, k, _ in todo], DEFAULT_BATCH_TOKENS)
            errors = {todo[i][1]: e for i, e in failed.items()}
        finished = 0
        for mid, key, _text in jobs:
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
            self._ack(queue, mid, key, "done")
            finished += 1
        for mid, key, err in bad:
            log.error("kvrag worker %s: job %s dropped: %s", self.name, key, err)
            queue.client.hset(queue.failed_key, key, json.dumps({"error": f"{type(err).__name__}: {err}"}))
            self._ack(queue, mid, key, "failed")
        self.done += finished
        return finished

    def _ack(self, q: RedisQueue, mid, key: str, outcome: str) -> None:
        t = q.client.pipeline(transaction=True)
        t.xack(q.stream, GROUP, mid)
        t.xdel(q.stream, mid)
        t.delete(q.claim_prefix + key)
        t.hincrby(q.counts_key, outcome, 1)
        t.execute()

    # ---- heartbeats, and the streams nobody serves ----------------------------------------
    def beat(self) -> None:
        """Tell every stream this worker serves that it is alive (``RedisQueue.beat``)."""
        for lane in self.lanes:
            lane.queue.beat(self.name, {"pid": os.getpid(), "model": lane.rag.handle.source})

    def check_unserved(self, live_s: float = LIVE_S) -> dict[str, int]:
        """Log an error for each stream under this worker's prefix that has jobs and no live
        worker (those are waited for in vain: another model, dtype or KVLink adapter, and the
        command that serves it); returns {fingerprint: backlog} of those, also kept in
        ``self.unserved``. Logged again only when the backlog grows."""
        mine = {lane.rag.fingerprint for lane in self.lanes}
        found: dict[str, int] = {}
        for st in queue_stats(self.queue.store, live_s):
            fp = st["fingerprint"]
            if fp in mine or st["live_workers"] or st["queued"] == 0:
                continue
            found[fp] = st["queued"]
            if st["queued"] > self.unserved.get(fp, 0):
                age = st["oldest_age_s"]
                log.error(
                    "kvrag worker %s: stream %s has %d job(s)%s that no live worker serves (this worker "
                    "serves %s); they are computed by `%s`",
                    self.name,
                    st["stream"],
                    st["queued"],
                    "" if age is None else f", the oldest {age:.0f} s old",
                    ", ".join(self.streams),
                    st["worker_command"] or "a worker of the replicas' model, dtype and KVLink adapter",
                )
        self.unserved = found
        return found

    def _heartbeats(self, stop: threading.Event) -> None:
        """``run``'s thread: beat every ``heartbeat_s`` whatever the compute is doing (a long
        batch must not make a busy worker look gone), and look for unserved streams."""
        next_check = 0.0
        while True:
            try:
                self.beat()
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + self.unserved_check_s
                    self.check_unserved()
            except Exception as e:  # noqa: BLE001 -- Redis down: the main loop reports and waits it out
                log.debug("kvrag worker %s: heartbeat failed: %s", self.name, e)
            if stop.wait(self.heartbeat_s):
                return

    def run(self, stop: threading.Event | None = None, *, until_idle: bool = False) -> int:
        """Process jobs until ``stop`` is set (or, with ``until_idle``, until a read finds
        none and nothing is pending on any stream); Redis outages are waited out. Returns the
        jobs done. Beats on its streams meanwhile and leaves them when it returns."""
        import redis
        from redis.exceptions import ClusterError, RedisClusterException

        stop = stop or threading.Event()
        done_beating = threading.Event()
        beats = threading.Thread(target=self._heartbeats, args=(done_beating,), name="kvrag-heartbeat", daemon=True)
        beats.start()
        wait = self.retry_s
        try:
            while not stop.is_set():
                try:
                    n = self.step()
                    idle = n == 0 and until_idle and all(lane.queue.progress()["queued"] == 0 for lane in self.lanes)
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
        finally:
            done_beating.set()
            beats.join(10)
            for lane in self.lanes:
                try:
                    lane.queue.leave(self.name)
                except Exception as e:  # noqa: BLE001 -- Redis down: its heartbeat just goes stale
                    log.debug("kvrag worker %s: could not leave %s: %s", self.name, lane.queue.stream, e)
        return self.done

    def _failed(self, e: BaseException, wait: float) -> None:
        """Log a failure (a warning the first time for each cause), repair the queue's keys
        after a WRONGTYPE, and make the next step re-create the consumer group."""
        self.errors += 1
        for lane in self.lanes:
            lane.queue.group_ready = False
        cause = error_cause(e)
        level = logging.INFO if cause in self._causes else logging.WARNING
        self._causes.add(cause)
        log.log(level, "kvrag worker %s: Redis failed (%s: %s); retrying in %g s", self.name, cause, e, wait)
        if cause == "WRONGTYPE":
            try:
                for lane in self.lanes:
                    lane.queue.repair()
            except Exception as r:  # noqa: BLE001 - the next try repairs it
                log.info("kvrag worker %s: could not repair the queue's keys yet: %s", self.name, r)


def check_job_bytes(raw: object, max_chars: int | None, max_tokens: int) -> None:
    """ChunkError for a job whose text is so long in bytes that it cannot fit in the model's
    context (UTF-8: at least one byte a character), before it is decoded or tokenized: one
    crafted 50 MB stream entry must cost a worker neither gigabytes nor its batch-mates."""
    if isinstance(raw, bytes) and max_chars is not None and len(raw) > 4 * max_chars:
        raise ChunkError(
            f"job text of {len(raw)} bytes cannot fit in the model context ({max_tokens} tokens); refused unread"
        )


def worker_command(
    handle,
    far,
    *,
    storage_dtype: str,
    ingest_policies: Sequence[str] = (),
    chunk_anchor: Any = "auto",
) -> str:
    """The ``kvrag worker`` command that computes the chunks of a replica with this model
    (``handle``: a ``ModelHandle``, maybe KVLink-adapted), shared store ``far`` (a
    ``RedisStore``; its password is masked) and options: what the errors and warnings about
    a stream no worker serves tell the operator to run."""
    from kvrag.defaults import DEFAULT_COMPUTE_DTYPE, DEFAULT_SHARED_PREFIX, DEFAULT_STORAGE_DTYPE

    args = ["kvrag", "worker", "--redis", redact(str(getattr(far, "url", "URL")))]
    if getattr(far, "prefix", DEFAULT_SHARED_PREFIX) != DEFAULT_SHARED_PREFIX:
        args += ["--prefix", far.prefix]
    args += ["--model", handle.source or "<the replica's model>"]
    dtype = str(handle.dtype).removeprefix("torch.")
    if dtype != DEFAULT_COMPUTE_DTYPE:
        args += ["--dtype", dtype]
    adapter = handle.load_info.get("kvlink_adapter")
    if adapter:  # its fingerprint is served beside the base model's
        args += ["--kvlink-adapter", str(adapter)]
    if storage_dtype != DEFAULT_STORAGE_DTYPE:
        args += ["--storage-dtype", storage_dtype]
    if ingest_policies:
        args += ["--ingest-policies", ",".join(ingest_policies)]
    if not (isinstance(chunk_anchor, str) and chunk_anchor == "auto"):
        anchor = chunk_anchor if isinstance(chunk_anchor, str) else ",".join(str(int(t)) for t in chunk_anchor)
        args += ["--chunk-anchor", anchor]
    return " ".join(a if a.startswith("<") else shlex.quote(a) for a in args)
