"""Shared by the integration tests: cancelling an async stream while a step of it runs."""

import asyncio
import threading
import time
import weakref


class GatedStream:
    """A KVRag stream whose second step blocks (in the worker thread) until ``release``."""

    def __init__(self, inner, entered: threading.Event, release: threading.Event):
        self.inner, self.entered, self.release, self.calls = inner, entered, release, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            self.release.wait(30)
        return next(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def cancel_mid_step(rag, monkeypatch, open_stream, precomputer) -> None:
    """Consume ``open_stream()`` (an awaitable giving an async iterator of the adapter) in a
    task, cancel it while the stream's second step runs in the worker thread, and assert what
    a client disconnecting there must see: CancelledError (not "generator already
    executing"), then the stream closed as soon as that step returns (not left to garbage
    collection) and the query out of the precomputer's foreground."""
    entered, release = threading.Event(), threading.Event()
    streams = []
    real_stream = rag.stream

    def gated(*a, **k):
        streams.append(GatedStream(real_stream(*a, **k), entered, release))
        return streams[-1]

    monkeypatch.setattr(rag, "stream", gated)

    async def run():
        async def consume():
            async for _ in await open_stream():
                pass

        task = asyncio.create_task(consume())
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError as e:
            kept.append(e)  # as a server logging it would: its traceback holds the stream's frames
            return "cancelled"
        except BaseException as e:  # noqa: BLE001 - the failure being tested
            return f"{type(e).__name__}: {e}"
        return "finished"

    kept = []
    # Not asyncio.run: closing its loop waits for the worker thread, which the gate holds until
    # ``release`` -- set only once the cancellation has been seen -- (30 s of nothing per test).
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(run()) == "cancelled"
        ref = weakref.ref(streams[0])
        del streams[:]
        release.set()
        loop.run_until_complete(loop.shutdown_default_executor())  # the step returns; the loop still runs
    finally:
        loop.close()
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:  # closed (and dropped) by the worker
        time.sleep(0.01)
    assert ref() is None and precomputer._foreground == 0
