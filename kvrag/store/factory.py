"""Building stores: the one place that turns a directory and a shared-tier setting into the
``ChunkStore`` kvrag reads and writes (the engine, the framework adapters and every ``kvrag``
command open their stores here).

``open_store(cache_dir, shared=...)``: a ``DiskStore`` in ``cache_dir`` (default: the kvrag
home's ``store/``), behind a ``TieredStore`` when a shared tier is given. ``open_shared(url)``:
the shared tier alone (a ``RedisStore``; redis is imported only then)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, overload

from kvrag.defaults import DEFAULT_SHARED_PREFIX
from kvrag.paths import default_store_dir
from kvrag.store.base import ChunkStore
from kvrag.store.disk import DiskStore

if TYPE_CHECKING:  # redis is imported only when a shared tier is opened
    from kvrag.store.redis_store import RedisStore


def check_cache_dir(cache_dir: str | os.PathLike | None) -> None:
    """Refuse an empty ``cache_dir``: ``Path("")`` is the working directory, which a store
    would silently fill. (``KVRag`` calls this before its model load.)"""
    if cache_dir is not None and not str(cache_dir).strip():
        raise ValueError(f"cache_dir must be a non-empty path (None: the default store), got {cache_dir!r}")


@overload
def open_shared(shared: str, *, prefix: str | None = None) -> RedisStore: ...


@overload
def open_shared(shared: ChunkStore, *, prefix: str | None = None) -> ChunkStore: ...


def open_shared(shared: str | ChunkStore, *, prefix: str | None = None) -> ChunkStore:
    """The shared tier ``shared`` names: a ``ChunkStore`` as it is, a URL
    (``redis://``, ``rediss://``, ``redis+cluster://``) as a ``RedisStore`` under ``prefix``
    (default ``kvrag:``). No connection is made yet, but a malformed URL fails here."""
    if isinstance(shared, ChunkStore):
        if prefix is not None:
            raise ValueError("a shared-store prefix applies to a URL, not to a ChunkStore passed as shared=")
        return shared
    from kvrag.store.redis_store import RedisStore

    return RedisStore(shared, prefix=DEFAULT_SHARED_PREFIX if prefix is None else prefix)


def open_store(
    cache_dir: str | os.PathLike | None = None,
    *,
    shared: str | ChunkStore | None = None,
    shared_prefix: str | None = None,
    size_limit: int | None = None,
    admission: str = "lru",
) -> ChunkStore:
    """The store kvrag uses: a ``DiskStore`` in ``cache_dir`` (None: ``default_store_dir()``),
    created if missing, with ``size_limit`` recorded in it when given and its ``admission``
    rule (``kvrag.store.admission``); with ``shared`` (see ``open_shared``) a ``TieredStore``
    of that disk store (near) and the shared tier (far)."""
    check_cache_dir(cache_dir)
    far = None if shared is None else open_shared(shared, prefix=shared_prefix)
    directory = Path(cache_dir).expanduser() if cache_dir is not None else default_store_dir()
    disk = DiskStore(directory, size_limit=size_limit, admission=admission)
    if far is None:
        return disk
    from kvrag.store.tiered import TieredStore

    return TieredStore(disk, far)
