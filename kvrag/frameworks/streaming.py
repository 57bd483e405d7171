"""Stepping a kvrag stream with queries in the foreground of the background precomputer, from
threads and from async code."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from kvrag.precompute import Precomputer

T = TypeVar("T")

#: Returned by a step when the stream is over.
END = object()


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
                self._close_it()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._running:
                return  # the running step closes it
        self._close_it()

    def _close_it(self) -> None:
        # A generator runs its cleanup (the stream's ``finally``) on close; a plain iterator has none.
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


async def arun_stream(stream: Generator, foreground: Callable[[], AbstractContextManager]) -> None:
    """Run a kvrag ``Stream`` to its end from async code (``acomplete`` / ``ainvoke``), one step
    per worker-thread hop, inside ``foreground()`` all along (a whole answer holds background
    precompute back, as the sync call does). ``asyncio.to_thread(rag.generate, ...)`` could
    not be stopped: a cancelled request (a client that went away) went on decoding up to
    ``max_new_tokens`` in the background. Here cancellation raises CancelledError at once, the
    step in flight finishes and the stream is closed; the foreground ends with the call."""
    with foreground():
        async for _ in aiter_in_thread(stream):
            pass


async def aiter_in_thread(it: Iterator[T]) -> AsyncGenerator[T, None]:
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
