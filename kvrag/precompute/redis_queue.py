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

The queue runs its commands on the shared store's connection
(``kvrag.store.redis_connection.RedisConnection``), so an outage is seen, and said, once for both.

One stream per cache fingerprint (``<prefix>q:{<fingerprint>}``): a worker only takes jobs
for the model and anchor it runs. The stream, its counters, its failures and its claims
(``<prefix>q:{<fingerprint>}:claim:<key>``) share the hash tag ``{<fingerprint>}``, so the
transaction that acknowledges a job stays in one slot of a Redis Cluster.

No wait in vain: a worker beats on every stream it serves (``<stream>:workers``, Redis's
clock), so ``wait`` raises ``QueueUnserved`` -- naming the stream, its fingerprint and the
worker command that serves it -- once no live worker has served the stream for a bounded
time, a replica warns at start when none has lately (``announce``), and ``stats`` /
``queue_stats`` list every stream's workers, backlog and oldest job's age.
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
from kvrag.store.base import ChunkStore
from kvrag.store.redis_connection import RedisConnection, SharedStoreDown, SharedStoreRefused, error_cause
from kvrag.store.redis_store import RedisStore

log = logging.getLogger(__name__)

GROUP = "kvrag-workers"


def streams_key(prefix: str) -> str:
    """The set of the fingerprints that have a queue under ``prefix`` (for ``kvrag cache stats``)."""
    return f"{prefix}q:streams"


#: How often a worker writes its heartbeat on every stream it serves (seconds): from a thread
#: of its own, so a long batch does not make a busy worker look gone.
HEARTBEAT_S = 5.0
#: A worker counts as serving a stream while its last heartbeat there is at most this old.
LIVE_S = 30.0
#: How long ``RedisQueue.wait`` waits with no live worker on its stream before it raises
#: ``QueueUnserved``, and how long without one makes a replica warn at start.
NO_CONSUMER_S = 60.0
#: Heartbeats older than this are dropped from a stream's worker list (workers killed long ago).
FORGET_S = 86400.0


class QueueUnserved(KVRagError, RuntimeError):
    """No live ``kvrag worker`` serves a precompute stream: its jobs stay queued, uncomputed,
    until a worker for its cache fingerprint runs (the message names the command)."""


def server_now(client) -> float:
    """Redis's clock (seconds): heartbeats are written and judged by it, so the clocks of the
    workers' and replicas' machines never need to agree."""
    try:
        sec, usec = client.time()
        return float(sec) + float(usec) / 1e6
    except Exception:  # noqa: BLE001 -- a proxy or cluster that refuses TIME: the local clock
        return time.time()


