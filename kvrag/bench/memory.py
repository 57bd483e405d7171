"""Measuring memory: the process's peak resident set (or the device's peak allocation) over a
block, and bytes on disk under a directory."""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger("kvrag.bench")

log = logging.getLogger("kvrag.bench")


def rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class PeakMemory:
    """Peak memory during a ``with`` block: process RSS sampled by a thread (CPU; torch ops
    release the GIL so sampling runs during them), or ``torch.cuda.max_memory_allocated``."""

    def __init__(self, device: str, interval_s: float = 0.005):
        self.cuda = device.startswith("cuda")
        self.interval = interval_s
        self.peak = self.base = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = self.peak = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())
        elif self._thread is not None:  # None: __exit__ without __enter__, nothing was sampled
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss_bytes())

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of all files under ``path`` (blobs + index)."""
    total = 0
    for root, _, files in os.walk(os.fspath(path)):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total
