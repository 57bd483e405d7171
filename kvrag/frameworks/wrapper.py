"""``WrapsKVRag``: the mixin of the framework LLM classes (LlamaIndex, LangChain): what they
expose of the ``KVRag`` they wrap -- its precomputer, the latest generation, running usage
totals -- and how they copy (sharing the KVRag) and refuse pickling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvrag.frameworks.streaming import foreground
from kvrag.frameworks.usage import UsageTotals
from kvrag.precompute import Precomputer


class WrapsKVRag:
    """Mixin of the framework LLM classes: what they expose of the ``KVRag`` they wrap, alike
    in every framework. The class provides ``rag`` (the KVRag), the private attributes
    ``_precomputer`` (None until first used) and ``_last`` (the latest ``Generation``), and
    ``_precompute_options()`` (keyword arguments of ``Precomputer.for_rag``)."""

    # Provided by the framework class that mixes this in. Declared for type checkers only: at
    # run time an annotation here would become a pydantic field of the framework class.
    if TYPE_CHECKING:
        rag: Any
        _precomputer: Precomputer | None
        _last: Any
        _usage: UsageTotals

    def _precompute_options(self) -> dict[str, Any]:
        return {}

    @property
    def precomputer(self) -> Precomputer:
        """The background precomputer the ingestion/retriever hooks feed (shared per KVRag)."""
        pc = self._precomputer
        if pc is None or pc.closed:
            pc = self._precomputer = Precomputer.for_rag(self.rag, **self._precompute_options())
        return pc

    @property
    def last_stats(self):
        """``FusionStats`` of the most recent generation (None before the first)."""
        return None if self._last is None else self._last.stats

    @property
    def last_generation(self):
        """The most recent ``kvrag.engine.Generation`` (text, token ids, prompt ids, stats)."""
        return self._last

    def _foreground(self):
        """Tell the shared precomputer (if any) that a query runs: no new pack starts."""
        return foreground(self._precomputer, self.rag)

    def _record(self, gen) -> None:
        """After each generation: the latest one, and the running totals."""
        self._last = gen
        self._usage.add(gen.stats)

    @property
    def usage_totals(self) -> dict[str, Any]:
        """Running totals over every generation of this object: calls, prompt / cached /
        recomputed / completion tokens, chunks served from the cache, calls that hit, and
        ``cache_hit_rate`` (cached / prompt tokens). ``reset_usage()`` zeroes them."""
        return self._usage.snapshot()

    def reset_usage(self) -> None:
        self._usage.reset()

    # A wrapper holds a loaded model, its store and background threads: a copy shares them
    # (a second model in memory is never what a framework's copy means), and pickling is
    # refused rather than half-done (LlamaIndex's default drops what it cannot pickle from
    # the *live* object, which then fails at its next call).
    def __deepcopy__(self, memo: dict) -> Any:
        memo[id(self.rag)] = self.rag
        for shared in (self._precomputer, self._last):
            if shared is not None:
                memo[id(shared)] = shared
        # The framework base class mixed in after this one (pydantic's BaseModel) defines it.
        return super().__deepcopy__(memo)  # type: ignore[misc]

    def __getstate__(self) -> Any:
        raise TypeError(
            f"{type(self).__name__} holds a loaded model and background threads and cannot be pickled; "
            "build one per process from its settings instead (LlamaIndex: to_dict()/from_dict(); "
            "LangChain: langchain_core.load.dumpd()/load())"
        )
