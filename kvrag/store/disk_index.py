"""The text index of a ``DiskStore``: a second diskcache cache, without eviction, that maps each
stored key to the JSON ``{"text", "fingerprint", "n_tokens"}`` of its blob, so the segmenter can
list every chunk text without loading a blob.

The index is only a fast listing: each blob describes itself (its header holds the same text,
fingerprint and token count), so a row that is missing or unusable is rebuilt from the blob
(``listing_of``), and a row whose blob is gone is not listed.
"""

from __future__ import annotations

import logging

import diskcache

from kvrag.store.blob import Corrupt, index_record, index_value, metadata, read_file_header

# The disk tier's one logger, whichever of its modules speaks.
log = logging.getLogger("kvrag.store.disk")


def own_keys(cache: diskcache.Cache) -> list[str]:
    """The keys of one of the store's two caches; a key kvrag never writes (pickled, not text:
    ``ConfinedDisk`` returns None for it) is left out."""
    return [k for k in cache.iterkeys() if isinstance(k, str)]


def listed(index: diskcache.Cache, blobs: diskcache.Cache) -> dict[str, tuple[str, str]]:
    """key -> (chunk text, model fingerprint) of every row of ``index`` whose blob is stored
    in ``blobs``; an unusable row is skipped (and said)."""
    out = {}
    for key in own_keys(index):
        raw = index.get(key, retry=True)
        if raw is None:
            continue
        rec = index_record(raw)
        if rec is None:
            log.warning(
                "DiskStore: unusable text-index entry %s; skipped (gc() or a precompute of the "
                "chunk rebuilds it from the blob)",
                key,
            )
            continue
        if key in blobs:
            out[key] = rec
    return out


def header_metadata(handle) -> dict[str, str] | None:
    """The metadata in the header of the blob file open as ``handle`` (only the header is
    read; the checksum is verified when the blob is loaded), or None if it has no readable
    header. Closes ``handle``."""
    with handle:
        try:
            return metadata(read_file_header(handle)[0])
        except Corrupt:
            return None


def listing_of(meta: dict[str, str] | None) -> str | None:
    """The index row (JSON) of a blob whose header holds ``meta``, or None when it has no
    usable text (such a blob is never listed: its ``get`` finds it corrupt)."""
    if not meta or index_record(meta) is None:
        return None
    n_tokens = meta.get("n_tokens", "0")
    return index_value(
        meta["text"],
        meta["fingerprint"],
        int(n_tokens) if n_tokens.isascii() and n_tokens.isdigit() and len(n_tokens) < 12 else 0,
    )
