"""The data a prompt carries through a fused prefill: its ``Layout`` (which tokens are plain,
cached or inserted, at which positions), the ``FusionState`` the engine shares with the policy
hooks, and the ``FusionStats`` it reports.

Below the policies: the fusion engine, the policies and the facade all read these types, and
it imports none of them (only, for its annotations, the model layer's ``Arch`` and the store's
``ChunkEntry`` beneath it), so the policies need not import the engine that calls them.

Shapes: ``N`` tokens in the fused prompt, ``A`` active tokens, ``Hkv`` KV heads, ``D`` head
dim, ``T`` tokens of one piece, ``E`` hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from kvrag.arch import Arch
    from kvrag.store.base import ChunkEntry

# The kinds whose K/V are read, not computed, are numbered last: ``Layout.stored`` is then one
# comparison (every op on the layout counts toward a fused prefill's op budget).
PLAIN, INSERTED, CACHED, PREFIX = 0, 1, 2, 3


@dataclass
class Piece:
    """One segment of the prompt as the engine sees it.

    ``kind``: PLAIN (computed), CACHED (a chunk's stored K/V, fused under the policy),
    INSERTED (policy-made tokens, computed) or PREFIX (the prompt's leading plain tokens, their
    exact K/V read from the prompt prefix cache: ``kvrag.query.prefix``).

    token_ids [T]; ``entry`` is the loaded ``ChunkEntry`` for a cached chunk or a prefix, else None;
    ``embeds`` [T, E] for inserted tokens (policy-made), else None; ``key`` the chunk's store
    key and ``span`` the range ``(a, b)`` of the stored chunk's tokens the piece holds (the
    prompt may tokenize a chunk's edges otherwise, so only part of it is reused)."""

    token_ids: torch.Tensor
    kind: int = PLAIN
    entry: Any = None  # a ChunkEntry for a CACHED or PREFIX piece, else None
    embeds: torch.Tensor | None = None
    key: str | None = None
    span: tuple[int, int] | None = None


@dataclass
class Layout:
    """Token layout of one fused prompt.

    token_ids [N] (0 for inserted tokens), kind [N] (PLAIN/CACHED/INSERTED/PREFIX), segment [N]
    (index into ``pieces``), positions [N] (global RoPE positions), query [Q] (indices of the
    question tokens: the trailing plain tokens after the last cached chunk by default)."""

    pieces: list[Piece]
    token_ids: torch.Tensor
    kind: torch.Tensor
    segment: torch.Tensor
    positions: torch.Tensor
    query: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.token_ids.numel())

    @property
    def in_prompt_order(self) -> bool:
        """Positions never decrease along the tokens (``build`` lays them out so): each row's
        causal horizon is then a key prefix and a window's keys a contiguous range. Read on the
        host copy, so no device sync."""
        return bool((self.positions[1:] >= self.positions[:-1]).all())

    @property
    def cached(self) -> torch.Tensor:
        """bool [N]: token comes from a cached chunk."""
        return self.kind == CACHED

    @property
    def stored(self) -> torch.Tensor:
        """bool [N]: token's K/V are read, not computed: a cached chunk's or an exact prefix's.
        A prefix is not ``cached``: policies neither rank nor recompute it (it is exact), and
        it counts in no recompute budget."""
        return self.kind >= CACHED

    def spans(self, kind: int | None = None) -> list[tuple[int, int, int]]:
        """(segment index, start, end) token spans of the pieces (of one kind)."""
        out, start = [], 0
        for i, p in enumerate(self.pieces):
            end = start + int(p.token_ids.numel())
            if kind is None or p.kind == kind:
                out.append((i, start, end))
            start = end
        return out

    @classmethod
    def build(cls, pieces: list[Piece], query_tokens: int | None = None) -> Layout:
        ids, kinds, segs = [], [], []
        for i, p in enumerate(pieces):
            t = int(p.token_ids.numel())
            ids.append(p.token_ids.long().cpu())
            kinds.append(torch.full((t,), p.kind, dtype=torch.long))
            segs.append(torch.full((t,), i, dtype=torch.long))
        token_ids = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)
        kind = torch.cat(kinds) if kinds else torch.empty(0, dtype=torch.long)
        n = token_ids.numel()
        if n == 0:
            raise ValueError("empty prompt: nothing to prefill")
        if query_tokens is None:
            # The question is what follows the last cached chunk (RAG prompts put it last).
            cached_idx = (kind == CACHED).nonzero()
            start = int(cached_idx[-1]) + 1 if cached_idx.numel() else 0
        else:
            start = max(0, n - int(query_tokens))
        query = torch.arange(start, n)
        if query.numel() == 0:
            query = torch.tensor([n - 1])
        return cls(pieces, token_ids, kind, torch.cat(segs), torch.arange(n), query)


