"""The KV store: chunk entries keyed by model fingerprint + token ids.

``base`` (``ChunkEntry``, ``make_key``, the ``ChunkStore`` interface), ``blob`` (the verified
bytes of an entry), ``disk`` (``DiskStore``: diskcache on local disk, the default; its helpers
``disk_open``, ``disk_index``, ``disk_evict``, ``disk_check`` and ``confined``), ``hot``
(``HotCache``: served entries kept on the compute device), ``redis_store`` (``RedisStore``: the
tier several replicas share; its helpers ``redis_connection``, ``redis_index``, ``redis_meta``
and ``outage``), ``tiered`` (``TieredStore``: a near tier in front of a far one), ``factory``
(``open_store``/``open_shared``: where every store is built)."""

from kvrag.store.base import CACHE_FORMAT_VERSION, ChunkEntry, ChunkStore, make_key
from kvrag.store.disk import DiskStore
from kvrag.store.factory import open_shared, open_store
from kvrag.store.hot import HotCache

__all__ = [
    "CACHE_FORMAT_VERSION",
    "ChunkEntry",
    "ChunkStore",
    "DiskStore",
    "HotCache",
    "make_key",
    "open_shared",
    "open_store",
]
