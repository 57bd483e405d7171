"""What a caller of the server's scheduler holds and reads: a ``Ticket`` per submitted request
(choice), the ``Delta``\\ s of its reply as they are decoded, and its ``Finished`` record.

Written by the scheduler's worker thread, read from any thread or event loop
(``kvrag.serve.scheduler``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from kvrag.layout.state import FusionStats
from kvrag.serve.logprobs import TokenLogprob


class _Queue(Protocol):
    """What a ticket asks of its scheduler: to drop a cancelled choice that still waits."""

    def _cancel_waiting(self, ticket: Ticket) -> None: ...


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


class Ticket:
    """A submitted request: text deltas as they are decoded, then its ``Finished``.

    Iterating it (sync or async) gives the text deltas; ``deltas`` / ``adeltas`` give them as
    ``Delta``\\ s, with their tokens' log-probabilities. Every iterator replays the deltas from
    the first, so a ticket may be read more than once; iteration raises the request's error
    after the deltas it produced."""

    def __init__(self, scheduler: _Queue, req: Any, index: int = 0):
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
            yield from chunk
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
