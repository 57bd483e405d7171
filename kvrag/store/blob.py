"""The bytes of one stored chunk entry, as every persistent tier writes and verifies them.

A blob is a safetensors file holding the tensors ``token_ids`` [T] int64, ``keys`` and
``values`` [L, Hkv, T, D] (storage dtype) and ``extras.<name>`` (any shape/dtype), with string
metadata ``kvrag_format`` (= ``CACHE_FORMAT_VERSION``), ``fingerprint``, ``text`` and
``n_tokens``: a blob describes itself. Its tag (``checksum``) is stored beside it and checked
before anything in it is trusted beyond the format version.

A packed entry (``kvrag.store.kv_format``) is blob version ``PACKED_BLOB_VERSION``: ``keys`` and
``values`` hold its codes, ``kv.<part>.<stat>`` its scales (and zero points), and the metadata
``kv_format`` names the format -- which must be the one its fingerprint names, so a blob is
never read as another format than the one its key was made for. Float entries are still
written as version ``CACHE_FORMAT_VERSION`` (a kvrag before the packed formats reads them);
an older kvrag skips a packed blob as "newer" (and never asks for its key anyway).
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from typing import Any

import safetensors.torch
import torch

from kvrag.checks import is_integer_dtype
from kvrag.store.base import CACHE_FORMAT_VERSION, ChunkEntry
from kvrag.store.kv_format import format_of_fingerprint, packed_problem

EXTRA_PREFIX = "extras."
SCALE_PREFIX = "kv."

#: The blob version of a packed entry; float entries keep ``CACHE_FORMAT_VERSION``.
PACKED_BLOB_VERSION = 2
_READABLE_VERSIONS = (str(CACHE_FORMAT_VERSION), str(PACKED_BLOB_VERSION))

_CRC_PREFIX = "crc32:"

#: The largest safetensors header a blob may declare (bytes). A real one is a few hundred bytes
#: plus the chunk's text; the bound keeps a crafted length from making a reader allocate or
#: parse without end.
MAX_HEADER_BYTES = 2**24


def checksum(data: bytes | memoryview) -> str:
    """The tag stored with a blob: ``"crc32:<8 hex>"``. CRC-32 (zlib) rather than a
    cryptographic hash because it only has to catch truncated or damaged files, and it is
    verified on the TTFT path: ~3x faster than sha256 (tens of ms per prompt of cached MB)."""
    return f"{_CRC_PREFIX}{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def checksum_matches(data: bytes | memoryview, tag: object) -> bool:
    """Whether ``data`` matches the stored ``tag``: a ``crc32:`` tag, or the sha256 hex tag
    that stores written before the switch hold (still readable, no migration)."""
    if not isinstance(tag, str):
        return False
    if tag.startswith(_CRC_PREFIX):
        return tag == checksum(data)
    if len(tag) == 64:
        return hashlib.sha256(data).hexdigest() == tag
    return False


class Corrupt(Exception):
    """A blob that failed verification (message = the problem)."""


def is_newer_format(meta: dict[str, str]) -> bool:
    """Whether a blob's header declares a format version newer than this kvrag reads."""
    try:
        return int(meta.get("kvrag_format", "")) > PACKED_BLOB_VERSION
    except (TypeError, ValueError):
        return False


def verified_header(
    buf: torch.Tensor, tag: object, fingerprint: str | None = None
) -> tuple[dict[str, Any], int] | None:
    """The safetensors header of a stored blob (uint8 [bytes]) and the offset its data starts
    at, once its checksum and format version check out; None for a blob of a newer format;
    raises Corrupt otherwise.

    The version is read from the header *before* the checksum: a newer kvrag sharing the
    store may use another checksum scheme or layout, so its blobs are not ours to judge (or
    delete). A blob of an older version is treated like a damaged one: corrupt. So is one that
    claims a newer version but carries ``fingerprint`` (the one this kvrag asked for): model
    fingerprints include the format version, so a newer kvrag never writes that one."""
    data = buf.numpy().data  # a memoryview over the blob's bytes: hashed and sliced without a copy
    header, start = read_header(data)
    meta = metadata(header)
    if is_newer_format(meta):
        if fingerprint is not None and meta.get("fingerprint") == fingerprint:
            raise Corrupt(f"format version {meta.get('kvrag_format')!r} with this kvrag's fingerprint")
        return None
    if (end := start + data_end(header)) != len(data):  # before the checksum reads it all
        raise Corrupt(f"blob of {len(data)} bytes, its header says {end}")
    if not checksum_matches(data, tag):
        raise Corrupt(f"checksum mismatch (stored {tag}, {len(data)} bytes)")
    if meta.get("kvrag_format") not in _READABLE_VERSIONS:
        raise Corrupt(f"format version {meta.get('kvrag_format')!r}, expected one of {_READABLE_VERSIONS}")
    return header, start


