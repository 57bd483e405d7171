"""kvrag: precomputed per-chunk KV caches, fused at query time, to cut RAG time-to-first-token.

The public API::

    from kvrag import KVRag, Precomputer
    rag = KVRag(cache_dir=".kvrag", policy="cacheblend")

Names are loaded on first use (PEP 562), so ``import kvrag`` -- and ``kvrag --version`` --
does not import torch or a model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "KVRag": "kvrag.engine",
    "Generation": "kvrag.engine",
    "Prefill": "kvrag.engine",
    "Stream": "kvrag.engine",
    "Precomputer": "kvrag.precompute",
    "PrecomputeProgress": "kvrag.precompute",
    "PrecomputeFailure": "kvrag.precompute",
    "QueueFullError": "kvrag.precompute",
    "PrecomputerClosedError": "kvrag.precompute",
    "FusionStats": "kvrag.layout.state",
    "KVRagError": "kvrag.errors",
    "ModelLoadError": "kvrag.errors",
    "ChunkError": "kvrag.errors",
    "StoreError": "kvrag.errors",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from kvrag.engine import Generation, KVRag, Prefill, Stream
    from kvrag.errors import ChunkError, KVRagError, ModelLoadError, StoreError
    from kvrag.layout.state import FusionStats
    from kvrag.precompute import (
        PrecomputeFailure,
        PrecomputeProgress,
        Precomputer,
        PrecomputerClosedError,
        QueueFullError,
    )


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvrag' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
