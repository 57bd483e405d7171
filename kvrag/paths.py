"""The kvrag home: the one directory kvrag keeps its own files under when no other is given.

It holds ``store/`` (the default KV store), ``models/`` (GGUF conversions), ``digests.json``
(memoized weight digests), ``a2ats/`` (codebooks) and ``kvlink/`` (adapters). Torch-free, so
the command line can name it before any model loads."""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    """kvrag's cache root: ``$KVRAG_HOME``, else the platform's user cache directory
    (``platformdirs``: ``$XDG_CACHE_HOME/kvrag``, i.e. ``~/.cache/kvrag`` on Linux;
    ``~/Library/Caches/kvrag`` on macOS; ``%LOCALAPPDATA%\\kvrag\\Cache`` on Windows)."""
    import platformdirs

    return Path(os.environ.get("KVRAG_HOME") or platformdirs.user_cache_dir("kvrag", appauthor=False))


def default_store_dir() -> Path:
    """Where ``KVRag`` keeps its KV store when no ``cache_dir`` is given."""
    return default_home() / "store"
