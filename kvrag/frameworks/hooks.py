"""What the ingestion and retriever hooks of every framework share: the one home of a hook's
target (which one it was given, and what it submits chunk texts to), and scheduling retrieved
texts for background precompute.

A target is a kvrag LLM adapter (its ``precomputer``), a ``KVRag`` (its shared precomputer), a
``Precomputer``, or, for the ingestion hooks, ``server=`` a ``kvrag serve`` URL (a
``ServerChunks`` client: httpx, loaded only then)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvrag.errors import ChunkError
from kvrag.frameworks.server_chunks import ServerChunks
from kvrag.precompute import Precomputer, PrecomputerClosedError, QueueFullError

log = logging.getLogger("kvrag.frameworks")


def hook_target(
    owner: str, target: Any = None, *, server: str | None = None, api_key: str | None = None, **aliases: Any
) -> Any:
    """The one target a hook was given: positionally or under a framework's conventional
    keyword (``llm=`` as LlamaIndex components and LangChain chains name the model,
    ``rag=``, ``precomputer=``), or ``server=`` (+ ``api_key=``): a ``ServerChunks`` posting to
    that ``kvrag serve`` (the ingestion hooks' server mode). TypeError when none or more than
    one is given, or ``api_key=`` without ``server=``."""
    if server is not None:
        if target is not None or any(v is not None for v in aliases.values()):
            raise TypeError(f"{owner}: give server= or an in-process target (llm=, rag=, precomputer=), not both")
        return ServerChunks(server, api_key=api_key)
    if api_key is not None:
        raise TypeError(f"{owner}: api_key= goes with server=")
    given = {k: v for k, v in aliases.items() if v is not None}
    if target is not None:
        given = {"target": target, **given}
    if len(given) != 1:
        what = "got none" if not given else f"got {len(given)}: {', '.join(given)}"
        raise TypeError(
            f"{owner} needs a target, one of: a kvrag LLM (positionally or llm=...), a KVRag (rag=...) "
            f"or a Precomputer (precomputer=...); {what}"
        )
    return next(iter(given.values()))


def precomputer_of(target: Any) -> Precomputer:
    """The in-process precomputer of a hook's target: a Precomputer as is, an LLM adapter's
    ``precomputer``, a KVRag's shared one (``Precomputer.for_rag``). Hooks resolve it at each
    use, so a shut-down precomputer of a KVRag is replaced by a live one. TypeError otherwise
    (a ``ServerChunks`` too: a retriever hook never posts over HTTP inside a query)."""
    if isinstance(target, Precomputer):
        return target
    pc = getattr(target, "precomputer", None)
    if isinstance(pc, Precomputer):
        return pc
    from kvrag.engine import KVRag  # the facade, a layer down (loaded already once a KVRag exists)

    if isinstance(target, KVRag):
        return Precomputer.for_rag(target)
    raise TypeError(f"expected a Precomputer, a KVRag or a kvrag LLM adapter, got {type(target).__name__}")


def chunk_service(target: Any) -> Precomputer | ServerChunks:
    """What an ingestion hook submits chunk texts to: a ``ServerChunks`` as is, else
    ``precomputer_of(target)``."""
    return target if isinstance(target, ServerChunks) else precomputer_of(target)


def schedule_retrieved(pc: Precomputer, texts: Iterable[str], defer_s: float) -> None:
    """Retriever-side scheduling of retrieved texts not cached yet: never blocks, never raises
    into the query. A full queue or a bad text is counted by the precomputer (dropped /
    rejected), and the text is tried again the next time it is retrieved."""
    for t in texts:
        try:
            pc.submit(t, block=False, defer_s=defer_s)
        except (QueueFullError, ChunkError, PrecomputerClosedError) as e:
            log.debug("kvrag retriever hook: not scheduled: %s", e)
