"""``Outage``: the breaker in front of a server that may go away (the shared tier's Redis).

While the server fails, commands are not even tried for ``retry_s`` after each failure (a dead
server must not cost every chunk read a connect timeout), and the outage is said once when it
starts and once when it ends. One ``Outage`` is shared by everything that talks to the same
server (the store and the precompute queues on its connection), so they warn and back off
together. It knows nothing of Redis: callers tell it ``failed(e)`` and ``ok()``.
"""

from __future__ import annotations

import logging
import threading
import time


class Outage:
    """One warning per outage of a server, and a pause before retrying it.

    what: the server as messages name it (its URL redacted). retry_s: seconds after a failure
    during which ``skip`` is True. log: where the two warnings go (the caller's logger, so an
    outage is reported under the name of the tier it hits)."""

    def __init__(self, what: str, retry_s: float, log: logging.Logger | None = None) -> None:
        self.what = what
        self.retry_s = retry_s
        self.log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._on_recover: list = []

    def on_recover(self, fn) -> None:
        """Call ``fn()`` each time the server answers again after an outage (in the thread of
        the command that found it back: ``fn`` must only schedule work)."""
        self._on_recover.append(fn)

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def skip(self) -> bool:
        """True while the server failed less than ``retry_s`` ago (don't even try)."""
        return self._down_since is not None and time.monotonic() < self._retry_at

    def failed(self, e: BaseException) -> None:
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
            self._retry_at = time.monotonic() + self.retry_s
        if first:
            self.log.warning(
                "%s is unreachable (%s: %s): serving from the local tiers and computing what "
                "they lack; retrying every %g s, said once per outage",
                self.what,
                type(e).__name__,
                e,
                self.retry_s,
            )

    def ok(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            self.log.warning("%s is reachable again (down %.1f s)", self.what, time.monotonic() - since)
            for fn in self._on_recover:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - a listener must not fail the command that reconnected
                    self.log.warning("%s: a reconnect listener failed: %s", self.what, e)
