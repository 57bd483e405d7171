"""What every framework adapter (LlamaIndex, LangChain) does the same way, kept in the core so
the adapters stay thin and cannot drift apart: which policy an LLM wrapper runs, how per-call
options merge into it, what an LLM wrapper exposes of its KVRag (``WrapsKVRag``), scheduling
retrieved texts for precompute, and stepping a kvrag stream from threads and async code.

Imports no framework.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

from kvrag.errors import ChunkError
from kvrag.policies import get_policy, policy_class
from kvrag.precompute import Precomputer, PrecomputerClosedError, QueueFullError

log = logging.getLogger("kvrag.frameworks")

#: Generation options a wrapper passes to ``KVRag.stream`` (plus the policy's own parameters).
GEN_KEYS = ("policy", "max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed")
#: Returned by a step when the stream is over.
END = object()


def policy_param_names(policy) -> set[str]:
    """The hyper-parameter names of ``policy`` (a name or a Policy); ValueError if unknown."""
    return {f.name for f in dataclasses.fields(policy_class(policy).Params)}


def resolve_policy(policy, policy_params: dict | None, flat: dict[str, Any], rag, owner: str):
    """The (policy name, parameters) a wrapper runs by default.

    No ``policy`` given and an existing KVRag ``rag``: that KVRag's own policy and parameters
    (what ``rag.generate`` runs), so a wrapper of ``KVRag(policy="kvlink")`` runs kvlink, not a
    silent cacheblend; ``policy_params`` then update them. ``flat``: the keyword arguments the
    wrapper does not know itself, taken as policy parameters, as ``KVRag(policy=...,
    recompute_ratio=...)`` takes them; any other name is a typo, reported here rather than
    dropped (pydantic models would drop it silently)."""
    own = getattr(rag, "policy", None)
    inherited = (
        {} if own is None else {f.name: _as_json(getattr(own.params, f.name)) for f in dataclasses.fields(own.params)}
    )
    params = {}
    if policy is None and own is not None:
        policy, params = own.name, dict(inherited)
    elif policy is None:
        policy = "cacheblend"
    names = policy_param_names(policy)
    # A wrapper rebuilt with another policy (LangChain's ``configurable_fields(policy=...)``
    # passes all fields back) carries the parameters it inherited from the KVRag: those the
    # new policy lacks are dropped, while parameters the user set stay checked.
    params.update(
        {k: v for k, v in (policy_params or {}).items() if k in names or k not in inherited or inherited[k] != v}
    )
    unknown = sorted(set(flat) - names)
    if unknown:
        raise ValueError(
            f"{owner} got unknown option(s) {unknown}: neither an option of {owner} nor a "
            f"parameter of policy {policy!r} (its parameters: {sorted(names) or 'none'})"
        )
    params.update(flat)
    pol = get_policy(policy, **params)  # fail now, with the registry's message, on a bad value
    arch = getattr(rag, "arch", None)
    if arch is not None:
        pol.check_model(arch)  # and on a policy the wrapped model cannot run (a2ats, no codebook)
    return policy, {k: _as_json(v) for k, v in params.items()}


def _as_json(value: Any) -> Any:
    """A parameter value as JSON holds it (a tuple as a list): a wrapper serialized and loaded
    again has the same settings, and compares equal to them."""
    return list(value) if isinstance(value, tuple) else value


def max_tokens_alias(kwargs: dict[str, Any], owner: str) -> None:
    """In place: ``max_tokens`` (the name most LLM classes use) becomes ``max_new_tokens``."""
    if kwargs.get("max_tokens") is None:
        kwargs.pop("max_tokens", None)
        return
    mt = kwargs.pop("max_tokens")
    if kwargs.get("max_new_tokens") not in (None, mt):
        raise ValueError(f"{owner}: max_tokens={mt} and max_new_tokens={kwargs['max_new_tokens']} disagree; pass one")
    kwargs["max_new_tokens"] = mt


def call_options(
    defaults: dict[str, Any], policy_params: dict[str, Any], kwargs: dict[str, Any], owner: str, log: logging.Logger
) -> dict[str, Any]:
    """Keyword arguments for ``KVRag.stream``: the wrapper's ``defaults`` (the ``GEN_KEYS``)
    and ``policy_params``, overridden by a call's ``kwargs``. A call naming another policy
    without ``policy_params`` drops the wrapper's (they belong to its own policy); policy
    parameters may come flat; other keywords (frameworks forward their own) are ignored."""
    opts = dict(defaults)
    kwargs = dict(kwargs)
    max_tokens_alias(kwargs, owner)
    params = dict(policy_params)
    flat = {}
    for k, v in kwargs.items():
        if k in GEN_KEYS:
            opts[k] = v
        elif k == "policy_params":
            if v is not None and not isinstance(v, Mapping):
                raise TypeError(f"{owner}: policy_params must be a dict of policy parameters, got {type(v).__name__}")
            params = dict(v or {})
        else:
            flat[k] = v
    if opts["policy"] != defaults["policy"] and "policy_params" not in kwargs:
        params = {}
    names = policy_param_names(opts["policy"]) if flat else set()
    for k, v in flat.items():
        if k in names:
            params[k] = v
        else:
            log.debug("%s: ignoring unsupported option %r", owner, k)
    opts["stop"] = stop_list(opts.get("stop"))
    return {**opts, **params}


def stop_list(stop) -> list:
    """Stop strings as a list: None -> [], one string -> [it] (``list("Paris")`` would stop at
    any of its letters), any other iterable -> its items (checked by ``Sampling``)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (bytes, bytearray, Mapping)) or not isinstance(stop, Iterable):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    return list(stop)


