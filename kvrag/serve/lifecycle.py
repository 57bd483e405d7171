"""Where a ``kvrag serve`` process is in its life, for its readiness probe and its drain.

``starting`` (the port is open, the server is warming up: ``/ready`` answers 503), ``ready``
(serving), ``draining`` (SIGTERM came: new requests get 503, the ones in flight run to their
end until the drain deadline, then end with an error event). ``/health`` is liveness only and
answers 200 in every state: a draining server is alive, just not to be sent traffic.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Literal

log = logging.getLogger("kvrag.serve")

State = Literal["starting", "ready", "draining"]


class Lifecycle:
    """The server's state (``state``), shared by the app (probe, admission) and the process
    that runs it (start-up, drain)."""

    def __init__(self, state: State = "ready"):
        self._state: State = state
        self._lock = threading.Lock()
        self._inflight = 0

    @property
    def state(self) -> State:
        return self._state

    @property
    def ready(self) -> bool:
        return self._state == "ready"

    @property
    def draining(self) -> bool:
        return self._state == "draining"

    def mark_ready(self) -> None:
        """Start-up done (a drain already begun stays a drain)."""
        with self._lock:
            if self._state == "starting":
                self._state = "ready"

    def enter(self) -> None:
        """A request of the API began (the admission middleware's count)."""
        with self._lock:
            self._inflight += 1

    def leave(self) -> None:
        """It ended: its whole response (a stream's last chunk too) is sent."""
        with self._lock:
            self._inflight -= 1

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def drain(self, scheduler, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Stop admitting, wait up to ``timeout_s`` seconds for the requests in flight to be
        answered, then close ``scheduler`` (the requests still running end as cancelled: a
        stream with an error event, a whole response with a 503). True when every request
        was answered in time."""
        with self._lock:
            self._state = "draining"
        deadline = time.monotonic() + timeout_s
        while self.inflight:
            if time.monotonic() >= deadline:
                log.warning(
                    "kvrag serve: drain deadline (%.0f s) passed with %d request(s) in flight: ending them",
                    timeout_s,
                    self.inflight,
                )
                scheduler.close()
                return False
            time.sleep(poll_s)
        return True
