"""Ingestion and retriever hooks that schedule kvrag's background KV precompute.

* :func:`precompute_on_add` / :class:`KVPrecomputeHook` — after a vector store's
  ``add_texts``, ``add_documents`` (and their async variants) or ``update_documents``, every
  stored text is handed to the precomputer, once (whichever of them calls which). The store
  object is patched in place (its class is untouched), so it stays what it was
  (``isinstance(store, Chroma)``), and ``detach`` undoes it. ``server="http://..."``: the
  texts go to a ``kvrag serve`` (``POST /v1/chunks``) instead of an in-process precomputer.
* :class:`KVWarmingRetriever` — wraps any retriever; every retrieved document whose KV is not
  cached yet (ingested before kvrag, or evicted) is scheduled, after the current query, so the
  next query that retrieves it hits the cache.

The text precomputed is ``document.page_content`` (``text_fn`` changes that): the chain must
put it in the prompt verbatim (e.g. ``"\\n\\n".join(d.page_content for d in docs)``), since
kvrag finds cached chunks by exact text.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from kvrag.frameworks import chunk_service, hook_target, precomputer_of, schedule_retrieved
from kvrag.precompute import Precomputer

__all__ = ["KVPrecomputeHook", "precompute_on_add", "KVWarmingRetriever"]

log = logging.getLogger("kvrag.langchain")

_ATTR = "_kvrag_precompute_hook"
#: Store methods the hook wraps: name -> (position of the items argument, its keyword name,
#: whether the items are Documents). Stores differ in which of them call which (Chroma's
#: ``add_documents`` goes through ``add_texts``, ``InMemoryVectorStore``'s ``add_texts``
#: through ``add_documents``), so each is wrapped, and a flag set by the outermost call keeps
#: the inner ones from scheduling again.
_ADD_METHODS = {
    "add_texts": (0, "texts", False),
    "aadd_texts": (0, "texts", False),
    "add_documents": (0, "documents", True),
    "aadd_documents": (0, "documents", True),
    "update_documents": (1, "documents", True),
}
#: True inside a hooked add: set per thread / asyncio task (LangChain's executor copies it).
_IN_ADD: ContextVar[bool] = ContextVar("kvrag_in_hooked_add", default=False)


@contextlib.contextmanager
def _outermost_add() -> Iterator[bool]:
    """Marks a hooked add as running; yields whether it is the outermost one."""
    outer = not _IN_ADD.get()
    token = _IN_ADD.set(True)
    try:
        yield outer
    finally:
        _IN_ADD.reset(token)


def _lister(vectorstore):
    """The store's Chroma-style ``get(limit=, offset=, include=)`` (TypeError if it has none)."""
    get = getattr(vectorstore, "get", None)
    if not callable(get):
        raise TypeError(
            f"cannot list the documents of a {type(vectorstore).__name__} (no Chroma-style get()): "
            "pass their texts to KVPrecomputeHook.schedule(texts), or wrap its retriever in KVWarmingRetriever"
        )
    return get