@contextlib.contextmanager
def foreground(precomputer: Precomputer | None, rag) -> Iterator[None]:
    """A query computes: ``precomputer`` (else the shared one of ``rag``, if there is one)
    starts no new pack meanwhile. A shut-down ``precomputer`` runs nothing more: the shared
    one that replaced it (hooks built on the KVRag create it) is held back instead."""
    pc = precomputer if precomputer is not None and not precomputer.closed else None
    if pc is None:
        pc = Precomputer.for_rag(rag, create=False)
    if pc is None:
        yield
        return
    with pc.foreground():
        yield


#: The settings a serialized wrapper records of its KVRag's shared tier (``shared_settings``).
SHARED_FIELDS = ("shared", "shared_prefix", "precompute_via")


def shared_settings(rag) -> dict[str, Any]:
    """What a serialized LLM wrapper records of ``rag``'s shared tier: ``shared``, its URL with
    the password removed (a password is never serialized: when the URL is used again it comes
    from ``$KVRAG_REDIS_PASSWORD``, or is passed again), ``shared_prefix`` and
    ``precompute_via``. None/"local" without a shared tier, or with one that has no URL (a
    ChunkStore of the caller's, which cannot be rebuilt from settings)."""
    far = getattr(rag.store, "far", None)
    url = getattr(far, "url", None)
    if not isinstance(url, str):
        return {"shared": None, "shared_prefix": None, "precompute_via": "local"}
    from kvrag.store.shared import public_url  # imports no redis

    return {
        "shared": public_url(url),
        "shared_prefix": far.prefix,
        "precompute_via": "local" if rag.queue is None else "queue",
    }


def shared_options(shared: str | None, shared_prefix: str | None, precompute_via: str | None) -> dict[str, Any]:
    """``KVRag`` keyword arguments that rebuild the shared tier ``shared_settings`` recorded
    (bad values fail in ``KVRag`` with its own messages)."""
    opts: dict[str, Any] = {}
    if precompute_via not in (None, "local"):
        opts["precompute_via"] = precompute_via
    if shared is not None:
        from kvrag.store.shared import RedisStore

        opts["shared"] = RedisStore(shared, prefix=shared_prefix) if shared_prefix else shared
    return opts


def check_shared_matches(given: dict[str, Any], rag, owner: str) -> None:
    """A wrapper given an existing ``rag`` and shared settings: they must be that KVRag's (a
    rebuilt wrapper passes them back), else it is the 'pass either rag or settings' mistake."""
    given = {k: v for k, v in given.items() if v not in (None, "local")}
    if isinstance(given.get("shared"), str):
        from kvrag.store.shared import public_url

        given["shared"] = public_url(given["shared"])
    have = shared_settings(rag)
    if any(have[k] != v for k, v in given.items()):
        raise ValueError(
            f"{owner}: pass either an existing `rag` or the shared-tier settings "
            f"{sorted(given)} to build one, not both (the KVRag has {have})"
        )


