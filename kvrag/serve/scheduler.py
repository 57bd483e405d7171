"""The request scheduler behind ``kvrag serve``: many requests, one model, one thread.

``Scheduler.submit`` checks a ``GenerationRequest`` in the caller's thread (decoding options,
the policy and its parameters against the model, the prompt's tokens against the model's
context) and queues it; it never waits for the model. One worker thread owns the model and
runs rounds:

1. **Admission** (continuous batching): while fewer than ``max_concurrency`` requests run,
   waiting ones are admitted in arrival order. Each prompt is prefilled through the library's
   own query path, ``KVRag.prefill`` (segmentation, chunk lookup, fusion under the request's
   policy: nothing of it is re-implemented here), and its first token is sampled at once (its
   TTFT). Prefills run between decode steps, before the next one.
2. **One decode step** for every running request. Its cache is taken out of the prefill's
   stepper into a ``kvrag.query.batch.DecodeCache``, and ``decode_step`` runs the token-wise
   work of every layer (norms, q/k/v/o projections, MLP, final norm, LM head: nearly all the
   weight reads) once for all of them. Attention runs in one call per layer over a
   ``DecodeArena`` (the running requests' caches padded into one buffer, each request's cache
   a view of its slot) on models without sliding windows or soft-capped attention, and per
   request over its own cache otherwise. One host read of the batch's sampled tokens per step.

Which requests decode in the batched step: every policy whose decode step is the model's own
— ``full_prefill``, ``naive_reuse``, ``cacheblend``, ``epic``, ``a3`` (evicting or not),
``kvlink``, ``samkv`` — also on sliding-window models, whose thinned caches (SamKV, A3's
eviction) are windowed by key position as ``FusedStepper`` windows them. A policy that selects
cache rows per decode step (``policy.decode_select``: ``a2ats``' top-k reads) keeps its own
stepper and decodes unbatched, one token per round in the same loop.

Sampling is per request (temperature, top-p, top-k, OpenAI's penalties and logit bias, a JSON
schema the reply is held to, a ``torch.Generator`` seeded per request, as ``KVRag.stream``
samples), with EOS and stop strings (``TextStream``) and ``max_new_tokens``: a request's greedy
tokens are those of ``KVRag.generate`` for the same prompt and policy, up to float rounding of
the batched rows (``tests/unit/test_serve_scheduler.py``). A request of ``n`` choices
(``submit_choices``) is prefilled once and decodes each choice in a slot of its own.

A ``Ticket`` is the caller's handle: iterate it (or ``async for``) for text deltas,
``result()`` for the ``Finished`` record, ``cancel()`` to stop at the next step and free the
slot. A request that fails after admission (a store fault, an exception in its prefill or its
part of a decode step) ends alone with ``finish_reason="error"``: a failed batched step
changed no cache, and is retried one request at a time to find whose it was. Past
``max_queue`` waiting requests ``submit`` raises ``SchedulerFullError`` with a retry-after
estimate.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvrag.checks import check_int
from kvrag.defaults import MAX_TOP_LOGPROBS
from kvrag.engine import KVRag
from kvrag.errors import KVRagError
from kvrag.policies import Policy, get_policy
from kvrag.query.batch import DecodeArena, DecodeCache, decode_step
from kvrag.query.constrain import JsonConstraint
from kvrag.query.decode import FusedStepper, HFStepper, Sampling, TextStream, adjust_logits, sample
from kvrag.query.prompt import render_prompt
from kvrag.query.state import FusionStats
from kvrag.serve.logprobs import TokenLogprob, distribution, token_logprob

log = logging.getLogger("kvrag.serve")

#: Tokens a request may generate when it names no limit (cut to what the context leaves).
DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: a prompt string or chat messages (``KVRag.render`` makes the string),
    decoding options as ``KVRag.stream`` takes them, and the reuse policy (None: the KVRag's).

    ``max_new_tokens``: None takes ``DEFAULT_MAX_NEW_TOKENS`` cut to what the context leaves; a
    number is a demand, refused when the prompt leaves less room. ``min_tokens`` / ``ignore_eos``
    (vLLM's sampling extras, e.g. for benchmarks at a fixed answer length): EOS cannot be drawn
    before ``min_tokens`` tokens (its logits are masked; a stop string still ends the request);
    ``ignore_eos`` decodes past EOS up to ``max_new_tokens``. ``top_k``, ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias``: as ``kvrag.query.decode.Sampling`` takes them (applied
    after the EOS bar). ``n``: choices drawn from the one prefill (``Scheduler.submit_choices``),
    each decoded in its own slot with its own generator (seeded ``seed + i`` for choice ``i``,
    so choice 0 is what the same request with ``n=1`` draws). ``json_schema``: hold each reply to a
    JSON document valid under it (``kvrag.query.constrain``), ended when complete. ``logprobs``:
    None, or report each
    generated token's log-probability with that many alternatives (0 to ``MAX_TOP_LOGPROBS``;
    ``kvrag.serve.logprobs``)."""

    prompt: str | list[dict]
    max_new_tokens: int | None = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    policy: str | None = None
    policy_params: dict = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)
    n: int = 1
    json_schema: dict | None = None

    def sampling(self, max_new_tokens: int) -> Sampling:
        """The decoding options (checked: ValueError names a bad one)."""
        return Sampling(
            max_new_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.stop,
            self.seed,
            self.presence_penalty,
            self.frequency_penalty,
            self.logit_bias,
        )


