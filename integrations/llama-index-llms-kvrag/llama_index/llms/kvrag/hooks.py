"""The ingestion and retriever hooks that schedule kvrag's background KV precompute, for
LlamaIndex.

* :class:`KVPrecompute` — a ``TransformComponent`` for ``IngestionPipeline`` (or
  ``VectorStoreIndex(..., transformations=[...])``) that schedules the background precompute of
  every node's text exactly as the query engine will put it in the prompt
  (``node.get_content(MetadataMode.LLM)``), and passes the nodes on unchanged.
* :class:`KVCacheWarmer` (node postprocessor) / :class:`KVWarmingRetriever` (retriever
  wrapper) — the retriever-side hook: every retrieved node whose KV is not cached yet
  (ingested before kvrag was installed, or evicted) is scheduled for precompute, after the
  current query, so the next query that retrieves it hits the cache.

Each takes a :class:`~llama_index.llms.kvrag.KVRagLLM` (or a ``KVRag`` / ``Precomputer``) and
shares its one :class:`kvrag.precompute.Precomputer`, so ingestion and queries do not compete
with two workers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, Document, MetadataMode, NodeWithScore, QueryBundle, TransformComponent

from kvrag.frameworks import chunk_service, hook_target, precomputer_of, schedule_retrieved
from kvrag.precompute import Precomputer

__all__ = ["KVPrecompute", "KVCacheWarmer", "KVWarmingRetriever", "node_texts"]

log = logging.getLogger("kvrag.llama_index")


# ---- which text a node contributes to the prompt ---------------------------------------------
def node_texts(
    nodes: Sequence[BaseNode], metadata_mode: MetadataMode = MetadataMode.LLM, strip: bool = True
) -> tuple[list[str], int]:
    """The chunk texts of ``nodes`` as a response synthesizer puts them in the prompt:
    ``node.get_content(metadata_mode)`` (``MetadataMode.LLM``: the metadata the LLM sees, in
    the node's own template), ``strip()``ped as the compact/tree_summarize/refine modes do
    before joining. One form per node is enough: a prompt that holds the text unstripped
    contains the stripped one, which is served from its cache there too (the edge tokens the
    whitespace merges with are computed), so precomputing both would double the ingest work
    for one token. ``strip=False`` keeps the text as rendered.
    Returns (texts, number of nodes skipped because they have no text)."""
    out: list[str] = []
    skipped = 0
    for node in nodes:
        text = node.get_content(metadata_mode=metadata_mode)
        if not isinstance(text, str) or not text.strip():
            skipped += 1
            continue
        out.append(text.strip() if strip else text)
    return out, skipped


class _Unpicklable:
    def __getstate__(self):
        raise TypeError(
            f"{type(self).__name__} holds a live background precomputer (threads) and cannot be sent to "
            "another process: run IngestionPipeline with num_workers=None (the default), or add kvrag's "
            "hook in the parent process"
        )

    def __deepcopy__(self: Any, memo: dict[int, Any] | None = None) -> Any:  # self: a pydantic hook model
        # A copy of a hook feeds the same service (a deep copy of a thread pool makes no sense).
        new = self.model_copy()
        new._target = self._target
        return new


class KVPrecompute(_Unpicklable, TransformComponent):
    """IngestionPipeline transform: schedule the KV precompute of every node, pass nodes on.

    ``KVPrecompute(llm)`` with a :class:`KVRagLLM` (or a ``KVRag`` / ``Precomputer``), or
    ``KVPrecompute(server="http://host:8000", api_key=...)`` when the model answers from a
    ``kvrag serve`` (through ``OpenAILike``): the nodes are posted to its ``/v1/chunks`` and
    computed there in the background (``.precomputer.wait_until_idle()`` waits). Put it
    *after* the node parser and metadata extractors: it must see each node's final text and
    metadata, as the query engine will render them. Returns at once (the work happens in the
    background; ``llm.precomputer.wait_until_idle()`` waits for it). Nodes without text are
    skipped (logged); a node too long for the model fails in the background (logged, counted
    in ``precomputer.progress().failed``) and is answered by plain prefill."""

    metadata_mode: MetadataMode = Field(default=MetadataMode.LLM, description="How node text is rendered for the LLM.")
    strip: bool = Field(
        default=True,
        description="Precompute text.strip(), the form the response modes render "
        "(see node_texts); False: the text as rendered.",
    )
    block: bool = Field(default=True, description="Wait for room when the precompute queue is full.")

    _target: Any = PrivateAttr(default=None)
    _warned: bool = PrivateAttr(default=False)

    def __init__(
        self,
        target: Any = None,
        *,
        llm: Any = None,
        rag: Any = None,
        precomputer: Any = None,
        server: str | None = None,
        api_key: str | None = None,
        **data: Any,
    ) -> None:
        target = hook_target(
            "KVPrecompute", target, llm=llm, rag=rag, precomputer=precomputer, server=server, api_key=api_key
        )
        super().__init__(**data)
        chunk_service(target)  # a wrong target fails here, not at the first node
        self._target = target

    @classmethod
    def class_name(cls) -> str:
        return "KVPrecompute"

    @property
    def precomputer(self) -> Any:
        # Resolved at each use: an LLM's or KVRag's precomputer that was shut down is replaced
        # by a live one (an explicit Precomputer stays the caller's). With server=: the
        # ServerChunks client that posts the nodes to that kvrag serve.
        return chunk_service(self._target)

    def _texts(self, nodes: Sequence[BaseNode]) -> list[str]:
        if not self._warned and any(isinstance(n, Document) for n in nodes):
            self._warned = True
            log.warning(
                "KVPrecompute received Document objects: place it after the node parser "
                "(e.g. SentenceSplitter) so it precomputes the chunks the retriever returns"
            )
        texts, skipped = node_texts(nodes, self.metadata_mode, self.strip)
        if skipped:
            log.warning("KVPrecompute: skipped %d node(s) without text", skipped)
        return texts

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        self.precomputer.submit_many(self._texts(nodes), block=self.block, skip_invalid=True, skip_full=True)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        # LlamaIndex's default acall runs __call__ on the event loop, where waiting for queue
        # room (block=True) would stall every other request on the loop.
        await self.precomputer.asubmit_many(self._texts(nodes), block=self.block, skip_invalid=True, skip_full=True)
        return nodes


class KVCacheWarmer(_Unpicklable, BaseNodePostprocessor):
    """Node postprocessor: schedule the precompute of every retrieved node not cached yet.

    ``index.as_query_engine(llm=llm, node_postprocessors=[KVCacheWarmer(llm)])``. The work
    waits for the current query (``defer_s``: until its LLM call ends, at most that many
    seconds) — it never delays it — and is deduplicated and skipped for nodes already cached,
    so the next query that retrieves these nodes hits the cache. Nodes are returned as is."""

    metadata_mode: MetadataMode = Field(default=MetadataMode.LLM)
    strip: bool = Field(default=True, description="as KVPrecompute.strip")
    defer_s: float = Field(default=10.0, ge=0.0, description="Hold the scheduled work while the query finishes.")

    _target: Any = PrivateAttr(default=None)

    def __init__(
        self, target: Any = None, *, llm: Any = None, rag: Any = None, precomputer: Any = None, **data: Any
    ) -> None:
        target = hook_target("KVCacheWarmer", target, llm=llm, rag=rag, precomputer=precomputer)
        super().__init__(**data)
        precomputer_of(target)
        self._target = target

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheWarmer"

    @property
    def precomputer(self) -> Precomputer:
        return precomputer_of(self._target)  # live at each use, as KVPrecompute's

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        texts, _ = node_texts([n.node for n in nodes], self.metadata_mode, self.strip)
        schedule_retrieved(self.precomputer, texts, self.defer_s)
        return nodes


class KVWarmingRetriever(BaseRetriever):
    """Retriever wrapper with the same effect as :class:`KVCacheWarmer`, for code that takes a
    retriever (``RetrieverQueryEngine.from_args(KVWarmingRetriever(index.as_retriever(), llm), llm=llm)``)."""

    def __init__(
        self,
        retriever: BaseRetriever,
        target: Any = None,
        *,
        llm: Any = None,
        rag: Any = None,
        precomputer: Any = None,
        metadata_mode: MetadataMode = MetadataMode.LLM,
        strip: bool = True,
        defer_s: float = 10.0,
    ) -> None:
        target = hook_target("KVWarmingRetriever", target, llm=llm, rag=rag, precomputer=precomputer)
        if not isinstance(retriever, BaseRetriever):
            raise TypeError(f"retriever must be a LlamaIndex BaseRetriever, got {type(retriever).__name__}")
        super().__init__(callback_manager=retriever.callback_manager)
        self._retriever = retriever
        self._warmer = KVCacheWarmer(target, metadata_mode=metadata_mode, strip=strip, defer_s=defer_s)

    @property
    def precomputer(self) -> Precomputer:
        return self._warmer.precomputer

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = self._retriever.retrieve(query_bundle)
        return self._warmer.postprocess_nodes(nodes, query_bundle)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = await self._retriever.aretrieve(query_bundle)
        return self._warmer.postprocess_nodes(nodes, query_bundle)
