"""What a ``Precomputer`` tells its callers: a snapshot of its counters
(:class:`PrecomputeProgress`), the failures it keeps (:class:`PrecomputeFailure`), and the two
errors ``submit`` raises (:class:`QueueFullError`: back-pressure; :class:`PrecomputerClosedError`:
after ``shutdown``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrag.errors import ChunkError, KVRagError

__all__ = ["PrecomputeProgress", "PrecomputeFailure", "QueueFullError", "PrecomputerClosedError"]


class QueueFullError(KVRagError):
    """``submit`` could not queue a text: the queue holds ``max_queued`` texts (back-pressure)."""


class PrecomputerClosedError(KVRagError):
    """``submit`` after ``shutdown``: the precomputer takes no new work."""


@dataclass(frozen=True)
class PrecomputeProgress:
    """A snapshot of the precomputer's counters (all since it was created).

    submitted: texts accepted as new work; deduplicated: submissions merged into work already
    queued/in flight (same text) or computed in the same pass (same store key); queued: waiting;
    in_flight: taken by a worker, not finished; computed: chunks computed and stored;
    already_cached: found in the store (nothing computed); failed: finished with an error;
    rejected: submissions refused as invalid (empty, not a str, bad Unicode); dropped:
    submissions refused because the queue was full; tokens_computed: tokens prefilled;
    busy_s: worker time spent computing."""

    submitted: int = 0
    deduplicated: int = 0
    queued: int = 0
    in_flight: int = 0
    computed: int = 0
    already_cached: int = 0
    failed: int = 0
    rejected: int = 0
    dropped: int = 0
    tokens_computed: int = 0
    busy_s: float = 0.0

    @property
    def done(self) -> int:
        """Texts finished (computed, already cached or failed)."""
        return self.computed + self.already_cached + self.failed

    @property
    def idle(self) -> bool:
        return self.queued == 0 and self.in_flight == 0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "done": self.done, "idle": self.idle}


@dataclass(frozen=True)
class PrecomputeFailure:
    """One text whose precompute failed: the text (kept whole, so nothing is lost), its store
    key if tokenization got that far, the exception, and when (``time.time()``)."""

    text: str
    key: str | None
    error: BaseException
    when: float

    @property
    def retryable(self) -> bool:
        """False for errors the text itself causes (a ChunkError: too long for the model);
        True for the environment's (disk full, store unwritable, ...)."""
        return not isinstance(self.error, ChunkError)

    @property
    def message(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"