@dataclass
class Finished:
    """How a request ended. ``finish_reason``: "stop" (EOS or a stop string), "length"
    (max_new_tokens), "cancelled" or "error" (then ``error`` is set). ``cached_tokens``: prompt
    tokens whose K/V were read, not computed: from chunk caches and the prompt prefix cache.
    ``ttft_s``: from ``submit`` to the first token (queueing included; ``stats.ttft_s`` counts
    from the prefill's start), None if no token came. ``logprobs``: one entry per generated
    token but an EOS that ended the reply (a stop string's tokens included), if the request
    asked for them."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None
    stats: FusionStats | None
    error: BaseException | None = None
    logprobs: list[TokenLogprob] | None = None


class Delta(NamedTuple):
    """A piece of a reply as it streams: its ``text`` and the ``logprobs`` entries of the
    tokens decoded since the previous piece (empty unless the request asked for them; a
    piece's tokens may hold text the next piece shows, such as a stop string's start)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


class SchedulerFullError(KVRagError):
    """``max_queue`` requests already wait; ``retry_after_s`` estimates when a slot frees."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SchedulerClosedError(KVRagError):
    """The scheduler is closed (or was never started) and takes no request."""


class Ticket:
    """A submitted request: text deltas as they are decoded, then its ``Finished``.

    Iterating it (sync or async) gives the text deltas; ``deltas`` / ``adeltas`` give them as
    ``Delta``\\ s, with their tokens' log-probabilities. Every iterator replays the deltas from
    the first, so a ticket may be read more than once; iteration raises the request's error
    after the deltas it produced."""

    def __init__(self, scheduler: Scheduler, req: GenerationRequest, index: int = 0):
        self._scheduler = scheduler
        self.request = req
        #: Which of the request's ``n`` choices this ticket reads.
        self.index = index
        self._deltas: list[Delta] = []
        self._finished: Finished | None = None
        self._cond = threading.Condition()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self.cancelled = False

    # ---- written by the worker ----------------------------------------------------------
    def _push(self, delta: Delta) -> None:
        with self._cond:
            self._deltas.append(delta)
            self._cond.notify_all()
            waiters = list(self._waiters)
        self._wake(waiters)

    def _finish(self, fin: Finished) -> None:
        with self._cond:
            if self._finished is not None:
                return
            self._finished = fin
            self._cond.notify_all()
            waiters = list(self._waiters)
        self._wake(waiters)

    @staticmethod
    def _wake(waiters) -> None:
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that event loop is closed: nobody waits there any more
                pass

    # ---- read by the caller ---------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._finished is not None

    def __iter__(self) -> Iterator[str]:
        return (d.text for d in self.deltas())

    def __aiter__(self) -> AsyncIterator[str]:
        return self._texts()

    async def _texts(self) -> AsyncIterator[str]:
        async for d in self.adeltas():
            yield d.text

    def deltas(self) -> Iterator[Delta]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._deltas) and self._finished is None:
                    self._cond.wait()
                chunk = self._deltas[i:]
                fin = self._finished  # set after the last delta was pushed: chunk has them all
            for d in chunk:
                yield d
            i += len(chunk)
            if fin is not None and i >= len(self._deltas):
                if fin.error is not None:
                    raise fin.error
                return

    async def adeltas(self) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            ev = asyncio.Event()
            key = (loop, ev)
            with self._cond:
                self._waiters.add(key)
                chunk = self._deltas[i:]
                fin = self._finished
            try:
                if not chunk and fin is None:
                    await ev.wait()
                    continue
            finally:
                with self._cond:
                    self._waiters.discard(key)
            for d in chunk:
                yield d
            i += len(chunk)
            if fin is not None and i >= len(self._deltas):
                if fin.error is not None:
                    raise fin.error
                return

    def result(self, timeout: float | None = None) -> Finished:
        """The request's ``Finished`` (also for "error": it does not raise the error);
        TimeoutError if it has not ended within ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished is not None, timeout):
                raise TimeoutError(f"the request did not finish within {timeout} s")
            finished = self._finished
            assert finished is not None  # the wait above returned on it
            return finished

    def cancel(self) -> None:
        """Stop the request (this choice of it): a waiting one leaves the queue now, a running
        one at its next decode step (its slot is then free); ``finish_reason`` is "cancelled"."""
        self.cancelled = True
        self._scheduler._cancel_waiting(self)