class WrapsKVRag:
    """Mixin of the framework LLM classes: what they expose of the ``KVRag`` they wrap, alike
    in every framework. The class provides ``rag`` (the KVRag), the private attributes
    ``_precomputer`` (None until first used) and ``_last`` (the latest ``Generation``), and
    ``_precompute_options()`` (keyword arguments of ``Precomputer.for_rag``)."""

    def _precompute_options(self) -> dict[str, Any]:
        return {}

    @property
    def precomputer(self) -> Precomputer:
        """The background precomputer the ingestion/retriever hooks feed (shared per KVRag)."""
        if self._precomputer is None or self._precomputer.closed:
            self._precomputer = Precomputer.for_rag(self.rag, **self._precompute_options())
        return self._precomputer

    @property
    def last_stats(self):
        """``FusionStats`` of the most recent generation (None before the first)."""
        return None if self._last is None else self._last.stats

    @property
    def last_generation(self):
        """The most recent ``kvrag.engine.Generation`` (text, token ids, prompt ids, stats)."""
        return self._last

    def _foreground(self):
        """Tell the shared precomputer (if any) that a query runs: no new pack starts."""
        return foreground(self._precomputer, self.rag)

    def _record(self, gen) -> None:
        """After each generation: the latest one, and the running totals."""
        self._last = gen
        self._usage.add(gen.stats)

    @property
    def usage_totals(self) -> dict[str, Any]:
        """Running totals over every generation of this object: calls, prompt / cached /
        recomputed / completion tokens, chunks served from the cache, calls that hit, and
        ``cache_hit_rate`` (cached / prompt tokens). ``reset_usage()`` zeroes them."""
        return self._usage.snapshot()

    def reset_usage(self) -> None:
        self._usage.reset()

    # A wrapper holds a loaded model, its store and background threads: a copy shares them
    # (a second model in memory is never what a framework's copy means), and pickling is
    # refused rather than half-done (LlamaIndex's default drops what it cannot pickle from
    # the *live* object, which then fails at its next call).
    def __deepcopy__(self, memo: dict) -> Any:
        memo[id(self.rag)] = self.rag
        for shared in (self._precomputer, self._last):
            if shared is not None:
                memo[id(shared)] = shared
        return super().__deepcopy__(memo)

    def __getstate__(self) -> Any:
        raise TypeError(
            f"{type(self).__name__} holds a loaded model and background threads and cannot be pickled; "
            "build one per process from its settings instead (LlamaIndex: to_dict()/from_dict(); "
            "LangChain: langchain_core.load.dumpd()/load())"
        )


