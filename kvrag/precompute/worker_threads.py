"""What the in-process precomputer's worker threads need from the process: their own torch
intra-op thread count (:func:`set_worker_threads`), and an interpreter-exit hook that finishes
their work before the daemon threads die (:func:`register_exit`, :func:`unregister_exit`).

PyTorch's intra-op thread count is process-global by default. With ``num_threads=n`` a worker
thread sets *its own* OpenMP thread count to ``n`` and the thread that started it restores the
global default at once, so the caller's threads keep theirs."""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable

__all__ = ["set_worker_threads", "register_exit", "unregister_exit"]


def set_worker_threads(n: int) -> None:
    """Give the calling (worker) thread ``n`` intra-op threads (half of a two-step dance).

    ``torch.set_num_threads`` sets the calling thread's OpenMP thread count *and* the global
    default that threads created later start with. Restoring the default from this same thread
    would undo both, so the thread that created the precomputer restores it (see
    ``Precomputer.start``): with OpenMP builds the worker keeps ``n`` and everyone else keeps
    theirs; with a native thread pool the setting is global and the restore makes this a
    no-op — never a silent global change."""
    import torch

    # First let torch do its lazy per-thread init (it copies the global default into this
    # thread once); done later, it would overwrite our setting with the restored default.
    torch.get_num_threads()
    torch.set_num_threads(n)


def register_exit(on_exit: Callable[[], None]) -> Callable[[], None]:
    """Run the bound method ``on_exit`` at interpreter exit, if its object is still alive then;
    returns the hook, for :func:`unregister_exit`."""
    # Held weakly: running workers keep their precomputer alive; an idle, dropped one needs nothing.
    ref = weakref.WeakMethod(on_exit)

    def at_exit() -> None:
        fn = ref()
        if fn is not None:
            fn()

    atexit.register(at_exit)
    return at_exit


def unregister_exit(fn: Callable[[], None] | None) -> None:
    if fn is not None:
        atexit.unregister(fn)
