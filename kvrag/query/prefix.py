"""The prompt prefix cache: exact K/V of a prompt's leading plain tokens, kept across queries.

A RAG prompt starts with the same text every time (the system prompt, the instruction, a
chat template's header) before its first retrieved passage. Those tokens see only each other,
so their K/V computed alone from position 0 are exactly what a prefill of any prompt starting
with them computes: nothing about reusing them is approximate, unlike a passage's (this is
the rule of vLLM's automatic prefix caching and llama.cpp's prompt cache). A fused prefill
then reads them instead of computing them, which on short prompts is a large share of what
it computes (the template around four passages is ~50 tokens of the ~100 a fused prefill
computes on Gemma 3).

Only the fused path uses it: a prompt without a cached chunk takes the exact full prefill,
kvrag's baseline. It is per ``KVRag`` (one model, one adapter), keyed by the token ids, so an
entry never goes stale. A model whose RoPE frequencies depend on the sequence length
(LongRoPE, dynamic NTK) gets none: a prefix computed alone would carry the short tables.

Shapes: ``P`` prefix tokens, ``L`` layers, ``Hkv`` KV heads, ``D`` head dim.
"""

from __future__ import annotations

import torch

from kvrag.checks import check_int
from kvrag.chunk import compute_chunk_kv
from kvrag.layout.state import PLAIN, PREFIX, Piece
from kvrag.model import ModelHandle
from kvrag.store.base import ChunkEntry
from kvrag.store.lru import ByteLRU


class PrefixCache:
    """Thread-safe LRU of prefix entries by token ids, at most ``budget`` bytes of K/V (0: off).

    An entry is a ``ChunkEntry`` with keys *pre-RoPE* and values [L, Hkv, P, D] in the
    model's dtype on its device, computed from position 0 with nothing before it (no anchor):
    the fusion engine rotates its keys to positions 0..P-1 with the cached chunks'."""

    def __init__(self, handle: ModelHandle, budget: int) -> None:
        self.arch = handle.arch
        self._token_bytes = handle.kv_bytes_per_token()  # an entry's bytes per token, in the model's dtype
        self._entries: ByteLRU[ChunkEntry] = ByteLRU(check_int("prefix_cache (bytes)", budget, 0), _size)

    @property
    def budget(self) -> int:
        return self._entries.budget

    @property
    def enabled(self) -> bool:
        return self.budget > 0 and not self.arch.length_dependent_rope

    def entry(self, token_ids: torch.Tensor) -> ChunkEntry | None:
        """The entry of the prefix ``token_ids`` [P], computed and kept on a miss; None when
        the cache is off or the entry alone is over the budget (then nothing is kept)."""
        if not self.enabled or token_ids.numel() == 0:
            return None
        ids = tuple(token_ids.tolist())
        hit = self._entries.get(ids)
        if hit is not None:
            return hit
        if len(ids) * self._token_bytes > self.budget:
            return None
        with torch.no_grad():
            ((keys, values),) = compute_chunk_kv(self.arch, [list(ids)])
        entry = ChunkEntry("", "", token_ids.clone(), keys, values)
        self._entries.put(ids, entry)
        return entry

    def attach(self, pieces: list[Piece]) -> list[Piece]:
        """``pieces`` with their leading plain pieces (the BOS the tokenizer adds is one, the
        template's text another) served from the cache as one PREFIX piece, when the prompt
        has any and the cache holds or can keep them; else ``pieces`` unchanged."""
        n = 0
        while n < len(pieces) and pieces[n].kind == PLAIN:
            n += 1
        if n == 0:
            return pieces
        ids = torch.cat([p.token_ids for p in pieces[:n]])
        entry = self.entry(ids)
        if entry is None:
            return pieces
        return [Piece(ids, PREFIX, entry=entry), *pieces[n:]]

    def clear(self) -> None:
        self._entries.clear()

    def stats(self) -> dict:
        """entries, bytes, budget, hits, misses."""
        return self._entries.stats()


def _size(entry: ChunkEntry) -> int:
    return entry.keys.numel() * entry.keys.element_size() + entry.values.numel() * entry.values.element_size()