class KVPrecomputeHook:
    """Schedules precompute of the texts a vector store stores.

    target: a :class:`langchain_kvrag.ChatKVRag` (its precomputer), a ``KVRag`` or a
    ``Precomputer``; or ``server="http://host:8000"`` (+ ``api_key``): a ``kvrag serve`` whose
    ``/v1/chunks`` computes them. text_fn: page_content -> the text as the prompt will show it (default:
    unchanged). block: when the precompute queue is full, wait for room (back-pressure on
    ingestion) instead of dropping."""

    def __init__(
        self,
        target: Any = None,
        *,
        llm: Any = None,
        rag: Any = None,
        precomputer: Any = None,
        server: str | None = None,
        api_key: str | None = None,
        text_fn: Callable[[str], str] | None = None,
        block: bool = True,
    ):
        target = hook_target(
            "KVPrecomputeHook", target, llm=llm, rag=rag, precomputer=precomputer, server=server, api_key=api_key
        )
        chunk_service(target)  # a wrong target fails here, not at the first add_documents
        self.target = target
        self.text_fn = text_fn
        self.block = block

    @property
    def precomputer(self) -> Any:
        # Resolved at each use: a ChatKVRag's or KVRag's precomputer that was shut down is
        # replaced by a live one (an explicit Precomputer stays the caller's). With server=:
        # the ServerChunks client posting to that kvrag serve.
        return chunk_service(self.target)

    def _texts(self, texts: Sequence[str]) -> list[str]:
        return [self.text_fn(t) for t in texts] if self.text_fn is not None else list(texts)

    def schedule(self, texts: Sequence[str]) -> None:
        """Queue ``texts`` (after ``text_fn``); empty or invalid ones are logged and skipped."""
        self.precomputer.submit_many(self._texts(texts), block=self.block, skip_invalid=True, skip_full=True)

    async def aschedule(self, texts: Sequence[str]) -> None:
        """``schedule`` for async code: waiting for queue room never blocks the event loop."""
        await self.precomputer.asubmit_many(self._texts(texts), block=self.block, skip_invalid=True, skip_full=True)

    def backfill(self, vectorstore, *, page_size: int = 1000) -> int:
        """Schedule the texts ``vectorstore`` already holds (filled by ``Chroma.from_documents``,
        before the hook was attached, or by another process); returns how many were submitted.

        Reads a store with Chroma's ``get(limit=, offset=, include=["documents"])``
        (``langchain-chroma``); texts already cached are found by the worker and not computed
        again. Other stores: ``schedule(texts)`` with the texts, or a :class:`KVWarmingRetriever`
        (each document is precomputed after the first query that retrieves it)."""
        get = _lister(vectorstore)
        n, offset = 0, 0
        while True:
            page = get(limit=page_size, offset=offset, include=["documents"])
            texts = [t for t in (page.get("documents") or []) if t is not None]
            ids = page.get("ids") or []
            self.schedule(texts)
            n += len(texts)
            if len(ids) < page_size:
                return n
            offset += len(ids)

    def attach(self, vectorstore, *, backfill: bool = False):
        """Patch ``vectorstore`` (in place) and return it. Attaching twice replaces the hook.
        ``backfill``: also schedule what it already holds (:meth:`backfill`)."""
        if not hasattr(vectorstore, "add_texts"):
            raise TypeError(f"expected a LangChain VectorStore, got {type(vectorstore).__name__}")
        if backfill:
            _lister(vectorstore)  # a store that cannot be listed fails before it is patched
        self.detach(vectorstore)
        originals = {}
        for name, (pos, kw, docs) in _ADD_METHODS.items():
            method = getattr(vectorstore, name, None)
            if callable(method):
                originals[name] = method
                setattr(vectorstore, name, self._hooked(method, pos, kw, docs))
        setattr(vectorstore, _ATTR, (self, originals))
        if backfill:
            self.backfill(vectorstore)
        return vectorstore

    def _hooked(self, method, pos: int, kw: str, docs: bool):
        """``method`` wrapped: once it returns, the texts it was given are scheduled -- by the
        outermost hooked call only (Chroma's ``add_documents`` calls ``add_texts``,
        ``InMemoryVectorStore``'s ``add_texts`` calls ``add_documents``: each text once)."""
        hook = self

        def take(args, kwargs):
            # The items may be a one-shot iterable: read it once and hand the list on.
            args = list(args)
            if len(args) > pos:
                items = args[pos] = list(args[pos])
            elif kw in kwargs:
                items = kwargs[kw] = list(kwargs[kw])
            else:
                items = []
            texts = [d.page_content for d in items] if docs else items
            return args, kwargs, texts

        if inspect.iscoroutinefunction(method):

            @functools.wraps(method)
            async def hooked_async(*args, **kwargs):
                args, kwargs, texts = take(args, kwargs)
                with _outermost_add() as outer:
                    out = await method(*args, **kwargs)
                if outer:
                    await hook.aschedule(texts)  # only what the store accepted; off the event loop
                return out

            return hooked_async

        @functools.wraps(method)
        def hooked(*args, **kwargs):
            args, kwargs, texts = take(args, kwargs)
            with _outermost_add() as outer:
                out = method(*args, **kwargs)
            if outer:
                hook.schedule(texts)  # only what the store accepted
            return out

        return hooked

    @staticmethod
    def detach(vectorstore) -> None:
        """Remove a hook attached by :meth:`attach` (no-op if none)."""
        state = vectorstore.__dict__.get(_ATTR)
        if state is None:
            return
        _, originals = state
        for name in originals:
            vectorstore.__dict__.pop(name, None)  # back to the class's method
        del vectorstore.__dict__[_ATTR]


