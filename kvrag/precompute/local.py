"""``Precomputer``: background precompute of chunk KV caches (framework-free).

Ingestion hooks (a LlamaIndex transform, a LangChain vector-store hook, a retriever hook) hand
chunk texts to :meth:`Precomputer.submit`, which validates them, queues them and returns at
once; worker thread(s) tokenize, skip what is already stored, pack the rest ``batch_tokens``
at a time and call :meth:`kvrag.engine.KVRag.precompute` (``kvrag.precompute.ingest``: it stores the
K/V and registers the text with the segmenter, so the very next query finds it).

Guarantees:

* **dedup**: a text already queued or in flight is not queued twice (the caller gets the same
  future); in the worker, two texts with the same store key are computed once, and a key
  already in the store is not recomputed (but re-listed in the store's text index if a writer
  killed mid-put left it out, so other processes find it: ``DiskStore.ensure_indexed``).
* **back-pressure**: at most ``max_queued`` texts wait; ``submit`` then blocks (or raises
  :class:`QueueFullError` with ``block=False`` / after ``timeout``).
* **no silent loss**: every failure is logged, counted (``progress().failed``) and kept
  (:meth:`failures`, :meth:`retry_failed`); :meth:`shutdown` drains the queue by default, and
  whatever it does not process (``cancel_pending=True`` or a timeout) it hands back to the
  caller; work it leaves running (``wait=False``, a pack in flight at the timeout) is
  finished before the interpreter exits; at interpreter exit the queue is drained
  (``drain_on_exit``; with False what is queued is dropped with a warning, but packs in
  flight are still finished).
* **queries first**: wrap a query in :meth:`foreground` (the LlamaIndex / LangChain adapters
  do) and no new pack starts while it runs, so the query competes at most with one pack
  already in flight; ``batch_tokens`` bounds that pack. On a 2-core CPU, SmolLM2-135M
  prefills ~150-300 tokens/s, so the default 512-token pack is ~2-3 s of work.

Threads and torch: PyTorch's intra-op thread count is process-global by default. With
``num_threads=None`` (default) the worker uses torch's setting and nothing is changed. With
``num_threads=n`` the worker thread sets *its own* OpenMP thread count to ``n`` and the global
default is restored at once, so the caller's threads keep theirs (see ``worker_threads``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from typing import Any, Literal, overload

from kvrag.checks import check_int, check_texts_iterable, validate_chunk_text
from kvrag.errors import ChunkError, KVRagError
from kvrag.precompute.packs import compute_pack
from kvrag.precompute.progress import PrecomputeFailure, PrecomputeProgress, PrecomputerClosedError, QueueFullError
from kvrag.precompute.worker_threads import register_exit, set_worker_threads, unregister_exit

__all__ = ["Precomputer", "pending_in_prompt"]

log = logging.getLogger("kvrag.precompute")


class _Job:
    __slots__ = ("text", "future", "ids", "key", "waiters", "finished")

    def __init__(self, text: str):
        self.text = text
        # Never marked running, so a caller may cancel() it at any time: that only stops the
        # caller waiting, the chunk is still computed (bookkeeping uses ``finished``).
        self.future: Future = Future()
        self.finished = False
        self.ids: list[int] = []  # set by Precomputer._prepare, with the key
        self.key: str | None = None
        self.waiters: list[_Job] = []  # other texts with the same key, finished with this one


def pending_in_prompt(rag, prompt: str) -> int:
    """How many texts the precomputers of ``rag`` have queued or in flight that ``prompt``
    contains (verbatim, edge whitespace aside): chunks a query misses only because their K/V
    is not ready yet. Read when a query found no cached chunk, to say so instead of blaming
    segmentation."""
    with Precomputer._of_rag_lock:
        pcs = list(Precomputer._of_rag.get(rag, ()))
    texts = {t.strip() for pc in pcs for t in pc.pending_texts()}
    return sum(1 for t in texts if t and t in prompt)


def _preview(text: str, n: int = 60) -> str:
    return repr(text[:n] + ("..." if len(text) > n else ""))


class Precomputer:
    """A queue + worker thread(s) that precompute and store the KV of submitted chunk texts.

    rag: the :class:`kvrag.engine.KVRag` whose model and store are used. workers: worker
    threads (1 is right on a small CPU: model forwards already use every core). max_queued:
    texts allowed to wait (back-pressure beyond). batch_tokens: tokens per pack (one forward
    pass). num_threads: intra-op threads for the worker thread only (None: leave torch alone).
    defer_to_queries: no new pack starts while a :meth:`foreground` block is open, for at most
    ``max_defer_s`` at a time (so a stream of queries cannot starve ingestion forever).
    keep_failures: failures kept for :meth:`failures` (all are counted). drain_on_exit: at
    interpreter exit, finish the queue (else drop what is queued and log it; packs in flight
    are finished either way), also after ``shutdown(wait=False)``. on_progress: called with a
    :class:`PrecomputeProgress` after every pack, in the worker thread."""

    def __init__(
        self,
        rag,
        *,
        workers: int = 1,
        max_queued: int = 10_000,
        batch_tokens: int = 512,
        num_threads: int | None = None,
        defer_to_queries: bool = True,
        max_defer_s: float = 30.0,
        keep_failures: int = 1000,
        drain_on_exit: bool = True,
        on_progress: Callable[[PrecomputeProgress], None] | None = None,
        start: bool = True,
        name: str = "kvrag-precompute",
    ) -> None:
        for pname, v, lo in (
            ("workers", workers, 1),
            ("max_queued", max_queued, 1),
            ("batch_tokens", batch_tokens, 1),
            ("keep_failures", keep_failures, 0),
        ):
            check_int(pname, v, lo)
        if num_threads is not None:
            check_int("num_threads (None: torch's setting)", num_threads, 1)
        if not max_defer_s >= 0:
            raise ValueError(f"max_defer_s must be >= 0, got {max_defer_s!r}")
        for attr in ("precompute", "ingestor", "store"):
            if not hasattr(rag, attr):
                raise TypeError(f"Precomputer needs a KVRag, got {type(rag).__name__} (no .{attr})")
        self.rag = rag
        self.workers = workers
        self.max_queued = max_queued
        self.batch_tokens = batch_tokens
        self.num_threads = num_threads
        self.defer_to_queries = defer_to_queries
        self.max_defer_s = float(max_defer_s)
        self.drain_on_exit = drain_on_exit
        self.on_progress = on_progress
        self.name = name

        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Job] = deque()
        self._by_text: dict[str, _Job] = {}  # queued + in-flight jobs
        self._inflight_keys: dict[str, _Job] = {}
        self._in_flight = 0
        self._foreground = 0
        self._hold_until = 0.0  # monotonic time before which no new pack starts (see submit's defer_s)
        self._closing = False
        self._abandon = False
        self._threads: list[threading.Thread] = []
        self._failures: deque[PrecomputeFailure] = deque(maxlen=keep_failures)
        self._c = dict(
            submitted=0,
            deduplicated=0,
            computed=0,
            already_cached=0,
            failed=0,
            rejected=0,
            dropped=0,
            tokens_computed=0,
        )
        self._busy_s = 0.0
        self._atexit_ref: Callable[[], None] | None = None
        with Precomputer._of_rag_lock:
            Precomputer._of_rag.setdefault(rag, weakref.WeakSet()).add(self)
        if start:
            self.start()

    # ---- shared instances ---------------------------------------------------------------
    _shared: weakref.WeakKeyDictionary[Any, Precomputer] = weakref.WeakKeyDictionary()
    _shared_lock = threading.Lock()
    #: Every live precomputer of a KVRag (shared or not): what ``pending_in_prompt`` asks.
    _of_rag: weakref.WeakKeyDictionary[Any, weakref.WeakSet] = weakref.WeakKeyDictionary()
    _of_rag_lock = threading.Lock()  # not _shared_lock: for_rag holds that while it constructs one

    @overload
    @classmethod
    def for_rag(cls, rag, *, create: Literal[True] = True, **kwargs) -> Precomputer: ...

    @overload
    @classmethod
    def for_rag(cls, rag, *, create: bool, **kwargs) -> Precomputer | None: ...

    @classmethod
    def for_rag(cls, rag, *, create: bool = True, **kwargs) -> Precomputer | None:
        """The process-wide default precomputer of ``rag`` (created on first use with
        ``kwargs``), so an LLM adapter and the ingestion hooks share one queue and one worker
        instead of competing for the CPU. A shut-down one is replaced. ``create=False``:
        None if there is none (an LLM adapter asks this to gate its queries)."""
        with cls._shared_lock:
            pc = cls._shared.get(rag)
            if pc is None or pc.closed:
                if not create:
                    return None
                pc = cls(rag, **kwargs)
                cls._shared[rag] = pc
            return pc

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker threads (done by the constructor unless ``start=False``)."""
        with self._cond:
            if self._closing:
                raise PrecomputerClosedError("this precomputer was shut down; create a new one")
            if self._threads:
                return
            ready = threading.Semaphore(0) if self.num_threads else None
            prev_threads = None
            if self.num_threads:
                import torch

                prev_threads = torch.get_num_threads()
            for i in range(self.workers):
                t = threading.Thread(target=self._run, args=(ready,), name=f"{self.name}-{i}", daemon=True)
                self._threads.append(t)
                t.start()
        if ready is not None:
            for _ in range(self.workers):  # every worker has set its own thread count ...
                ready.acquire(timeout=60)
            import torch

            assert prev_threads is not None  # read above whenever ``ready`` is made
            torch.set_num_threads(prev_threads)  # ... now restore the default for everyone else
        # Daemon threads die with the interpreter; drain (or report) the queue before that.
        self._atexit_ref = register_exit(self._exit)

    @property
    def closed(self) -> bool:
        return self._closing

    def shutdown(self, *, wait: bool = True, timeout: float | None = None, cancel_pending: bool = False) -> list[str]:
        """Stop taking work and stop the workers. Returns the texts it did *not* process.

        Default: finish everything queued, then stop (nothing acknowledged is lost).
        ``cancel_pending``: do not start queued texts; they are returned (their futures
        cancelled). ``timeout``: wait at most this long; texts still queued then are taken off
        the queue and returned, while a pack already in flight is finished in the background
        (its futures get their keys; it is neither returned nor lost). ``wait=False``: return
        at once (returns [], or the cancelled texts with ``cancel_pending``); the workers drain
        the queue in the background.

        Work left running in the background (``wait=False``, or a pack in flight when
        ``timeout`` expired) is finished before the interpreter exits: the exit hook waits
        for the workers (with ``drain_on_exit=False`` it waits only for the packs in flight,
        and texts still queued then are logged as dropped)."""
        handed_back: list[_Job] = []
        with self._cond:
            self._closing = True
            # A retriever hook's hold waits for a query that may never come: closing lifts it.
            self._hold_until = 0.0
            if cancel_pending:
                handed_back = self._take_all_queued()
            self._cond.notify_all()
        if wait:
            deadline = None if timeout is None else time.monotonic() + timeout
            for t in self._threads:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            with self._cond:
                if any(t.is_alive() for t in self._threads):
                    self._abandon = True
                    handed_back += self._take_all_queued()
                    self._cond.notify_all()
        if not any(t.is_alive() for t in self._threads):
            # Nothing left running. Otherwise the exit hook stays registered: the workers are
            # daemon threads, killed at interpreter exit, so it must wait for them first.
            unregister_exit(self._atexit_ref)
            self._atexit_ref = None
        for job in handed_back:
            job.future.cancel()
        if handed_back:
            log.warning(
                "kvrag precompute: shutdown left %d chunk(s) unprocessed; they were returned to the caller",
                len(handed_back),
            )
        return [j.text for j in handed_back]

    def _exit(self) -> None:
        """Run by the exit hook: finish (or, with ``drain_on_exit=False``, drop with a warning)
        what is queued, and wait for every pack in flight, so nothing dies with the daemon
        workers (a worker killed inside ``DiskStore.put`` would also leave a half-written entry)."""
        self._atexit_ref = None  # this hook is running: nothing to unregister any more
        if not self.drain_on_exit:
            left = self.shutdown(cancel_pending=True, wait=False)
            if left:
                log.warning(
                    "kvrag precompute: %d queued chunk(s) were not precomputed at exit "
                    "(drain_on_exit=False); they are computed when retrieved again (retriever hook) "
                    "or re-submitted",
                    len(left),
                )
        n = self.progress()
        pending = n.queued + n.in_flight
        if pending and any(t.is_alive() for t in self._threads):
            log.warning("kvrag precompute: finishing %d chunk(s) before exit", pending)
        self.shutdown(wait=True)

    def close(self) -> None:
        self.shutdown()

    def __enter__(self) -> Precomputer:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- submission -------------------------------------------------------------------
    def submit(self, text: str, *, block: bool = True, timeout: float | None = None, defer_s: float = 0.0) -> Future:
        """Queue ``text`` for precompute; returns at once with a future of its store key.

        Raises ChunkError for a text that can never be cached (not a str, empty, invalid
        Unicode); a text too long for the model is found by the worker (the future gets the
        ChunkError, and it is logged and counted). When ``max_queued`` texts wait, blocks until
        there is room (``block=False``: raise QueueFullError at once; ``timeout``: after that
        many seconds).

        ``defer_s``: start no new pack for up to this many seconds, or until the next
        :meth:`foreground` block ends — for hooks that run just *before* a query's LLM call
        (a retriever hook), so the work they schedule waits for that query to finish."""
        try:
            validate_chunk_text(text)
        except ChunkError as e:
            with self._cond:
                self._c["rejected"] += 1
            if not isinstance(text, (str, bytes, bytearray, memoryview)) and isinstance(text, Iterable):
                raise ChunkError(f"{e}: submit() takes one text; use submit_many() for several") from None
            raise
        with self._cond:
            if self._closing:
                raise PrecomputerClosedError("the precomputer is shut down and takes no new work")
            if defer_s > 0:
                self._hold_until = max(self._hold_until, time.monotonic() + defer_s)
            job = self._by_text.get(text)
            if job is not None:
                self._c["deduplicated"] += 1
                return job.future
            if len(self._queue) >= self.max_queued:
                if not block:
                    self._c["dropped"] += 1
                    raise QueueFullError(f"precompute queue is full ({self.max_queued} texts waiting)")
                ok = self._cond.wait_for(lambda: len(self._queue) < self.max_queued or self._closing, timeout)
                if self._closing:
                    raise PrecomputerClosedError("the precomputer was shut down while waiting for room")
                if not ok:
                    self._c["dropped"] += 1
                    raise QueueFullError(
                        f"precompute queue still full ({self.max_queued} texts waiting) after {timeout}s"
                    )
                job = self._by_text.get(text)  # submitted by someone else while we waited
                if job is not None:
                    self._c["deduplicated"] += 1
                    return job.future
            job = _Job(text)
            self._queue.append(job)
            self._by_text[text] = job
            self._c["submitted"] += 1
            self._cond.notify_all()
        if not self._threads:
            log.debug("kvrag precompute: queued with no worker running (start=False)")
        return job.future

    def submit_many(
        self,
        texts: Iterable[str],
        *,
        block: bool = True,
        timeout: float | None = None,
        skip_invalid: bool = False,
        skip_full: bool = False,
        defer_s: float = 0.0,
    ) -> list[Future | None]:
        """``submit`` each text. ``skip_invalid``: a text that can never be cached (empty,
        invalid Unicode) is logged, counted as rejected and gets None instead of raising —
        what ingestion hooks want, so one empty node does not fail a whole pipeline run.
        ``skip_full``: a text refused because the queue is full (``block=False``, or the
        ``timeout`` passed) is counted as dropped and gets None, and the rest are still tried,
        instead of a ``QueueFullError`` — ingestion hooks run after the vector store stored
        the documents, so raising would only lose the rest of the batch.

        ``texts`` must be an iterable of texts: a single ``str`` (or ``bytes``) raises
        TypeError before anything is queued, rather than queueing each character."""
        check_texts_iterable(texts, "submit_many", " or use submit(text)")
        out: list[Future | None] = []
        for t in texts:
            try:
                out.append(self.submit(t, block=block, timeout=timeout, defer_s=defer_s))
            except ChunkError as e:
                if not skip_invalid:
                    raise
                log.warning("kvrag precompute: skipped a chunk that cannot be cached: %s", e)
                out.append(None)
            except QueueFullError as e:
                if not skip_full:
                    raise
                log.debug("kvrag precompute: dropped (counted): %s", e)
                out.append(None)
        return out

    async def asubmit_many(self, texts: Iterable[str], **kwargs) -> list[Future | None]:
        """``submit_many`` for async code (ingestion hooks' ``aadd_*`` / ``acall``): with
        ``block=True`` (the default) a full queue makes the submission wait for room, which may
        take as long as the worker needs to compute packs; that wait runs in a worker thread,
        so the event loop (and every other request on it) keeps running."""
        if kwargs.get("block", True):
            return await asyncio.to_thread(self.submit_many, texts, **kwargs)
        return self.submit_many(texts, **kwargs)  # never waits

    # ---- state ------------------------------------------------------------------------
    def progress(self) -> PrecomputeProgress:
        with self._cond:
            return PrecomputeProgress(
                queued=len(self._queue), in_flight=self._in_flight, busy_s=self._busy_s, **self._c
            )

    def pending_texts(self) -> list[str]:
        """The texts queued or in flight now (a snapshot)."""
        with self._cond:
            return list(self._by_text)

    def failures(self) -> list[PrecomputeFailure]:
        """The most recent failures (up to ``keep_failures``), oldest first."""
        with self._cond:
            return list(self._failures)

    def retry_failed(self) -> list[Future]:
        """Resubmit the kept failures that may succeed now (not ChunkErrors) and forget them."""
        with self._cond:
            retry = [f for f in self._failures if f.retryable]
            keep = [f for f in self._failures if not f.retryable]
            self._failures.clear()
            self._failures.extend(keep)
        return [self.submit(f.text) for f in retry]

    def wait_until_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or in flight; False if ``timeout`` passed first.

        Raises RuntimeError if work is waiting and no worker is alive to do it (never hangs)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            # Whoever waits for idle wants the work done now, not after a retriever hook's hold
            # for a query that may never come (retrieval-only use); a query in the foreground
            # still goes first.
            self._hold_until = 0.0
            self._cond.notify_all()
            while self._queue or self._in_flight:
                if not any(t.is_alive() for t in self._threads):
                    raise RuntimeError(
                        f"{len(self._queue)} chunk(s) queued but no precompute worker is running "
                        "(created with start=False, or shut down)"
                    )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                # Wake up now and then to notice dead workers.
                self._cond.wait(0.5 if remaining is None else min(0.5, remaining))
            return True

    def foreground(self) -> _Foreground:
        """Context manager marking a query in progress: no new pack starts meanwhile."""
        return _Foreground(self)

    def __repr__(self) -> str:
        p = self.progress()
        return (
            f"Precomputer(workers={self.workers}, queued={p.queued}, in_flight={p.in_flight}, "
            f"computed={p.computed}, failed={p.failed}{', closed' if self._closing else ''})"
        )

    # ---- worker -----------------------------------------------------------------------
    def _take_all_queued(self) -> list[_Job]:
        jobs = list(self._queue)
        self._queue.clear()
        for j in jobs:
            self._by_text.pop(j.text, None)
        self._cond.notify_all()
        return jobs

    def _take(self, wait: bool) -> _Job | None:
        """Pop the next job (marking it in flight), waiting for one if ``wait``; None when
        there is nothing (or the worker must stop)."""
        with self._cond:
            if wait:
                while not self._queue and not self._closing:
                    self._cond.wait()
                self._defer_locked()
            if self._abandon or not self._queue:
                return None
            job = self._queue.popleft()
            self._in_flight += 1
            self._cond.notify_all()  # room in the queue for a blocked submit
            return job

    def _defer_locked(self) -> None:
        """Wait (lock held) while a query is in the foreground or a hold is set, at most
        ``max_defer_s`` in all."""
        if not self.defer_to_queries:
            return
        deadline = time.monotonic() + self.max_defer_s
        while not self._abandon:
            now = time.monotonic()
            if self._foreground == 0 and (now >= self._hold_until or self._closing):
                return
            remaining = deadline - now
            if remaining <= 0:
                log.debug(
                    "kvrag precompute: queries kept the worker waiting %.0fs; running a pack anyway", self.max_defer_s
                )
                return
            if self._foreground == 0:
                remaining = min(remaining, self._hold_until - now)
            self._cond.wait(remaining)

    def _run(self, ready: threading.Semaphore | None) -> None:
        if ready is not None:
            try:
                assert self.num_threads is not None  # ``ready`` is only made with a thread count
                set_worker_threads(self.num_threads)
            except Exception:
                log.exception("kvrag precompute: could not set the worker's torch thread count")
            finally:
                ready.release()
        carry: _Job | None = None
        while True:
            held: list[_Job] = []  # every job this pass took: finished even if a bug strikes
            try:
                pack: list[_Job] = []
                tokens = 0
                # The carried job was prepared (tokenized, key claimed) in the last pass.
                prepared = carry is not None
                job = carry if carry is not None else self._take(wait=True)
                carry = None
                if job is None:
                    with self._cond:
                        if self._abandon or (self._closing and not self._queue):
                            return
                    continue
                while job is not None:
                    held.append(job)
                    if prepared or self._prepare(job):
                        n = len(job.ids)
                        if pack and tokens + n > self.batch_tokens:
                            carry = job  # starts the next pack; stays counted in flight
                            break
                        pack.append(job)
                        tokens += n
                        if tokens >= self.batch_tokens:
                            break
                    prepared = False
                    job = self._take(wait=False)
                if pack:
                    self._compute(pack)
                if self.on_progress is not None:
                    try:
                        self.on_progress(self.progress())
                    except Exception:
                        log.exception("kvrag precompute: on_progress callback raised")
            except BaseException as e:  # a bug in here must not kill the worker silently
                log.exception("kvrag precompute: worker error")
                for j in held:
                    if not j.finished:
                        self._finish(j, error=e)
                carry = None
                if not isinstance(e, Exception):
                    raise

    def _prepare(self, job: _Job) -> bool:
        """Tokenize and key ``job``; finish it now if it is cached, invalid or a duplicate
        key of a job in flight. True if it must be computed."""
        ingestor = self.rag.ingestor
        try:
            job.ids = ingestor.chunk_ids(job.text)
            job.key = ingestor.key(job.ids)
        except Exception as e:  # noqa: BLE001 - the job's own error, handed to its future
            self._finish(job, error=e)
            return False
        with self._cond:
            owner = self._inflight_keys.get(job.key)
            if owner is not None:
                # Another text with the same token ids (or another worker) is computing it.
                owner.waiters.append(job)
                self._c["deduplicated"] += 1
                return False
            self._inflight_keys[job.key] = job
        try:
            cached = job.key in ingestor.store and ingestor.ensure_listed(job.key, job.text)
        except Exception as e:  # noqa: BLE001 - the job's own error, handed to its future
            self._finish(job, error=e)
            return False
        if cached:
            self._finish(job, cached=True)
            return False
        return True

    def _compute(self, pack: list[_Job]) -> None:
        t0 = time.perf_counter()
        errors = compute_pack(self.rag, [j.text for j in pack], [j.key for j in pack], self.batch_tokens)
        busy = time.perf_counter() - t0
        with self._cond:
            self._busy_s += busy
        for i, j in enumerate(pack):
            if i in errors:
                self._finish(j, error=errors[i])
            else:
                with self._cond:
                    self._c["tokens_computed"] += len(j.ids)
                self._finish(j, computed=True)
        log.debug(
            "kvrag precompute: pack of %d chunk(s), %d tokens in %.2fs", len(pack), sum(len(j.ids) for j in pack), busy
        )

    def _finish(
        self, job: _Job, *, computed: bool = False, cached: bool = False, error: BaseException | None = None
    ) -> None:
        """Resolve ``job`` (and jobs waiting on its key) and update the counters."""
        if error is not None and not job.finished:
            # Logged before it is counted, so whoever sees the counter can already see the log.
            unexpected = not isinstance(error, KVRagError)
            log.error(
                "kvrag precompute: failed for chunk %s (%d chars): %s: %s",
                _preview(job.text),
                len(job.text),
                type(error).__name__,
                error,
                exc_info=error if unexpected else None,
            )
        with self._cond:
            if job.key is not None and self._inflight_keys.get(job.key) is job:
                del self._inflight_keys[job.key]
            jobs = [j for j in (job, *job.waiters) if not j.finished]
            for j in jobs:
                j.finished = True
                if self._by_text.get(j.text) is j:
                    del self._by_text[j.text]
                self._in_flight -= 1
                if error is not None:
                    self._c["failed"] += 1
                    self._failures.append(PrecomputeFailure(j.text, j.key, error, time.time()))
                elif j is job and computed:
                    self._c["computed"] += 1
                else:
                    self._c["already_cached"] += 1
            self._cond.notify_all()
        for j in jobs:
            if j.future.done():  # cancelled by its caller: nothing to tell it
                continue
            try:
                if error is not None:
                    j.future.set_exception(error)
                else:
                    j.future.set_result(job.key)
            except Exception:  # noqa: BLE001 - InvalidStateError: cancelled concurrently
                pass


class _Foreground:
    __slots__ = ("pc",)

    def __init__(self, pc: Precomputer):
        self.pc = pc

    def __enter__(self):
        with self.pc._cond:
            self.pc._foreground += 1
        return self

    def __exit__(self, *exc):
        with self.pc._cond:
            self.pc._foreground -= 1
            if self.pc._foreground == 0:
                self.pc._hold_until = 0.0  # the query a retriever hook deferred for is over
            self.pc._cond.notify_all()
        return False


# Re-exported for callers that wait on futures.
__all__ += ["CancelledError"]
