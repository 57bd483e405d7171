"""The request scheduler behind ``kvrag serve``: many requests, one model, one thread.

``Scheduler.submit`` checks a ``GenerationRequest`` in the caller's thread, each thing once
(its policy resolved, its prompt tokenized, its JSON schema compiled, its token budget set by
``Sampling.budget``) and queues it; it never waits for the model. One worker thread owns the model and
runs rounds:

1. **Admission** (continuous batching): while fewer than ``max_concurrency`` requests run,
   waiting ones are admitted in arrival order. Each prompt is prefilled through the library's
   own query path, ``KVRag.prefill`` (segmentation, chunk lookup, fusion under the request's
   policy, on the tokens ``submit`` made: nothing of it is re-implemented here), and its first
   token is drawn at once (its TTFT). Prefills run between decode steps, before the next one.
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

Every request and choice decodes with its own ``kvrag.query.decode.Decoder``, the one that
``KVRag.stream`` drives: the draw (its ``Sampling``'s options, its own seeded generator), the
tokens it accepts, stop strings, EOS and the token budget are its rules, not this module's
(``draw_batch`` draws a batched step's tokens with one host read). So a request's greedy tokens
are those of ``KVRag.generate`` for the same prompt and policy, up to float rounding of the
batched rows (``tests/unit/serve/test_scheduler.py``). A request of ``n`` choices
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

import collections
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrag.checks import check_int
from kvrag.defaults import MAX_TOP_LOGPROBS
from kvrag.engine import KVRag, Prefill
from kvrag.errors import KVRagError
from kvrag.layout.prompt import render_prompt
from kvrag.layout.state import FusionStats
from kvrag.policies import Policy, get_policy
from kvrag.query.batch import DecodeArena, DecodeCache, decode_step
from kvrag.query.constrain import JsonConstraint
from kvrag.query.decode import Decoder, FusedStepper, HFStepper, Sampling, draw_batch
from kvrag.query.lookup import PromptTokens
from kvrag.serve.logprobs import TokenLogprob, distribution, token_logprob
from kvrag.serve.ticket import Delta, Finished, Ticket

log = logging.getLogger("kvrag.serve")


class RequestError(ValueError):
    """A request ``submit`` refuses: ``param`` names the wire field at fault where the server
    answers with one ("n", "kvrag.policy"; None where the message names it), ``code`` the
    error code where one applies ("context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: a prompt string or chat messages (``KVRag.render`` makes the string),
    its options (``sampling``: every generation option, ``kvrag.query.decode.Sampling``, checked
    when it is built), and the reuse policy: a name (None: the KVRag's) with ``policy_params``,
    or a ``Policy`` already resolved (taken as is).

    ``n``: choices drawn from the one prefill (``Scheduler.submit_choices``), each decoded in
    its own slot with its own generator (seeded ``seed + i`` for choice ``i``, so choice 0 is
    what the same request with ``n=1`` draws). ``logprobs``: None, or report each generated
    token's log-probability with that many alternatives (0 to ``MAX_TOP_LOGPROBS``;
    ``kvrag.serve.logprobs``)."""

    prompt: str | list[dict]
    sampling: Sampling = field(default_factory=Sampling)
    policy: str | Policy | None = None
    policy_params: dict = field(default_factory=dict)
    logprobs: int | None = None
    n: int = 1

    @classmethod
    def of(
        cls,
        prompt: str | list[dict],
        *,
        policy: str | Policy | None = None,
        policy_params: dict | None = None,
        logprobs: int | None = None,
        n: int = 1,
        **options,
    ) -> GenerationRequest:
        """A request with its generation options given as keywords (``Sampling``'s fields)."""
        return cls(prompt, Sampling(**options), policy, dict(policy_params or {}), logprobs, n)


class SchedulerFullError(KVRagError):
    """``max_queue`` requests already wait; ``retry_after_s`` estimates when a slot frees."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SchedulerClosedError(KVRagError):
    """The scheduler is closed (or was never started) and takes no request."""


@dataclass
class _Job:
    """A queued request, checked by ``submit``: one ticket per choice, its policy resolved,
    its prompt tokenized and its schema compiled, each once."""

    tickets: list[Ticket]
    text: str
    tokens: PromptTokens
    policy: Policy
    sampling: Sampling
    budget: int  # tokens each choice may draw (``Sampling.budget``)
    t_submit: float
    logprobs: int | None = None
    constraint: JsonConstraint | None = None  # compiled; each choice decodes with a copy


@dataclass
class _Running:
    """A request between its prefill and its end: the decoder state the worker steps."""

    job: _Job
    ticket: Ticket  # the choice this decodes
    stepper: HFStepper | FusedStepper | None  # its own decoder; None while ``cache`` holds its K/V
    stats: FusionStats
    decoder: Decoder
    out: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0  # entries already pushed with a delta
    t_first: float | None = None
    t_prefill: float = 0.0
    cache: DecodeCache | None = None  # set: the request decodes in the shared batched step
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.decoder.tokens


def _checked(check, name: str, value, lo: int, param: str | None = None) -> int:
    """``check(name, value, lo)``, its ValueError a ``RequestError`` (with ``param``)."""
    try:
        return check(name, value, lo)
    except ValueError as e:
        raise RequestError(str(e), param=param) from None


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
            raise RequestError(f"n={req.n!r}: submit takes one choice; submit_choices takes several", param="n")
        return self.submit_choices(req)[0]

    def submit_choices(self, req: GenerationRequest) -> list[Ticket]:
        """``submit`` for a request of ``req.n`` choices: one ticket per choice, all drawn from
        one prefill. Each choice holds a decode slot, so ``n`` may not exceed
        ``max_concurrency``.

        Everything that can refuse a request is checked here, once (the options were checked
        when its ``Sampling`` was built): the choices, the log-probabilities asked for, the
        policy (resolved once; the prefill runs that instance), the logit biases against the
        vocabulary, the JSON schema (compiled once; each choice decodes with a copy of it), the
        prompt (rendered and tokenized once; the prefill reads those tokens) and the token
        budget (``Sampling.budget``)."""
        t_submit = time.perf_counter()
        if not isinstance(req, GenerationRequest):
            raise TypeError(f"submit takes a GenerationRequest, got {type(req).__name__}")
        if not isinstance(req.sampling, Sampling):
            raise TypeError(f"GenerationRequest.sampling must be a Sampling, got {type(req.sampling).__name__}")
        n = _checked(check_int, "n", req.n, 1, param="n")
        if n > self.max_concurrency:
            raise RequestError(
                f"n={n}: each choice decodes in a slot of its own, and this server has "
                f"{self.max_concurrency} decode slots (--max-concurrency)",
                param="n",
            )
        if req.logprobs is not None and _checked(check_int, "logprobs", req.logprobs, 0) > MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs: at most {MAX_TOP_LOGPROBS} alternatives per token, got {req.logprobs}")
        s = req.sampling
        s.check_vocab(self.rag.handle.config.vocab_size)
        pol = self._policy(req)
        constraint = None
        if s.json_schema is not None:
            constraint = self.rag.json_constraint(s.json_schema)
        text, tokens, n_prompt = self._check_prompt(req.prompt, pol)
        try:
            budget = s.budget(n_prompt, self.rag.handle.max_context)
        except ValueError as e:
            raise RequestError(str(e), code="context_length_exceeded") from None
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
            self._waiting.append(_Job(tickets, text, tokens, pol, s, budget, t_submit, req.logprobs, constraint))
            self._lock.notify_all()
        return tickets

    def _policy(self, req: GenerationRequest) -> Policy:
        """The request's policy, resolved once (a ``Policy`` instance is taken as is) and
        checked against the model."""
        if not isinstance(req.policy_params, dict):
            raise RequestError(f"policy_params must be a dict, got {type(req.policy_params).__name__}")
        pol = get_policy(req.policy if req.policy is not None else self.rag.policy, **req.policy_params)
        pol.check_model(self.rag.arch)
        return pol

    def _check_prompt(self, prompt, pol: Policy) -> tuple[str, PromptTokens, int]:
        """The prompt string (chat messages rendered), its tokens (what the prefill reads, made
        as ``pol``'s prefill makes them: the stored ids of the chunks the hot tier holds
        spliced in, the rest tokenized; ``KVRag.tokenize``) and their count with the BOS ids,
        refused when it is empty or its tokens exceed the model's context (inserted tokens are
        checked again at the prefill)."""
        if not isinstance(prompt, (str, list)):
            raise RequestError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        with self._tok_lock:
            try:
                text = render_prompt(self._tok, prompt)
            except TypeError as e:  # a malformed message list: the caller's input, not a bug
                raise RequestError(str(e)) from None
            tokens = self.rag.tokenize(text, self._tok, pol.uses_cache)
        n = self.rag.count_prompt(text, tokens)
        if n == 0:
            raise RequestError("the prompt is empty")
        limit = self.rag.handle.max_context
        if n > limit:
            raise RequestError(
                f"prompt of {n} tokens exceeds the model context ({limit})", code="context_length_exceeded"
            )
        return text, tokens, n

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
        """Prefill a request through the library's query path (``KVRag.prepare``/``fuse``: chunk
        lookup and fusion under its policy, on the tokens ``submit`` made), draw each choice's
        first token from it, and take each choice's cache into the batched step (a copy each).
        A policy that decodes on its own keeps the prefill's decoder for the first choice and
        prefills again for each other."""
        self._end_unstarted([t for t in job.tickets if t.cancelled], "cancelled")
        live = [t for t in job.tickets if not t.done]
        if not live:
            return
        t0 = time.perf_counter()
        try:
            pre = self._prefill(job)
            constraints = [job.constraint.copy() if job.constraint is not None else None for _ in live]
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
                Decoder(s, job.budget, self.rag.tokenizer, self.rag.eos, c, choice=t.index),
                t_prefill=t0,
            )
            for t, c in zip(live, constraints)
        ]
        with self._lock:
            self._running.extend(runs)
        if job.budget == 0:
            for r in runs:
                self._end(r, "length")
            return
        lp = distribution(pre.logits) if job.logprobs is not None else None
        # The prefill's own decoder, until a choice whose policy decodes on its own takes it.
        stepper: HFStepper | FusedStepper | None = pre.stepper
        for r in runs:
            try:
                self._accept(r, r.decoder.draw(pre.logits), lp)
                if r.done:
                    continue
                # Rows for the tokens still to come, so a short answer never regrows its cache.
                r.cache = DecodeCache.from_stepper(self.rag.arch, pre.stepper, spare=min(job.budget, 512))
                if r.cache is not None:
                    self._arena.add(r.cache)
                elif stepper is not None:
                    r.stepper, stepper = stepper, None
                else:
                    r.stepper = self._prefill(job).stepper
            except Exception as e:
                log.debug("request failed after its prefill", exc_info=True)
                self._end(r, "error", e)

    def _prefill(self, job: _Job) -> Prefill:
        """The request's prefill, under its resolved policy, on the tokens ``submit`` made."""
        return self.rag.prefill(job.text, job.policy, prompt_tokens=job.tokens)

    def _accept(self, r: _Running, tok: int, logprobs: torch.Tensor | None = None) -> None:
        """Take the request's next token (its ``Decoder`` decides its text and whether the
        reply ends), stream its text and report its log-probability. ``logprobs`` [V]: the
        distribution it was drawn from (``distribution``), when the request reports it; an EOS
        that ends the reply has none."""
        if r.t_first is None:
            r.t_first = time.perf_counter()
            r.stats.ttft_s = r.t_first - r.t_prefill
        if logprobs is not None and r.job.logprobs is not None and not r.decoder.ends_reply(tok):
            r.logprobs.append(token_logprob(self.rag.tokenizer, r.tokens, logprobs, tok, r.job.logprobs))
        delta = r.decoder.accept(tok)
        if delta:
            self._push(r, delta)
        if r.decoder.finish_reason is not None:
            self._end(r, r.decoder.finish_reason)

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
                self._accept(r, r.decoder.draw(logits), lp)
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
            logits = decode_step(self.rag.arch, caches, [r.tokens[-1] for r in batch], self._arena, self.rag.compiled)
            took = time.perf_counter() - t0
        except Exception as e:
            if len(batch) == 1:
                log.debug("request failed at a decode step", exc_info=True)
                self._end(batch[0], "error", e)
            else:
                for r in batch:
                    self._batched([r])
            return
        for observe in self.step_observers:
            observe(len(batch), took)
        # The distributions reported are the model's, read before EOS is barred for the draw.
        wants = [i for i, r in enumerate(batch) if r.job.logprobs is not None]
        lps = dict(zip(wants, distribution(logits[wants]))) if wants else {}
        toks = draw_batch([r.decoder for r in batch], logits)  # one host read for the batch
        for i, (r, tok) in enumerate(zip(batch, toks)):
            try:
                self._accept(r, tok, lps.get(i))
            except Exception as e:  # noqa: BLE001 - detokenising this request's text
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
            tail = r.decoder.flush()
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