def precompute_on_add(
    vectorstore,
    target: Any = None,
    *,
    llm: Any = None,
    rag: Any = None,
    precomputer: Any = None,
    server: str | None = None,
    api_key: str | None = None,
    text_fn: Callable[[str], str] | None = None,
    block: bool = True,
    backfill: bool = False,
):
    """Make ``vectorstore.add_documents``/``add_texts`` (and async variants, and
    ``update_documents``) schedule the KV precompute of what they store; returns the store.

    ``store = precompute_on_add(Chroma(...), llm)`` with ``llm`` a :class:`ChatKVRag`.
    ``precompute_on_add(store, server="http://host:8000", api_key=...)`` posts them to a ``kvrag
    serve`` instead (the model answering through ``ChatOpenAI(base_url=...)``).
    ``backfill=True`` also schedules the documents the store already holds — for a store made
    by ``Chroma.from_documents(...)``, which adds its documents before any hook can be attached:
    ``precompute_on_add(Chroma.from_documents(docs, emb), llm, backfill=True)``."""
    hook = KVPrecomputeHook(
        target, llm=llm, rag=rag, precomputer=precomputer, server=server, api_key=api_key, text_fn=text_fn, block=block
    )
    return hook.attach(vectorstore, backfill=backfill)


class KVWarmingRetriever(BaseRetriever):
    """A retriever that returns what ``retriever`` returns and schedules the precompute of
    every retrieved document not cached yet — after the current query (``defer_s``: until the
    chat model's call ends, at most that many seconds), so it never delays it.

    ``KVWarmingRetriever(store.as_retriever(), llm)`` with ``llm`` a :class:`ChatKVRag`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever
    target: Any = Field(exclude=True)
    text_fn: Callable[[str], str] | None = Field(default=None, exclude=True)
    defer_s: float = Field(default=10.0, ge=0.0)

    def __init__(self, retriever: BaseRetriever | None = None, target: Any = None, **kwargs: Any):
        if retriever is not None:
            kwargs["retriever"] = retriever
        target = hook_target(
            "KVWarmingRetriever",
            target,
            llm=kwargs.pop("llm", None),
            rag=kwargs.pop("rag", None),
            precomputer=kwargs.pop("precomputer", None),
        )
        precomputer_of(target)  # a wrong target fails here
        # ``target`` is a pydantic field of this class; mypy reads only the base's __init__ signature.
        super().__init__(target=target, **kwargs)  # type: ignore[call-arg]

    @property
    def precomputer(self) -> Precomputer:
        return precomputer_of(self.target)  # live at each use, as KVPrecomputeHook's

    def _texts(self, docs: list[Document]) -> list[str]:
        texts = [d.page_content for d in docs]
        return [self.text_fn(t) for t in texts] if self.text_fn is not None else texts

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        docs = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()})
        schedule_retrieved(self.precomputer, self._texts(docs), self.defer_s)
        return docs

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        docs = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()})
        schedule_retrieved(self.precomputer, self._texts(docs), self.defer_s)
        return docs
