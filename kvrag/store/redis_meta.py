"""The meta of an entry in the shared tier: the hash ``{ver, tag, size, part_size, parts}`` that
points at an entry's parts (``kvrag.store.redis_store`` lays them out), and its checks.

A meta is data like the rest of Redis: one that is not what kvrag writes -- a field missing or
not a number, a size over the reader's bound, a part size outside what Redis holds, a part count
other than the size in parts -- is never followed (``meta_fields`` returns None).
"""

from __future__ import annotations

import math
from typing import Any

#: A meta claiming more than this is not one kvrag wrote (and is not fetched); a KVRag lowers
#: it to the largest entry its model can produce (``RedisStore.limit_entry_bytes``).
MAX_ENTRY_BYTES = 2**34
#: Redis's own limit on one string (proto-max-bulk-len): no part kvrag writes is larger.
MAX_PART_BYTES = 2**29
#: The fields of a meta hash, in the order HMGET reads them.
META_FIELDS = ("ver", "tag", "size", "part_size", "parts")


def meta_fields(raw, default_part: int, max_entry: int = MAX_ENTRY_BYTES) -> dict[str, Any] | None:
    """The checked fields of a meta hash (``raw``: HGETALL's dict or HMGET's list of
    ``META_FIELDS``), or None if it is not one kvrag wrote: a field missing or not a number,
    a size over ``max_entry``, a part size outside [1 KiB, 512 MiB], or a part count other
    than the size in parts."""
    if isinstance(raw, (list, tuple)):
        raw = {f.encode(): v for f, v in zip(META_FIELDS, raw) if v is not None}
    try:
        meta = {k.decode("ascii"): v.decode("ascii") for k, v in raw.items() if len(v) <= 64}
        out = {
            "ver": meta["ver"],
            "tag": meta["tag"],
            "size": int(meta["size"]),
            "part_size": int(meta.get("part_size", default_part)),
            "parts": int(meta["parts"]),
        }
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError):
        return None
    if (
        not out["ver"].isalnum()
        or not 0 < out["size"] <= max_entry
        or not 1024 <= out["part_size"] <= MAX_PART_BYTES
        or out["parts"] != max(1, math.ceil(out["size"] / out["part_size"]))
    ):
        return None
    return out


def part_len(meta: dict[str, Any], i: int) -> int:
    """The bytes part ``i`` of ``meta``'s blob holds."""
    return min(meta["part_size"], meta["size"] - i * meta["part_size"])
