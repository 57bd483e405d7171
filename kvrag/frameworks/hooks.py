"""What the ingestion and retriever hooks of every framework share: finding their target and
scheduling retrieved texts for background precompute."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvrag.errors import ChunkError
from kvrag.precompute import Precomputer, PrecomputerClosedError, QueueFullError

log = logging.getLogger("kvrag.frameworks")


def hook_target(owner: str, target: Any = None, **aliases: Any) -> Any:
    """The one target a hook was given: positionally or under a framework's conventional
    keyword (``llm=`` as LlamaIndex components and LangChain chains name the model,
    ``rag=``, ``precomputer=``). TypeError when none or more than one is given."""
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


def schedule_retrieved(pc: Precomputer, texts: Iterable[str], defer_s: float) -> None:
    """Retriever-side scheduling of retrieved texts not cached yet: never blocks, never raises
    into the query. A full queue or a bad text is counted by the precomputer (dropped /
    rejected), and the text is tried again the next time it is retrieved."""
    for t in texts:
        try:
            pc.submit(t, block=False, defer_s=defer_s)
        except (QueueFullError, ChunkError, PrecomputerClosedError) as e:
            log.debug("kvrag retriever hook: not scheduled: %s", e)
