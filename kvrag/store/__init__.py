"""The KV store: chunk entries keyed by model fingerprint + token ids.

``base`` (``ChunkEntry``, ``make_key``, the ``ChunkStore`` interface), ``blob`` (the verified
bytes of an entry), ``disk`` (``KVStore``: diskcache on local disk, the default), ``hot``
(``HotCache``: served entries kept on the compute device)."""

from kvrag.store.base import CACHE_FORMAT_VERSION, ChunkEntry, ChunkStore, make_key
from kvrag.store.disk import KVStore
from kvrag.store.hot import HotCache

__all__ = ["CACHE_FORMAT_VERSION", "ChunkEntry", "ChunkStore", "HotCache", "KVStore", "make_key"]
