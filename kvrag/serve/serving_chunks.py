"""``POST /v1/chunks`` and ``GET /v1/chunks/{key}``: chunks over HTTP.

Texts in, their keys out, each computed by the library's background precomputer (the one the
in-process ingestion hooks feed: ``Precomputer.for_rag``, unless the server was given its
own), so a framework hook with ``server=`` ingests exactly as one in the server's process."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from kvrag.serve.metrics import ServeMetrics
from kvrag.serve.protocol import APIError, ChunksRequest

_KEY = re.compile(r"[0-9a-f]{64}")
#: Seconds a text waits for room in the precompute queue before it is "dropped".
_QUEUE_WAIT_S = 30


class ChunksServing:
    """The chunk endpoints of a server over ``rag``. precomputer: the ``Precomputer`` texts
    go to (None: the KVRag's shared one); ``limit_chars``: the longest text read (a longer
    one is refused unread, as a prompt of that size is)."""

    def __init__(self, rag, metrics: ServeMetrics, *, precomputer=None, limit_chars: int):
        self.rag, self.metrics, self._precomputer, self.limit_chars = rag, metrics, precomputer, limit_chars

    async def add(self, body: ChunksRequest) -> dict:
        self.metrics.chunks_submitted.inc(len(body.texts))
        data = await asyncio.to_thread(self.submit, self.precomputer(), body.texts)
        return {"object": "list", "data": data}

    async def status(self, key: str) -> dict:
        if not _KEY.fullmatch(key):
            raise APIError(400, f"not a chunk key (64 lowercase hex digits): {key[:80]!r}", param="key")
        stored = await asyncio.to_thread(self.rag.store.__contains__, key)
        return {"key": key, "stored": bool(stored)}

    def precomputer(self):
        from kvrag.precompute import Precomputer

        return self._precomputer if self._precomputer is not None else Precomputer.for_rag(self.rag)

    def submit(self, pc, texts: list[str]) -> list[dict]:
        """Each text's key and what ``pc`` (a ``Precomputer``) did with it: "stored" (cached already), "queued" (the
        background precomputer computes it), "rejected" (never cacheable: empty, ...),
        "dropped" (the precompute queue stayed full: send it again later)."""
        from kvrag.errors import ChunkError
        from kvrag.precompute import QueueFullError

        rag = self.rag
        out = []
        for i, text in enumerate(texts):
            item: dict[str, Any] = {"index": i}
            if len(text) > self.limit_chars:  # refused unread, as a prompt of that size is
                out.append({**item, "key": None, "status": "rejected", "error": f"{len(text):,} characters: too long"})
                continue
            try:
                item["key"] = rag.chunk_key(text)
            except (ChunkError, ValueError) as e:
                out.append({**item, "key": None, "status": "rejected", "error": str(e)})
                continue
            if item["key"] in rag.store:
                out.append({**item, "status": "stored"})
                continue
            try:
                # Waiting a while for queue room is the back-pressure the in-process hooks apply too.
                pc.submit(text, block=True, timeout=_QUEUE_WAIT_S)
                item["status"] = "queued"
            except ChunkError as e:
                item.update(status="rejected", error=str(e))
            except QueueFullError as e:
                item.update(status="dropped", error=str(e))
            out.append(item)
        return out
