"""``ServerChunks``: sends chunk texts to a ``kvrag serve`` server (``POST /v1/chunks``).

What the ingestion hooks (LlamaIndex ``KVPrecompute(server=...)``, LangChain
``precompute_on_add(store, server=...)``) feed instead of an in-process ``Precomputer`` when the
model answers from a server: the same calls (``submit``, ``submit_many``, ``asubmit_many``,
``wait_until_idle``), over HTTP. The server computes the chunks in the background with the
library's own precomputer, so a pipeline that ingests locally and answers through an
OpenAI-compatible client gets hits on its first query (after ``wait_until_idle``, as in process).

The client of the server's chunks endpoint lives with the hooks, not in ``kvrag.serve``: the
integrations reach it without importing the server. It imports httpx only, and only when one is made
(no torch, no web framework).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable

from kvrag.errors import KVRagError

#: Texts per ``POST /v1/chunks`` (the server takes up to 4096).
BATCH = 256


class ServerChunksError(KVRagError):
    """The server refused or could not be reached (message says which)."""


class ServerChunks:
    """Chunk ingestion through a ``kvrag serve`` at ``server`` (``http://host:port``, with or
    without ``/v1``). api_key: the server's ``--api-key`` (default ``$KVRAG_API_KEY``, else
    none). Keys of the texts sent are remembered (up to ``remember`` of them) for
    ``wait_until_idle``."""

    def __init__(self, server: str, *, api_key: str | None = None, timeout: float = 60.0, remember: int = 100_000):
        import os

        import httpx

        if not isinstance(server, str) or not server.startswith(("http://", "https://")):
            raise ValueError(f"server must be an http(s):// URL of a kvrag serve, got {server!r}")
        base = server.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        key = api_key if api_key is not None else os.environ.get("KVRAG_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout)
        self._lock = threading.Lock()
        self._pending: dict[str, None] = {}  # keys sent and not yet seen stored (ordered)
        self._remember = remember
        self.counts = {"queued": 0, "stored": 0, "rejected": 0, "dropped": 0}

    def __repr__(self) -> str:
        return f"ServerChunks({self.base!r})"

    # ---- the Precomputer calls the hooks make ---------------------------------------------
    def submit_many(self, texts: Iterable[str], *, skip_invalid: bool = True, skip_full: bool = True, **_) -> list:
        """Send ``texts``; returns each one's store key (None if the server refused it). A text
        the server rejects (empty, ...) raises ServerChunksError unless ``skip_invalid``; one it
        dropped because its queue stayed full raises unless ``skip_full`` (then it is counted).
        Other ``Precomputer.submit_many`` options (block, timeout, defer_s) are the server's
        business and are accepted for compatibility."""
        if isinstance(texts, (str, bytes)):
            raise TypeError("submit_many takes an iterable of texts, not one text")
        texts = list(texts)
        keys: list[str | None] = []
        for i in range(0, len(texts), BATCH):
            for item in self._post(texts[i : i + BATCH]):
                status = str(item.get("status"))
                with self._lock:
                    self.counts[status] = self.counts.get(status, 0) + 1
                if status == "rejected" and not skip_invalid:
                    raise ServerChunksError(f"the server rejected a chunk: {item.get('error')}")
                if status == "dropped" and not skip_full:
                    raise ServerChunksError(f"the server's precompute queue is full: {item.get('error')}")
                key = item.get("key") if status in ("queued", "stored") else None
                if status == "queued" and key:
                    with self._lock:
                        self._pending[key] = None
                        while len(self._pending) > self._remember:
                            self._pending.pop(next(iter(self._pending)))
                keys.append(key)
        return keys

    def submit(self, text: str, **kwargs) -> str | None:
        return self.submit_many([text], **kwargs)[0]

    async def asubmit_many(self, texts: Iterable[str], **kwargs) -> list:
        """``submit_many`` off the event loop."""
        return await asyncio.to_thread(self.submit_many, list(texts), **kwargs)

    def wait_until_idle(self, timeout: float | None = None, poll_s: float = 0.1) -> bool:
        """Wait until every chunk sent (and queued) is stored on the server; False if
        ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                keys = list(self._pending)
            for key in keys:
                if self.is_stored(key):
                    with self._lock:
                        self._pending.pop(key, None)
                else:
                    break
            with self._lock:
                if not self._pending:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(poll_s)

    def is_stored(self, key: str) -> bool:
        r = self._http.get(f"/v1/chunks/{key}")
        self._check(r)
        return bool(r.json().get("stored"))

    def close(self) -> None:
        self._http.close()

    def _post(self, texts: list[str]) -> list[dict]:
        import httpx

        try:
            r = self._http.post("/v1/chunks", json={"texts": texts})
        except httpx.HTTPError as e:
            raise ServerChunksError(f"cannot reach the kvrag server at {self.base}: {e}") from None
        self._check(r)
        return r.json()["data"]

    def _check(self, r) -> None:
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - an error body of any shape: its text stands in
                msg = r.text[:200]
            raise ServerChunksError(f"kvrag server {self.base} answered {r.status_code}: {msg}")