class UsageTotals:
    """Thread-safe running totals of an LLM wrapper's generations (``WrapsKVRag.usage_totals``)."""

    FIELDS = (
        "calls",
        "calls_with_hit",
        "prompt_tokens",
        "cached_tokens",
        "recomputed_tokens",
        "completion_tokens",
        "chunks_hit",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(self.FIELDS, 0)

    def add(self, stats) -> None:
        with self._lock:
            n = self._n
            n["calls"] += 1
            n["calls_with_hit"] += stats.chunks_hit > 0
            n["prompt_tokens"] += stats.prompt_tokens
            n["cached_tokens"] += stats.cached_tokens
            n["recomputed_tokens"] += stats.recomputed_tokens
            n["completion_tokens"] += stats.new_tokens
            n["chunks_hit"] += stats.chunks_hit

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._n)
        out["cache_hit_rate"] = out["cached_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
        return out

    def reset(self) -> None:
        with self._lock:
            self._n = dict.fromkeys(self.FIELDS, 0)

    def __deepcopy__(self, memo: dict) -> "UsageTotals":
        new = UsageTotals()
        new._n = self.snapshot()
        del new._n["cache_hit_rate"]
        return new


def usage_counts(stats) -> dict[str, Any]:
    """One generation's token counts in the OpenAI ``usage`` form, which LlamaIndex's
    ``TokenCountingHandler`` reads from ``raw["usage"]`` (``prompt_tokens_details.cached_tokens``:
    prompt tokens served from the KV cache)."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def hook_target(owner: str, target: Any = None, **aliases: Any) -> Any:
    """The one target a hook was given: positionally or under a framework's conventional
    keyword (``llm=`` as LlamaIndex components and LangChain chains name the model,
    ``rag=``, ``precomputer=``). TypeError when none or more than one is given."""
    given = {k: v for k, v in aliases.items() if v is not None}
    if target is not None:
        given = {"target": target, **given}
    if len(given) != 1:
        what = "got none" if not given else f"got {len(given)}: {', '.join(given)}"
        raise TypeError(
            f"{owner} needs a target, one of: a kvrag LLM (positionally or llm=...), a KVRag (rag=...) "
            f"or a Precomputer (precomputer=...); {what}"
        )
    return next(iter(given.values()))


def schedule_retrieved(pc: Precomputer, texts: Iterable[str], defer_s: float) -> None:
    """Retriever-side scheduling of retrieved texts not cached yet: never blocks, never raises
    into the query. A full queue or a bad text is counted by the precomputer (dropped /
    rejected), and the text is tried again the next time it is retrieved."""
    for t in texts:
        try:
            pc.submit(t, block=False, defer_s=defer_s)
        except (QueueFullError, ChunkError, PrecomputerClosedError) as e:
            log.debug("kvrag retriever hook: not scheduled: %s", e)


def open_stream(rag, prompt, opts: dict[str, Any], foreground: Callable[[], AbstractContextManager]):
    """``rag.stream(prompt, **opts)`` inside ``foreground()``: the call itself tokenizes the
    prompt, finds its chunks and reads their K/V (so bad input fails here), which is query work
    background precompute must not compete with."""
    with foreground():
        return rag.stream(prompt, **opts)


async def aopen_stream(rag, prompt, opts: dict[str, Any], foreground: Callable[[], AbstractContextManager]):
    """``open_stream`` in a worker thread: its chunk reads must not block the event loop."""
    return await asyncio.to_thread(open_stream, rag, prompt, opts, foreground)


def foreground_steps(it: Iterator, foreground: Callable[[], AbstractContextManager]) -> Iterator:
    """Items of ``it``, each computed inside ``foreground()`` (the precomputer's "a query
    runs" flag): the query holds background precompute back only while the model computes a
    step, not while the stream waits for its consumer — a stream read slowly, or abandoned
    unfinished, must not stall ingestion."""
    while True:
        with foreground():
            item = next(it, END)
        if item is END:
            return
        yield item


class ThreadStepper:
    """Steps a sync generator in worker threads, one ``next`` at a time, and closes it safely.

    A cancelled ``await asyncio.to_thread(next, it)`` does not stop the thread: it is still
    inside ``next(it)``, and ``it.close()`` from the event loop then fails with "generator
    already executing" (replacing the CancelledError, and leaving the generator open). So
    ``close`` only marks it while a step runs; that step closes it when it returns."""

    def __init__(self, it: Iterator):
        self._it = it
        self._lock = threading.Lock()
        self._running = False
        self._closed = False

    def step(self):  # in a worker thread
        with self._lock:
            if self._closed:
                return END
            self._running = True
        try:
            return next(self._it, END)
        finally:
            with self._lock:
                self._running = False
                close = self._closed
            if close:
                self._it.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._running:
                return  # the running step closes it
        self._it.close()


async def arun_stream(stream: Iterator, foreground: Callable[[], AbstractContextManager]) -> None:
    """Run a kvrag ``Stream`` to its end from async code (``acomplete`` / ``ainvoke``), one step
    per worker-thread hop, inside ``foreground()`` all along (a whole answer holds background
    precompute back, as the sync call does). ``asyncio.to_thread(rag.generate, ...)`` could
    not be stopped: a cancelled request (a client that went away) went on decoding up to
    ``max_new_tokens`` in the background. Here cancellation raises CancelledError at once, the
    step in flight finishes and the stream is closed; the foreground ends with the call."""
    with foreground():
        async for _ in aiter_in_thread(stream):
            pass


async def aiter_in_thread(it: Iterator) -> AsyncIterator:
    """An async generator stepping a sync generator in a worker thread (one step per item).
    Cancelled mid-step, it raises CancelledError and ``it`` is closed once that step returns."""
    stepper = ThreadStepper(it)
    try:
        while True:
            item = await asyncio.to_thread(stepper.step)
            if item is END:
                return
            yield item
    finally:
        stepper.close()
