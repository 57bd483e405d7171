"""Chunk prefill: the K/V a chunk produces when the model reads it alone.

Several chunks are packed into one sequence with a block-diagonal causal mask and positions
restarting at 0 for each chunk, so a batch costs one pass per layer and no padding, while
every chunk sees exactly what it would see alone (behind an optional anchor token, see
``compute_chunk_kv``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvrag.arch import Arch


def pack(lengths: Sequence[int], budget: int) -> Iterator[list[int]]:
    """Group chunk indices into packs of at most ``budget`` tokens (a chunk longer than the
    budget gets a pack of its own)."""
    group: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if group and total + n > budget:
            yield group
            group, total = [], 0
        group.append(i)
        total += n
    if group:
        yield group


@torch.no_grad()
def compute_chunk_kv(
    arch: Arch, chunks: Sequence[Sequence[int]], anchor: Sequence[int] = ()
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill ``chunks`` (token id lists, run together as one packed sequence).

    ``anchor``: token ids read before every chunk and dropped from its result (the model's
    attention sink, ``ModelHandle.anchor_ids``); each chunk then sees ``anchor + chunk`` alone.

    Returns per chunk ``(keys, values)``, each [L, Hkv, T, D] in the model dtype; keys are
    *pre-RoPE* (position-free), values as computed at positions len(anchor)..len(anchor)+T-1."""
    dev = arch.device
    a = len(anchor)
    lens = [a + len(c) for c in chunks]
    ids = torch.tensor([t for c in chunks for t in (*anchor, *c)], dtype=torch.long, device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    seg = torch.cat([torch.full((n,), i, device=dev) for i, n in enumerate(lens)])
    # Block-diagonal causal mask: a token sees earlier tokens of its own chunk only.
    idx = torch.arange(ids.numel(), device=dev)
    mask = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    # RoPE tables per chunk: a length-dependent RoPE (LongRoPE, dynamic NTK) picks its
    # frequencies from the sequence length, which must be the chunk's own, not the pack's.
    if arch.length_dependent_rope:
        tables = [arch.cos_sin(torch.arange(n, device=dev)) for n in lens]
        cs = (torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables]))
    else:
        cs = arch.cos_sin(positions)

    hidden = arch.embed(ids)
    keys_pre, values = [], []
    for layer in range(arch.n_layers):
        q, k, v, k_pre = arch.qkv(layer, hidden, cs)
        keys_pre.append(k_pre)
        values.append(v)
        # The last layer's output is not needed: only its K/V are.
        if layer < arch.n_layers - 1:
            hidden = arch.attend(layer, hidden, q, k, v, arch.windowed(layer, mask, positions, positions))
    K = torch.stack(keys_pre)  # [L, Hkv, sum(a + T), D]
    V = torch.stack(values)
    out, start = [], 0
    for n in lens:
        out.append((K[:, :, start + a : start + n].clone(), V[:, :, start + a : start + n].clone()))
        start += n
    return out