@dataclass
class FusionStats:
    """What a fused prefill did. ``recomputed_tokens``: cached tokens still computed at the
    last layer; ``recompute_fraction``: computed (token, layer) pairs of cached tokens over all
    cached (token, layer) pairs — the real compute share."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefix_tokens: int = 0  # leading plain tokens read from the prompt prefix cache (computed at its first use)
    computed_tokens: int = 0
    inserted_tokens: int = 0
    recomputed_tokens: int = 0
    recompute_fraction: float = 0.0
    kept_tokens: int = 0
    chunks_hit: int = 0
    chunks_missed: int = 0
    chunks_unaligned: int = 0  # found in the text, but the prompt's tokenization splits it otherwise
    chunks_partial: int = 0  # served, but the prompt holds only part of its text (cut, or edge whitespace trimmed)
    chunks_hot: int = 0  # served from the in-memory hot tier (kvrag.store.hot), not read from disk
    bytes_loaded: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    load_s: float = 0.0
    decode_s: float = 0.0
    new_tokens: int = 0
    policy: str = ""
    # Policy-specific counters ("<policy>.<name>": number), taken from
    # ``state.scratch["policy_stats"]`` by reference, so a decode-time policy (A2ATS' KV bytes
    # read per token) keeps updating them while decoding.
    policy_stats: dict = field(default_factory=dict)

    @property
    def read_tokens(self) -> int:
        """Prompt tokens whose K/V were read, not computed: cached chunks' and a kept prefix's
        (what OpenAI's ``usage.prompt_tokens_details.cached_tokens`` counts)."""
        return self.cached_tokens + self.prefix_tokens

    #: What the chunk lookup (``kvrag.query.lookup``) counts, before any prefill runs.
    LOOKUP_FIELDS = ("chunks_missed", "chunks_unaligned", "chunks_partial", "chunks_hot", "bytes_loaded")

    def add_lookup(self, lookup: FusionStats) -> None:
        """Take the lookup's counters (``LOOKUP_FIELDS``) from ``lookup``."""
        for name in self.LOOKUP_FIELDS:
            setattr(self, name, getattr(lookup, name))

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class FusionState:
    """Mutable state of one fused prefill, shared with the policy hooks.

    K, V: per layer [Hkv, N, D] (keys rotated to global positions); keep bool [N] (tokens
    kept in attention and in the final cache); active LongTensor [A]; cos/sin [N, D]."""

    arch: Arch
    layout: Layout
    K: list[torch.Tensor]
    V: list[torch.Tensor]
    keep: torch.Tensor
    active: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    # long [N], on the CPU: layers at which each token was computed; complete once the last layer
    # ran (the engine adds each active set's layers where the set narrows: no host read per layer).
    layer_counts: torch.Tensor
    scratch: dict = field(default_factory=dict)
    # The cached chunks' entries by piece index: policies that need a chunk's position-free
    # (pre-RoPE) keys or its stored extras (A2ATS codes) read them here.
    entries: dict[int, ChunkEntry] = field(default_factory=dict)
    # Per-layer, per-KV-head eviction (A3's SnapKV-style extension keeps different tokens in
    # each head): set by ``after_prefill`` to one LongTensor [Hkv, M] of token indices per
    # layer (same M everywhere, so the decoder's cache stays rectangular). None: every layer
    # and head keeps the ``keep`` tokens.
    kv_index: list[torch.Tensor] | None = None

    @property
    def required(self) -> torch.Tensor:
        """bool [N]: tokens that must be computed at every layer (neither cached nor a kept
        prefix, and the last)."""
        req = ~self.layout.stored
        req[-1] = True
        return req