def data_end(header: dict[str, Any]) -> int:
    """Where the tensor data a header describes ends (bytes after the header); Corrupt if an
    entry's offsets are not a pair of non-negative ints."""
    end = 0
    for name, info in header.items():
        if name != "__metadata__":
            end = max(end, _offsets(name, info)[1])
    return end


def _ints(name: str, value: object, what: str) -> list[int]:
    # Strict ints: a float (1e400 is inf), a bool or a string is not a size.
    if not isinstance(value, list) or not all(type(x) is int and x >= 0 for x in value):
        raise Corrupt(f"bad {what} {value!r:.80} for tensor {name!r:.80}")
    return value


def _offsets(name: str, info: object) -> tuple[int, int]:
    offsets = _ints(name, info.get("data_offsets") if isinstance(info, dict) else None, "data_offsets")
    if len(offsets) != 2 or offsets[0] > offsets[1]:
        raise Corrupt(f"bad data_offsets {offsets!r:.80} for tensor {name!r:.80}")
    return offsets[0], offsets[1]


def validate_entry(entry: ChunkEntry) -> torch.Tensor:
    """Check an entry before storing it; returns its token ids as int64 [T]."""
    if not isinstance(entry, ChunkEntry):
        raise TypeError(f"put() needs a ChunkEntry, got {type(entry).__name__}")
    if not isinstance(entry.fingerprint, str) or not entry.fingerprint:
        raise ValueError("ChunkEntry.fingerprint must be a non-empty string")
    if not isinstance(entry.text, str):
        raise ValueError(f"ChunkEntry.text must be a str, got {type(entry.text).__name__}")
    if not entry.text.strip():
        # A blank text matches everywhere (or nowhere) in a prompt: listed, it broke every query.
        raise ValueError(f"ChunkEntry.text must hold non-whitespace characters, got {entry.text!r}")
    for name in ("token_ids", "keys", "values"):
        if not isinstance(getattr(entry, name), torch.Tensor):
            raise ValueError(f"ChunkEntry.{name} must be a torch.Tensor, got {type(getattr(entry, name)).__name__}")
    ids = entry.token_ids
    if ids.dim() != 1:
        raise ValueError(f"ChunkEntry.token_ids must be 1-D [T], got shape {tuple(ids.shape)}")
    if not is_integer_dtype(ids.dtype):
        raise ValueError(f"ChunkEntry.token_ids must be integers, got {ids.dtype}")
    if ids.numel() == 0:
        raise ValueError("empty ChunkEntry: token_ids has T == 0 tokens")
    k, v = entry.keys, entry.values
    if entry.kv_format:
        if (problem := packed_problem(entry.kv_format, k, v, entry.scales, ids.numel())) is not None:
            raise ValueError(f"packed ChunkEntry: {problem}")
        if format_of_fingerprint(entry.fingerprint) != entry.kv_format:
            raise ValueError(f"a {entry.kv_format} ChunkEntry needs a fingerprint of that format (format_fingerprint)")
    elif entry.scales or format_of_fingerprint(entry.fingerprint) is not None:
        raise ValueError("a float ChunkEntry has no scales and a float format's fingerprint")
    if k.dim() != 4:
        raise ValueError(f"ChunkEntry.keys must be [L, Hkv, T, D], got shape {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"ChunkEntry keys/values shape mismatch: keys {tuple(k.shape)} vs values {tuple(v.shape)}")
    if k.dtype != v.dtype or not (k.dtype.is_floating_point or entry.kv_format):
        raise ValueError(f"ChunkEntry keys/values must share one floating dtype, got {k.dtype} / {v.dtype}")
    if k.shape[2] != ids.numel():
        raise ValueError(f"ChunkEntry has {ids.numel()} token ids but keys/values hold T={k.shape[2]} tokens")
    if k.numel() == 0:
        raise ValueError(f"empty ChunkEntry: keys have shape {tuple(k.shape)}")
    for name, t in entry.extras.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"ChunkEntry.extras names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"ChunkEntry.extras[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
    return ids.to(torch.int64)


def serialize(entry: ChunkEntry, ids: torch.Tensor) -> bytes:
    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous()

    tensors = {"token_ids": cpu(ids), "keys": cpu(entry.keys), "values": cpu(entry.values)}
    for name, t in entry.extras.items():
        tensors[EXTRA_PREFIX + name] = cpu(t)
    for name, t in entry.scales.items():
        tensors[SCALE_PREFIX + name] = cpu(t)
    metadata = {
        "kvrag_format": str(PACKED_BLOB_VERSION if entry.kv_format else CACHE_FORMAT_VERSION),
        "fingerprint": entry.fingerprint,
        "text": entry.text,
        "n_tokens": str(int(ids.numel())),
    }
    if entry.kv_format:
        metadata["kv_format"] = entry.kv_format
    return safetensors.torch.save(tensors, metadata=metadata)


def index_value(text: str, fingerprint: str, n_tokens: int) -> str:
    """The text-index record of an entry (JSON), as every tier lists it."""
    return json.dumps({"text": text, "fingerprint": fingerprint, "n_tokens": int(n_tokens)})


def index_record(raw: object) -> tuple[str, str] | None:
    """(text, fingerprint) of a text-index value (JSON, or the blob metadata it is made from),
    or None unless its text holds non-whitespace characters and its fingerprint is a non-empty
    string: the index is read on every segmenter refresh, so one bad row must not break every
    query."""
    try:
        rec = json.loads(raw) if isinstance(raw, str) else raw
    except (ValueError, RecursionError):
        return None
    if not isinstance(rec, dict):
        return None
    text, fp = rec.get("text"), rec.get("fingerprint")
    if not (isinstance(text, str) and text.strip() and isinstance(fp, str) and fp):
        return None
    return text, fp


def read_header(data) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors buffer (bytes, a file mapping or a uint8 array) and the
    offset its tensor data starts at. Format: u64 little-endian header length, then the JSON
    header, then the data."""
    data = memoryview(data)
    if len(data) < 8:
        raise Corrupt(f"blob too short ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data) or n > MAX_HEADER_BYTES:
        raise Corrupt(f"bad safetensors header length {n} for a {len(data)}-byte blob")
    try:
        # The header is read before the checksum, so any input must end as Corrupt: deep
        # nesting (RecursionError), NaN/Infinity (refused: not JSON, and never a size).
        header = json.loads(bytes(data[8 : 8 + n]), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise Corrupt(f"unreadable safetensors header: {e!s:.200}") from None
    if not isinstance(header, dict):
        raise Corrupt("safetensors header is not a mapping")
    return header, 8 + n


def read_file_header(f) -> tuple[dict[str, Any], int]:
    """``read_header`` of a blob file opened for reading, reading only the header's bytes."""
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    if not 0 < n <= MAX_HEADER_BYTES:
        raise Corrupt(f"bad safetensors header length {n}")
    return read_header(head + f.read(n))


def _no_constant(name: str):
    raise ValueError(f"{name} in a safetensors header")


def metadata(header: dict[str, Any]) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors header (safetensors' loaders do not return it
    for in-memory bytes)."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise Corrupt("safetensors metadata is missing or not a mapping")
    if not all(isinstance(v, str) for v in meta.values()):  # safetensors metadata is str -> str
        raise Corrupt("safetensors metadata holds a value that is not a string")
    return meta


#: safetensors dtype names -> torch dtypes, for the views of a read blob.
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def deserialize(buf: torch.Tensor, header: dict[str, Any], start: int) -> ChunkEntry:
    """The entry held by a verified blob ``buf`` (uint8 [bytes]; header and data offset from
    ``verified_header``). Its tensors are views of ``buf`` -- a private, copy-on-write file
    mapping or a pinned buffer: no copy and no parse under the GIL, unlike
    ``safetensors.torch.load`` of the bytes, which copies every tensor (on a 2-core box: ~60 ms
    of a 154 ms cold read of 90 MiB, which the mapping with its checksum does in ~25 ms)."""
    size = buf.numel() - start
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        name_of_dtype = info.get("dtype") if isinstance(info, dict) else None
        dtype = DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
        if dtype is None:
            raise Corrupt(f"bad header entry for {name!r:.80}: no known dtype")
        shape = _ints(name, info.get("shape"), "shape")
        if len(shape) > 16:  # what kvrag stores has at most 4 dimensions
            raise Corrupt(f"tensor {name!r:.80} has {len(shape)} dimensions")
        a, b = _offsets(name, info)
        if b > size or b - a != math.prod(shape) * dtype.itemsize:
            raise Corrupt(f"tensor {name!r:.80} {info['dtype']}{shape!s:.80} does not fit bytes {a}..{b} of {size}")
        t = buf[start + a : start + b]
        if (start + a) % dtype.itemsize:  # safetensors aligns its tensors; a view needs it
            t = t.clone()
        tensors[name] = t.view(dtype).view(shape)
    meta = metadata(header)
    try:
        ids, k, v = tensors.pop("token_ids"), tensors.pop("keys"), tensors.pop("values")
        fingerprint, text, n_tokens = meta["fingerprint"], meta["text"], int(meta["n_tokens"])
    except (KeyError, ValueError) as e:
        raise Corrupt(f"missing or bad field {e}") from None
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise Corrupt(f"token_ids has shape {tuple(ids.shape)} dtype {ids.dtype}, expected [T] int64")
    # The format the header names must be the one the fingerprint (and so the key) was made
    # for, and the blob version the one that format is written as: a blob never passes as
    # another format, whatever its header claims.
    kv_format = meta.get("kv_format", "")
    if kv_format != (format_of_fingerprint(fingerprint) or ""):
        raise Corrupt(f"K/V format {kv_format or 'float'!r} in a blob of fingerprint {fingerprint:.80}")
    if meta.get("kvrag_format") != str(PACKED_BLOB_VERSION if kv_format else CACHE_FORMAT_VERSION):
        raise Corrupt(f"format version {meta.get('kvrag_format')!r} for K/V format {kv_format or 'float'!r}")
    scales = {n[len(SCALE_PREFIX) :]: tensors.pop(n) for n in list(tensors) if n.startswith(SCALE_PREFIX)}
    if kv_format:
        if (problem := packed_problem(kv_format, k, v, scales, ids.numel())) is not None:
            raise Corrupt(problem)
        if n_tokens != ids.numel():
            raise Corrupt(f"token count mismatch: {ids.numel()} ids, n_tokens={n_tokens}")
    elif k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or not k.dtype.is_floating_point:
        raise Corrupt(
            f"keys {tuple(k.shape)} {k.dtype} / values {tuple(v.shape)} {v.dtype} are inconsistent "
            "(expected one floating dtype, [L, Hkv, T, D])"
        )
    elif scales:
        raise Corrupt(f"scales {sorted(scales)} in a float blob")
    if not text.strip():
        raise Corrupt("blank chunk text")
    if k.shape[2] != ids.numel() or n_tokens != ids.numel():
        raise Corrupt(f"token count mismatch: {ids.numel()} ids, T={k.shape[2]}, n_tokens={n_tokens}")
    unknown = [n for n in tensors if not n.startswith(EXTRA_PREFIX)]
    if unknown:
        raise Corrupt(f"unexpected tensors {unknown}")
    extras = {n[len(EXTRA_PREFIX) :]: t for n, t in tensors.items()}
    return ChunkEntry(
        fingerprint=fingerprint,
        text=text,
        token_ids=ids,
        keys=k,
        values=v,
        extras=extras,
        kv_format=kv_format,
        scales=scales,
    )