@dataclass
class _Job:
    """A queued request, checked by ``submit``: one ticket per choice."""

    tickets: list[Ticket]
    text: str
    policy: Policy
    sampling: Sampling
    t_submit: float
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    json_schema: dict | None = None


@dataclass
class _Running:
    """A request between its prefill and its end: the decoder state the worker steps."""

    job: _Job
    ticket: Ticket  # the choice this decodes
    stepper: HFStepper | FusedStepper | None  # its own decoder; None while ``cache`` holds its K/V
    stats: FusionStats
    text: TextStream
    gen: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    out: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0  # entries already pushed with a delta
    constraint: JsonConstraint | None = None  # the document the reply must be
    t_first: float | None = None
    t_prefill: float = 0.0
    cache: DecodeCache | None = None  # set: the request decodes in the shared batched step
    done: bool = False


def _width(job: _Job) -> int:
    """Decode slots a waiting request takes: one per choice not ended (cancelled) yet, at
    least one (a request whose choices all ended is dropped at its admission)."""
    return max(1, sum(not t.done for t in job.tickets))


class Scheduler:
    """Runs ``GenerationRequest``s on one ``KVRag`` from one worker thread.

    max_concurrency: requests decoding at once; max_queue: requests waiting beyond them
    (``submit`` raises ``SchedulerFullError`` past it)."""

    def __init__(self, rag: KVRag, *, max_concurrency: int = 8, max_queue: int = 64):
        self.rag = rag
        self.max_concurrency = check_int("max_concurrency", max_concurrency, 1)
        self.max_queue = check_int("max_queue", max_queue, 0)
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: list[_Running] = []
        self._admitting = 0  # taken from the queue by the worker, prefilling, not yet running
        self._thread: threading.Thread | None = None
        self._closed = False
        # submit tokenizes in callers' threads; a fast tokenizer is not safe to share with the
        # worker's, so the callers get a copy of their own (used under this lock).
        self._tok = copy.deepcopy(rag.tokenizer)
        self._tok_lock = threading.Lock()
        self._prefix = len(rag.handle.prefix_ids())
        self._eos = torch.tensor(sorted(rag.eos), dtype=torch.long)
        # The running requests' caches, padded into one buffer per layer where the model
        # allows (one attention call per layer for the whole batch); touched by the worker only.
        self._arena = DecodeArena(rag.arch)
        # Seconds a request holds a slot (moving average), for the retry-after estimate.
        self._service_s = 2.0
        #: Called after each batched decode step with (requests in it, seconds it took), in the
        #: worker thread (the server's metrics).
        self.step_observers: list[Callable[[int, float], None]] = []

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise SchedulerClosedError("the scheduler is closed")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="kvrag-scheduler", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop taking requests, cancel the waiting and running ones, and join the worker."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            leftovers = list(self._waiting)
            self._waiting.clear()
        for job in leftovers:
            self._end_unstarted(job.tickets, "cancelled")

    def __enter__(self) -> Scheduler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running)

    # ---- submission -------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> Ticket:
        """Check ``req`` (of one choice) and queue it. ValueError / KVRagError name a bad
        option, policy or prompt; SchedulerFullError when ``max_queue`` requests already wait;
        SchedulerClosedError when not started or closed."""
        if isinstance(req, GenerationRequest) and req.n != 1:
            raise ValueError(f"n={req.n!r}: submit takes one choice; submit_choices takes several")
        return self.submit_choices(req)[0]

    def submit_choices(self, req: GenerationRequest) -> list[Ticket]:
        """``submit`` for a request of ``req.n`` choices: one ticket per choice, all drawn from
        one prefill. Each choice holds a decode slot, so ``n`` may not exceed
        ``max_concurrency``."""
        t_submit = time.perf_counter()
        if not isinstance(req, GenerationRequest):
            raise TypeError(f"submit takes a GenerationRequest, got {type(req).__name__}")
        n = check_int("n", req.n, 1)
        if n > self.max_concurrency:
            raise ValueError(f"n={n} choices need more than this server's {self.max_concurrency} decode slots")
        # Checked before the prompt is tokenized, with a stand-in for an unnamed limit.
        req.sampling(req.max_new_tokens or 0).check_vocab(self.rag.handle.config.vocab_size)
        if req.json_schema is not None:
            self.rag.json_constraint(req.json_schema)  # compiles, or names what it cannot
        min_tokens = check_int("min_tokens", req.min_tokens, 0)
        if not isinstance(req.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {req.ignore_eos!r}")
        if req.logprobs is not None and check_int("logprobs", req.logprobs, 0) > MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs: at most {MAX_TOP_LOGPROBS} alternatives per token, got {req.logprobs}")
        if not isinstance(req.policy_params, dict):
            raise ValueError(f"policy_params must be a dict, got {type(req.policy_params).__name__}")
        pol = get_policy(req.policy if req.policy is not None else self.rag.policy, **req.policy_params)
        pol.check_model(self.rag.arch)
        text, n_prompt = self._check_prompt(req.prompt)
        room = self.rag.handle.max_context - n_prompt
        if req.max_new_tokens is None:
            max_new = min(DEFAULT_MAX_NEW_TOKENS, room)
        elif req.max_new_tokens > room:
            raise ValueError(
                f"the model's context is {self.rag.handle.max_context} tokens; the prompt takes {n_prompt} "
                f"and max_new_tokens={req.max_new_tokens} asks for more than the {room} left (context exceeded)"
            )
        else:
            max_new = req.max_new_tokens
        if min_tokens > max_new:
            raise ValueError(f"min_tokens={min_tokens} is over the request's max_new_tokens={max_new}")
        sampling = req.sampling(max_new)
        tickets = [Ticket(self, req, i) for i in range(n)]
        with self._lock:
            if self._closed or self._thread is None:
                raise SchedulerClosedError("the scheduler is not running (start() it; close() ends it)")
            # A request a free slot takes at the next round does not wait: max_queue counts
            # those beyond the slots (so max_queue=0 serves while a slot is free, then refuses).
            free = self.max_concurrency - len(self._running) - self._admitting
            if len(self._waiting) >= self.max_queue + max(0, free):
                raise SchedulerFullError(
                    f"{len(self._waiting)} requests already wait (max_queue={self.max_queue})",
                    self._retry_after(),
                )
            self._waiting.append(
                _Job(tickets, text, pol, sampling, t_submit, min_tokens, req.ignore_eos, req.logprobs, req.json_schema)
            )
            self._lock.notify_all()
        return tickets

    def _check_prompt(self, prompt) -> tuple[str, int]:
        """The prompt string (chat messages rendered) and its token count, refused when it is
        empty or its tokens exceed the model's context (inserted tokens are checked again at
        the prefill)."""
        if not isinstance(prompt, (str, list)):
            raise ValueError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        with self._tok_lock:
            try:
                text = render_prompt(self._tok, prompt)
            except TypeError as e:  # a malformed message list: the caller's input, not a bug
                raise ValueError(str(e)) from None
            n = self._prefix + len(self._tok(text, add_special_tokens=False)["input_ids"])
        if n == 0:
            raise ValueError("the prompt is empty")
        limit = self.rag.handle.max_context
        if n > limit:
            raise ValueError(f"prompt of {n} tokens exceeds the model context ({limit})")
        return text, n

    def _retry_after(self) -> float:
        """Seconds until a waiting slot is likely free: the queue ahead, drained
        ``max_concurrency`` at a time at the recent time per request (caller holds the lock)."""
        rounds = (len(self._waiting) + 1) / self.max_concurrency
        return max(1.0, round(rounds * self._service_s, 1))

    def _cancel_waiting(self, ticket: Ticket) -> None:
        with self._lock:
            job = next((j for j in self._waiting if ticket in j.tickets), None)
            if job is not None and all(t.cancelled for t in job.tickets):
                self._waiting.remove(job)  # the whole request: it leaves the queue
        if job is not None:
            self._end_unstarted([ticket], "cancelled")

    @staticmethod
    def _end_unstarted(tickets: list[Ticket], reason: str, error: BaseException | None = None) -> None:
        """End choices that hold no slot (still waiting, or their prefill failed)."""
        for t in tickets:
            t._finish(Finished("", [], reason, 0, 0, 0, None, None, error))

    # ---- the worker -----------------------------------------------------------------------
    def _loop(self) -> None:
        # no_grad (not inference_mode): tensors this thread creates (hot-cache entries) stay
        # usable by a KVRag.generate in another thread.
        with torch.no_grad():
            while True:
                with self._lock:
                    while not self._closed and not self._waiting and not self._running:
                        self._lock.wait()
                    if self._closed:
                        break
                    # In arrival order, each request taking a slot per choice still to run.
                    admit: list[_Job] = []
                    free = self.max_concurrency - len(self._running)
                    while self._waiting and (width := _width(self._waiting[0])) <= free:
                        free -= width
                        admit.append(self._waiting.popleft())
                    self._admitting = self.max_concurrency - len(self._running) - free
                try:
                    # Prefills first (each request's first token, its TTFT, comes from its
                    # prefill), then one decode step for all that run.
                    for job in admit:
                        width = _width(job)
                        self._admit(job)
                        with self._lock:
                            self._admitting -= width
                    self._decode_round()
                except Exception as e:  # a fault of the scheduler itself: fail what it held, go on
                    log.exception("kvrag scheduler: unexpected error; the running requests end with it")
                    with self._lock:
                        self._admitting = 0
                    for job in admit:
                        self._end_unstarted(job.tickets, "error", e)  # (no-op for those already ended)
                    for r in list(self._running):
                        self._end(r, "error", e)
            for r in list(self._running):
                self._end(r, "cancelled")

    def _admit(self, job: _Job) -> None:
        """Prefill a request through the library's query path (``KVRag.prefill``: chunk
        lookup and fusion under its policy), draw each choice's first token from it, and take
        each choice's cache into the batched step (a copy each). A policy that decodes on its
        own keeps the prefill's decoder for the first choice and prefills again for each other."""
        self._end_unstarted([t for t in job.tickets if t.cancelled], "cancelled")
        live = [t for t in job.tickets if not t.done]
        if not live:
            return
        t0 = time.perf_counter()
        try:
            pre = self.rag.prefill(job.text, job.policy)
            schema = job.json_schema
            constraints = [self.rag.json_constraint(schema) if schema is not None else None for _ in live]
        except Exception as e:  # this request's own fault (a store, its prompt): it ends alone
            log.debug("request failed at its prefill", exc_info=True)
            self._end_unstarted(live, "error", e)
            return
        s = job.sampling
        runs = [
            _Running(
                job,
                t,
                None,
                copy.copy(pre.stats),
                TextStream(self.rag.tokenizer, s.stop),
                torch.Generator().manual_seed(s.seed + t.index) if s.seed is not None else None,
                t_prefill=t0,
                constraint=c,
            )
            for t, c in zip(live, constraints)
        ]
        with self._lock:
            self._running.extend(runs)
        if s.max_new_tokens == 0:
            for r in runs:
                self._end(r, "length")
            return
        lp = distribution(pre.logits) if job.logprobs is not None else None
        # The prefill's own decoder, until a choice whose policy decodes on its own takes it.
        stepper: HFStepper | FusedStepper | None = pre.stepper
        for r in runs:
            try:
                self._accept(r, self._draw(self._bar_eos(pre.logits, [r]), r), lp)
                if r.done:
                    continue
                # Rows for the tokens still to come, so a short answer never regrows its cache.
                r.cache = DecodeCache.from_stepper(self.rag.arch, pre.stepper, spare=min(s.max_new_tokens, 512))
                if r.cache is not None:
                    self._arena.add(r.cache)
                elif stepper is not None:
                    r.stepper, stepper = stepper, None
                else:
                    r.stepper = self.rag.prefill(job.text, job.policy).stepper
            except Exception as e:
                log.debug("request failed after its prefill", exc_info=True)
                self._end(r, "error", e)

    def _bar_eos(self, logits: torch.Tensor, rows: list[_Running]) -> torch.Tensor:
        """Next-token logits [B, V] (or [V] for one request) of ``rows``, with EOS masked in
        place for each request still short of its ``min_tokens`` (as vLLM bars it)."""
        barred = [i for i, r in enumerate(rows) if len(r.tokens) < r.job.min_tokens]
        if barred and len(self._eos):
            view = logits.view(-1, logits.shape[-1])
            idx = torch.tensor(barred, device=logits.device)
            view[idx.unsqueeze(1), self._eos.to(logits.device).unsqueeze(0)] = float("-inf")
        return logits

    def _draw(self, logits: torch.Tensor, r: _Running) -> int:
        """The request's next token from its (EOS-barred) logits [V]: shaped by its options
        (``_adjusted``), then sampled on the host with its own generator, as ``KVRag.stream``
        draws it."""
        return sample(self._adjusted(logits, r).cpu(), r.job.sampling, r.gen)

    @staticmethod
    def _adjusted(logits: torch.Tensor, r: _Running) -> torch.Tensor:
        """The request's logits [V] as its options shape them before the draw: penalties and
        biases, then what its JSON document may take next."""
        logits = adjust_logits(logits, r.job.sampling, r.tokens)
        return r.constraint.mask(logits) if r.constraint is not None else logits

    def _accept(self, r: _Running, tok: int, logprobs: torch.Tensor | None = None) -> None:
        """Take the request's next token: stream its text, and end the request on EOS, a stop
        string or its token budget (the rules of ``KVRag.stream``). ``logprobs`` [V]: the
        distribution it was drawn from (``distribution``), when the request reports it."""
        if r.t_first is None:
            r.t_first = time.perf_counter()
            r.stats.ttft_s = r.t_first - r.t_prefill
        ends = tok in self.rag.eos and not r.job.ignore_eos
        if logprobs is not None and r.job.logprobs is not None and not ends:
            r.logprobs.append(token_logprob(self.rag.tokenizer, r.tokens, logprobs, tok, r.job.logprobs))
        r.tokens.append(tok)
        if r.constraint is not None and not ends:
            r.constraint.accept(tok)
        delta = r.text.push(tok)
        if delta:
            self._push(r, delta)
        if r.text.stopped or ends or (r.constraint is not None and r.constraint.done):
            self._end(r, "stop")
        elif len(r.tokens) >= r.job.sampling.max_new_tokens:
            self._end(r, "length")

    def _decode_round(self) -> None:
        """One decode step for every running request (one token each): the batched step for
        those whose cache it holds, then each own-decode request's stepper."""
        for r in list(self._running):
            if r.ticket.cancelled:
                self._end(r, "cancelled")
        # In arena slot order, so a batch of exactly the arena's members attends in one call.
        order = {id(c): i for i, c in enumerate(self._arena.members)}
        batch = sorted(
            (r for r in self._running if r.cache is not None), key=lambda r: order.get(id(r.cache), len(order))
        )
        if batch:
            self._batched(batch)
        for r in [r for r in self._running if r.cache is None]:
            try:
                assert r.stepper is not None  # a request without a batched cache keeps its stepper
                logits = r.stepper.step([r.tokens[-1]])[-1]
                lp = distribution(logits) if r.job.logprobs is not None else None
                self._accept(r, self._draw(self._bar_eos(logits, [r]), r), lp)
            except Exception as e:
                log.debug("request failed at a decode step", exc_info=True)
                self._end(r, "error", e)

    def _batched(self, batch: list[_Running]) -> None:
        """One ``decode_step`` over ``batch``; if it raises, each request is retried alone so
        the failure ends only the request(s) it belongs to (the step left every cache as it
        was)."""
        try:
            caches = [r.cache for r in batch if r.cache is not None]  # every one: batch holds cached requests
            t0 = time.perf_counter()
            logits = decode_step(self.rag.arch, caches, [r.tokens[-1] for r in batch], self._arena)
            took = time.perf_counter() - t0
        except Exception as e:
            if len(batch) == 1:
                log.debug("request failed at a decode step", exc_info=True)
                self._end(batch[0], "error", e)
            else:
                for r in batch:
                    self._batched([r])
            return
        # One host read for the batch: plain greedy rows take the device's argmax; sampled or
        # adjusted rows are adjusted on the device and drawn on the host with their own
        # generator, as ``KVRag.stream`` draws them.
        for observe in self.step_observers:
            observe(len(batch), took)
        # The distributions reported are the model's, read before EOS is barred for sampling.
        wants = [i for i, r in enumerate(batch) if r.job.logprobs is not None]
        lps = dict(zip(wants, distribution(logits[wants]))) if wants else {}
        toks = self._bar_eos(logits, batch).argmax(-1).tolist()
        own = [
            i
            for i, r in enumerate(batch)
            if r.job.sampling.temperature > 0 or r.job.sampling.adjusts or r.constraint is not None
        ]
        if own:
            rows = torch.stack([self._adjusted(logits[i], batch[i]).float() for i in own])
            for i, row in zip(own, rows.cpu()):
                toks[i] = sample(row, batch[i].job.sampling, batch[i].gen)
        for i, (r, tok) in enumerate(zip(batch, toks)):
            try:
                self._accept(r, tok, lps.get(i))
            except Exception as e:  # detokenising this request's text
                self._end(r, "error", e)

    def _push(self, r: _Running, text: str) -> None:
        """Stream ``text`` with the log-probabilities of the tokens decoded since the last push."""
        r.out += text
        entries = tuple(r.logprobs[r.logprobs_sent :])
        r.logprobs_sent = len(r.logprobs)
        r.ticket._push(Delta(text, entries))

    def _end(self, r: _Running, reason: str, error: BaseException | None = None) -> None:
        if r.done:
            return
        if reason in ("stop", "length"):
            tail = r.text.flush() if not r.text.stopped else ""
            if tail:
                self._push(r, tail)
        now = time.perf_counter()
        stats = r.stats
        stats.new_tokens = len(r.tokens)
        stats.decode_s = now - (r.t_first or r.t_prefill)
        with self._lock:
            if r in self._running:
                self._running.remove(r)
            self._service_s = 0.8 * self._service_s + 0.2 * (now - r.t_prefill)
        r.done = True
        if r.cache is not None:
            self._arena.remove(r.cache)
        r.stepper = r.cache = None  # the request's cache goes now, not when the ticket is dropped
        ttft = r.t_first - r.job.t_submit if r.t_first is not None else None
        fin = Finished(
            r.out,
            list(r.tokens),
            reason,
            stats.prompt_tokens,
            len(r.tokens),
            stats.read_tokens,
            ttft,
            stats,
            error,
            list(r.logprobs) if r.job.logprobs is not None else None,
        )
        r.ticket._finish(fin)