class RedisQueue:
    """The precompute queue of one cache fingerprint on the shared store's Redis.

    connection: the shared store's ``RedisConnection`` (``RedisStore.connection``): every
    command runs on its client, and its outage names the server in errors. prefix: the
    store's key prefix, under which the queue's keys go. store: the shared store the workers
    write the chunks to (where ``wait`` looks for them). ``RedisQueue.for_store`` takes all
    three from a ``RedisStore``. claim_ttl_s: how long a queued chunk is not queued again by
    another replica (the claim is removed when it is done; the TTL only matters if the job
    itself is lost)."""

    def __init__(
        self, connection: RedisConnection, fingerprint: str, *, prefix: str, store: ChunkStore, claim_ttl_s: int = 3600
    ) -> None:
        if not isinstance(connection, RedisConnection):
            raise TypeError(f"a precompute queue needs a RedisConnection, got {type(connection).__name__}")
        if not isinstance(fingerprint, str) or not fingerprint or "{" in fingerprint or "}" in fingerprint:
            raise ValueError(f"fingerprint must be a non-empty string without braces, got {fingerprint!r}")
        self.connection = connection
        self.store = store
        self.fingerprint = fingerprint
        self.claim_ttl_s = int(claim_ttl_s)
        p = prefix
        # One hash tag for every key of this queue: _ack's transaction touches four of them.
        self.stream = f"{p}q:{{{fingerprint}}}"
        self.claim_prefix = f"{self.stream}:claim:"
        self.counts_key = f"{self.stream}:counts"
        self.failed_key = f"{self.stream}:failed"
        self.streams_index = streams_key(p)
        self.group_ready = False

    @classmethod
    def for_store(cls, store: ChunkStore, fingerprint: str, **options: Any) -> RedisQueue:
        """The queue of ``fingerprint`` on the shared ``store`` (a ``RedisStore``: its
        connection and prefix); ``options``: the constructor's (``claim_ttl_s``)."""
        if not isinstance(store, RedisStore):
            raise TypeError(f"precompute_via='queue' needs a Redis shared store, got {type(store).__name__}")
        return cls(store.connection, fingerprint, prefix=store.prefix, store=store, **options)

    @property
    def client(self):
        return self.connection.client  # a cluster's client is made at first use (RedisConnection.client)

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
        expected = {
            self.stream: "stream",
            self.counts_key: "hash",
            self.failed_key: "hash",
            self.streams_index: "set",
            self.workers_key: "hash",
            self.about_key: "string",
        }
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
        Raises ``kvrag.store.redis_connection.SharedStoreDown`` if Redis cannot be reached:
        nothing is lost silently (the ``Precomputer`` keeps the texts as retryable failures)."""
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
                raise SharedStoreDown(f"cannot queue chunks on {self.connection.outage.what}: {e}") from e
            if isinstance(e, redis.RedisError):  # an error reply (OOM, READONLY, WRONGTYPE, ...)
                if error_cause(e) == "WRONGTYPE":
                    try:
                        self.repair()
                    except redis.RedisError:
                        pass
                raise SharedStoreRefused(
                    f"cannot queue chunks on {self.connection.outage.what}: {error_cause(e)}: {e}"
                ) from e
            raise
        return keys

    def progress(self) -> dict[str, Any]:
        """queued (jobs not done: in the stream, read or not), pending (read by a worker, not
        acknowledged yet), done, failed, consumers (names the consumer group ever had: live
        and gone; ``stats()`` tells them apart), unserved (waits that raised ``QueueUnserved``)."""
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
            "unserved": c.get("unserved", 0),  # waits that gave up: no worker served the stream
        }

    def failures(self) -> dict[str, str]:
        """key -> error of the jobs that failed for good (a text the model cannot take)."""
        return {k.decode(): json.loads(v)["error"] for k, v in self.client.hgetall(self.failed_key).items()}

    # ---- who serves this stream ---------------------------------------------------------
    #: The command that runs a worker for this stream, said by the errors and warnings about a
    #: stream no worker serves; a replica sets it from its own configuration
    #: (``kvrag.precompute.worker.worker_command``) and records it for ``kvrag cache stats``.
    worker_command = "kvrag worker --redis URL --model <the replica's model>"

    @property
    def workers_key(self) -> str:
        """Hash: worker name -> its last heartbeat on this stream (JSON: ``t``, Redis's clock)."""
        return f"{self.stream}:workers"

    @property
    def about_key(self) -> str:
        """String: the worker command a replica of this fingerprint recorded (``describe``)."""
        return f"{self.stream}:about"

    def beat(self, name: str, info: dict[str, Any] | None = None) -> None:
        """A worker's heartbeat: ``name`` serves this stream now (``info``: what it runs)."""
        self.client.hset(self.workers_key, name, json.dumps({"t": server_now(self.client), **(info or {})}))
        self.client.sadd(self.streams_index, self.fingerprint)

    def leave(self, name: str) -> None:
        """A worker that stops cleanly: it no longer serves this stream."""
        self.client.hdel(self.workers_key, name)

    def workers(self) -> dict[str, float]:
        """Every worker that beat on this stream -> seconds since its last heartbeat (those
        gone longer than ``FORGET_S`` are dropped)."""
        now = server_now(self.client)
        ages = {}
        for name, raw in self.client.hgetall(self.workers_key).items():
            n = name.decode("utf-8", "replace")
            try:
                ages[n] = max(0.0, now - float(json.loads(raw)["t"]))
            except (ValueError, KeyError, TypeError):  # not a heartbeat kvrag wrote
                ages[n] = float("inf")
        gone = [n for n, age in ages.items() if age > FORGET_S]
        if gone:
            self.client.hdel(self.workers_key, *gone)
        return {n: a for n, a in ages.items() if n not in gone}

    def live_workers(self, live_s: float = LIVE_S) -> list[str]:
        """The workers whose last heartbeat on this stream is at most ``live_s`` old."""
        return sorted(n for n, age in self.workers().items() if age <= live_s)

    def describe(self, command: str) -> None:
        """Record ``command`` (how to run a worker for this stream) as ``worker_command`` and in
        Redis, where ``kvrag cache stats --shared`` and the workers' warnings read it."""
        self.worker_command = command
        self.client.set(self.about_key, command.encode("utf-8"))
        self.client.sadd(self.streams_index, self.fingerprint)

    def recorded_command(self) -> str | None:
        raw = self.client.get(self.about_key)
        return None if raw is None else raw.decode("utf-8", "replace")

    def oldest_age_s(self) -> float | None:
        """Seconds since the oldest job not done was queued (None: none): done jobs are deleted
        from the stream, so its first entry is the oldest left, its id the time it was queued."""
        first = self.client.xrange(self.stream, count=1)
        if not first:
            return None
        mid = first[0][0]
        ms = int((mid.decode() if isinstance(mid, bytes) else str(mid)).split("-", 1)[0])
        return max(0.0, server_now(self.client) - ms / 1000.0)

    def stats(self, live_s: float = LIVE_S) -> dict[str, Any]:
        """``progress()`` with the fingerprint, the workers (live and gone, seconds since their
        last heartbeat), the oldest job's age and the recorded worker command."""
        ages = self.workers()
        out = self.progress()
        out.update(
            fingerprint=self.fingerprint,
            live_workers=sorted(n for n, a in ages.items() if a <= live_s),
            workers={n: round(a, 1) for n, a in sorted(ages.items())},
            oldest_age_s=self.oldest_age_s(),
            worker_command=self.recorded_command(),
        )
        return out

    def unserved_message(self, waited_s: float | None = None) -> str:
        """Why this stream's jobs are not computed, and the command that computes them."""
        ages = self.workers()
        last = min(ages.values(), default=None)
        seen = "no worker has ever served it" if last is None else f"its last worker was seen {last:.0f} s ago"
        backlog = self.client.xlen(self.stream)
        waited = "" if waited_s is None else f" for {waited_s:.0f} s"
        return (
            f"no kvrag worker serves the precompute stream {self.stream!r}{waited} (cache fingerprint "
            f"{self.fingerprint}; {backlog} job(s) queued; {seen}): its chunks are computed only by a "
            f"worker of the same model, dtype and KVLink adapter -- run `{self.worker_command}` "
            "(docs/deploy.md, 'Workers for several policies')"
        )

    def announce(self, command: str | None = None, no_consumer_s: float = NO_CONSUMER_S) -> bool:
        """A replica's start: record ``command`` (``describe``) and log a warning when no worker
        has served this stream for ``no_consumer_s``; True if it warned. Redis failing here is
        not the replica's problem yet: it is logged at debug level and the replica starts."""
        if command is not None:
            self.worker_command = command
        if self.connection.outage.skip():
            return False
        try:
            if command is not None:
                self.describe(command)
            ages = self.workers()
            if ages and min(ages.values()) <= no_consumer_s:
                return False
            log.warning("kvrag queue: %s", self.unserved_message())
            return True
        except Exception as e:  # noqa: BLE001 -- any failure (a cluster's too: not RedisErrors): a start, not a check
            log.debug("kvrag queue: could not check the workers of %s: %s", self.stream, e)
            return False

    def wait(
        self,
        keys: Iterable[str] | None = None,
        timeout: float | None = None,
        poll_s: float = 0.1,
        *,
        no_consumer_s: float | None = NO_CONSUMER_S,
        live_s: float = LIVE_S,
    ) -> bool:
        """Block until ``keys`` are in the shared store (None: until the stream is empty);
        False if ``timeout`` passed first. Keys that failed for good count as finished.

        Raises ``QueueUnserved`` (naming the stream, its fingerprint and the worker command)
        once no live worker (a heartbeat at most ``live_s`` old) has served the stream for
        ``no_consumer_s`` seconds of this wait: jobs of a fingerprint no worker computes would
        otherwise be waited for forever. The jobs stay queued for a worker started later; the
        give-up is counted (``progress()["unserved"]``). ``no_consumer_s=None``: wait regardless."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        left = list(dict.fromkeys(keys)) if keys is not None else None
        quiet_since, next_check, warned = start, start, False
        while True:
            if left is None:
                if self.client.xlen(self.stream) == 0:
                    return True
            else:
                failed = set(self.failures()) if left else set()
                left = [k for k in left if k not in failed and not self.store.ensure_indexed(k)]
                if not left:
                    return True
            now = time.monotonic()
            if no_consumer_s is not None and now >= next_check:
                next_check = now + min(1.0, max(poll_s, no_consumer_s / 10))
                if self.live_workers(live_s):
                    quiet_since = now
                elif now - quiet_since >= no_consumer_s:
                    self.client.hincrby(self.counts_key, "unserved", 1)
                    msg = self.unserved_message(now - start)
                    log.error("kvrag queue: %s", msg)
                    raise QueueUnserved(msg)
                elif not warned:
                    warned = True
                    log.warning(
                        "kvrag queue: waiting for chunks on %r, which no live worker serves; giving up in %.0f s "
                        "unless one starts (run `%s`)",
                        self.stream,
                        no_consumer_s,
                        self.worker_command,
                    )
            if deadline is not None and now >= deadline:
                return False
            time.sleep(poll_s)


def queue_stats(store, live_s: float = LIVE_S) -> list[dict[str, Any]]:
    """``RedisQueue.stats()`` of every precompute stream under ``store``'s prefix (a
    ``RedisStore``), by fingerprint."""
    fps = sorted(f.decode() for f in store.client.smembers(streams_key(store.prefix)))
    return [RedisQueue.for_store(store, fp).stats(live_s) for fp in fps]
