"""What every tier of the KV store shares: the ``ChunkEntry`` it holds, the key it is found
by, and the ``ChunkStore`` interface the query and ingestion paths talk to.

Tiers: ``kvrag.store.disk.DiskStore`` (diskcache on local disk, the default and the durable
tier) and ``kvrag.store.hot.HotCache`` (served entries kept on the compute device). A shared
tier (several replicas) implements ``ChunkStore`` and plugs in beside them; the blob format
every persistent tier writes and verifies is ``kvrag.store.blob``.
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag.checks import is_integer_dtype
from kvrag.store.kv_format import decode, head_dim_of, packed_problem

# Bumped whenever the blob layout or the meaning of the stored tensors changes. The model
# fingerprint includes it (kvrag/model/digests.py), so a new version never even looks up old keys.
CACHE_FORMAT_VERSION = 1


@dataclass
class ChunkEntry:
    """The precomputed KV cache of one chunk.

    token_ids [T] int64; keys/values [L, Hkv, T, D] in the storage dtype (fp32/fp16/bf16),
    keys taken *before* RoPE (position-free); extras: per-policy tensors of any shape, e.g.
    ``"a2ats.codes"`` [L, Hkv, T] int16.

    A packed entry (``kv_format`` names a ``kvrag.store.kv_format`` packed format) holds codes
    in keys/values and their per-group scales (and zero points) in ``scales``; it is read
    through ``expanded``, or a layer at a time as the fusion engine places it
    (``kvrag.query.fusion.StoredRows``), never as float tensors itself."""

    fingerprint: str
    text: str
    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    kv_format: str = ""
    scales: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def packed(self) -> bool:
        return bool(self.kv_format)

    def expanded(self, device: torch.device, dtype: torch.dtype) -> ChunkEntry:
        """A packed entry's K/V expanded to float ``dtype`` on ``device`` (the packed bytes
        are moved there first, then expanded: no float copy on the host beside a GPU); a float
        entry as it is (the fusion engine moves and converts it)."""
        if not self.packed:
            return self
        d = head_dim_of(self.scales)
        keys, values = (
            decode(getattr(self, k), self.stats_of(k), self.kv_format, k, d, device, dtype) for k in ("keys", "values")
        )
        return ChunkEntry(self.fingerprint, self.text, self.token_ids, keys, values, self.extras)

    def stats_of(self, kind: str) -> dict[str, torch.Tensor]:
        """A packed entry's statistics of ``kind`` (``"keys"``, ``"values"``) as
        ``kv_format.decode`` takes them: {"scale": ..., "zero": ...}."""
        return {n.partition(".")[2]: t for n, t in self.scales.items() if n.startswith(kind + ".")}

    def span(self, a: int, b: int) -> ChunkEntry:
        """The entry of the chunk's tokens ``a..b-1`` (views, no copy), for a prompt whose
        tokenization matches only part of the chunk. A prefix (a = 0) is exact: each token's
        K/V depend only on the tokens before it. Extras laid out per token like the K/V
        ([L, Hkv, T, ...], e.g. A2ATS codes) are cut the same way; the others describe the
        chunk as a whole (e.g. the codebook digest) and are kept."""
        t = self.token_ids.numel()
        if self.packed:
            raise ValueError("a packed entry is cut once expanded (ChunkEntry.expanded)")
        if not 0 <= a < b <= t:
            raise ValueError(f"span {a}..{b} of a {t}-token chunk")
        extras = {k: (v[:, :, a:b] if v.dim() >= 3 and v.shape[2] == t else v) for k, v in self.extras.items()}
        return ChunkEntry(
            self.fingerprint, self.text, self.token_ids[a:b], self.keys[:, :, a:b], self.values[:, :, a:b], extras
        )

    def layout_problem(self, layout: tuple[int, int, int]) -> str | None:
        """Why this entry cannot serve a model whose K/V are laid out ``layout`` = (L, Hkv, D),
        or None if it can: keys/values [L, Hkv, T, D] of one floating dtype, token_ids [T]
        integers. A store may hold anything (a forged entry with a valid checksum): checked
        before the entry reaches the fusion engine, whose error would not name the chunk."""
        k, v, ids = self.keys, self.values, self.token_ids
        if not isinstance(self.text, str):
            return f"text is a {type(self.text).__name__}, not a str"
        if ids.dim() != 1 or not is_integer_dtype(ids.dtype):
            return f"token_ids have shape {tuple(ids.shape)} dtype {ids.dtype}, expected [T] integers"
        want = (layout[0], layout[1], ids.numel(), layout[2])
        if self.packed:
            if (problem := packed_problem(self.kv_format, k, v, self.scales, ids.numel())) is not None:
                return problem
            if (k.shape[0], k.shape[1], head_dim_of(self.scales)) != layout:
                return f"packed keys {tuple(k.shape)} of head dim {head_dim_of(self.scales)}, expected {list(want)}"
            return None
        if tuple(k.shape) != want or tuple(v.shape) != want:
            return f"keys {tuple(k.shape)} / values {tuple(v.shape)}, expected [L, Hkv, T, D] = {list(want)}"
        if k.dtype != v.dtype or not k.dtype.is_floating_point:
            return f"keys/values have dtypes {k.dtype} / {v.dtype}, expected one floating dtype"
        return None

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors (ids, keys, values, extras)."""
        tensors = [self.token_ids, self.keys, self.values, *self.extras.values(), *self.scales.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def make_key(fingerprint: str, token_ids) -> str:
    """sha256 hex of the model fingerprint and the token ids (as little-endian int64)."""
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError("make_key needs a non-empty fingerprint string")
    ids = torch.as_tensor(token_ids)
    if ids.dim() != 1 or not is_integer_dtype(ids.dtype):
        raise ValueError(f"token_ids must be a 1-D sequence of ints, got shape {tuple(ids.shape)} dtype {ids.dtype}")
    h = hashlib.sha256()
    fp = fingerprint.encode("utf-8")
    # Length prefix: no (fingerprint, ids) pair can produce another pair's byte string.
    h.update(len(fp).to_bytes(8, "little") + fp)
    h.update(ids.to(torch.int64).cpu().numpy().astype("<i8", copy=False).tobytes())
    return h.hexdigest()


class ChunkStore(abc.ABC):
    """A persistent tier of chunk entries, keyed by ``make_key``. Reads verify what they read
    (checksum, format, fingerprint, shapes): a missing, damaged or foreign entry is a miss
    (None), never an exception on the query path and never a wrong entry."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether an entry is stored under ``key`` (not verified)."""

    @abc.abstractmethod
    def get(self, key: str, fingerprint: str, *, pin_memory: bool = False) -> ChunkEntry | None:
        """The verified entry under ``key`` written for ``fingerprint``, or None."""

    @abc.abstractmethod
    def put(self, key: str, entry: ChunkEntry) -> None:
        """Store ``entry`` under ``key`` (replacing any entry there) and list its text."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove the entry under ``key``; True if there was one."""

    @abc.abstractmethod
    def ensure_indexed(self, key: str) -> bool:
        """True if ``key`` holds a whole entry, listed in the text index (re-listed if a writer
        died between the two); False if there is none."""

    def ensure_stored(self, key: str, fingerprint: str) -> bool:
        """``ensure_indexed`` for ingestion, which knows the entry's ``fingerprint``: a store
        of several tiers also restores a tier that lost the entry from one that has it."""
        return self.ensure_indexed(key)

    @abc.abstractmethod
    def texts(self, fingerprint: str | None) -> dict[str, str]:
        """key -> chunk text of the listed entries written for ``fingerprint`` (None: all)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and sizes, for ``kvrag cache stats``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release files and connections; the store is unusable afterwards."""

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
