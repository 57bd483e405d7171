"""The model's forward pass under the KVLink attention mask, with gradients.

The mask is the paper's (its reference code's ``make_segment_mask``): a token of document ``d``
attends only to earlier tokens of ``d`` and to the private copy of the anchor its chunk was
computed behind; documents do *not* see the template; every other token (template, link tokens,
question, answer) attends causally to everything before it. The pass is kvrag's own layer loop
(``Arch.qkv`` / ``Arch.attention`` / ``Arch.finish_layer``): the same function the fusion engine
computes at query time (a test holds them equal). A step's samples run as one forward, their rows
packed end to end, each attending to its own rows only (``forward_hidden_batch``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvrag.arch import Arch
from kvrag.policies.kvlink.samples import Sample


def kvlink_mask(segment: torch.Tensor, private: torch.Tensor | None = None) -> torch.Tensor:
    """bool [N, N] (True = may attend): causal, and a document token (segment d >= 1) sees only
    its own document; every other token sees everything before it except ``private`` [N]
    tokens (anchor copies), which only their own document sees."""
    n = segment.numel()
    idx = torch.arange(n, device=segment.device)
    causal = idx[:, None] >= idx[None, :]
    own = segment[:, None] == segment[None, :]
    shared = segment[:, None] == 0
    if private is not None:
        shared = shared & ~private[None, :]
    return causal & (shared | own)


def forward_hidden(arch: Arch, sample: Sample, links: torch.Tensor | None) -> torch.Tensor:
    """Last-layer hidden states [N, E] of ``sample`` under the KVLink mask, differentiable.

    links: the link table [max_docs, K, E] (ignored when the sample has no link slots)."""
    return forward_hidden_batch(arch, [sample], links)[0]


def forward_hidden_batch(arch: Arch, samples: Sequence[Sample], links: torch.Tensor | None) -> list[torch.Tensor]:
    """Last-layer hidden states [N_i, E] of each of ``samples`` under its KVLink mask, from one
    forward over their rows packed end to end ([sum N_i, E]), differentiable.

    The token-wise work of a layer (norms, projections with their LoRA, MLP) runs once over
    every row, which is what batching buys on a GPU; each sample's attention runs over its own
    rows only, with its own mask [N_i, N_i] and RoPE tables, so no row sees another sample and
    no padding is computed (as batched decoding does, ``kvrag.query.batch``). Each result
    equals ``forward_hidden`` of its sample alone, up to float rounding.

    links: the link table [max_docs, K, E] (ignored when no sample has link slots)."""
    if not samples:
        raise ValueError("forward_hidden_batch: no samples")
    dev = arch.device
    ids, slot = _join([s.ids for s in samples]).to(dev), _join([s.link_slot for s in samples]).to(dev)
    hidden = arch.embed(ids)
    is_link = slot >= 0
    if bool(is_link.any()):
        assert links is not None, "a sample with link slots needs the link table"
        flat = links.reshape(-1, links.shape[-1]).to(device=dev, dtype=hidden.dtype)
        hidden = torch.where(is_link[:, None], flat[slot.clamp(min=0)], hidden)
    masks, positions, tables = [], [], []
    for s in samples:
        private = s.private.to(dev) if s.private is not None else None
        masks.append(kvlink_mask(s.segment.to(dev), private))
        pos = (s.positions if s.positions is not None else torch.arange(s.n)).to(dev)
        positions.append(pos)
        # Per sample: LongRoPE / dynamic NTK choose their frequencies from the largest
        # position of the call, which must be the sample's own.
        tables.append(arch.cos_sin(pos))
    cs = (_join([c for c, _ in tables]), _join([sn for _, sn in tables]))
    sizes = [s.n for s in samples]
    starts = [0, *itertools.accumulate(sizes[:-1])]
    for layer in range(arch.n_layers):
        q, k, v, _ = arch.qkv(layer, hidden, cs)  # q [H, sum N_i, D], k/v [Hkv, sum N_i, D]
        parts = [
            arch.attention(q[:, a : a + n], k[:, a : a + n], v[:, a : a + n], arch.windowed(layer, m, pos, pos))
            for a, n, m, pos in zip(starts, sizes, masks, positions)
        ]
        hidden = arch.finish_layer(layer, hidden, _join(parts))
    return list(hidden.split(sizes))


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """The samples' rows end to end (dim 0); one sample's as they are, with no copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def answer_logits(arch: Arch, sample: Sample, links: torch.Tensor | None) -> torch.Tensor:
    """Logits [T, V] predicting the T answer tokens (row t predicts ids[answer_start + t])."""
    return answer_logits_batch(arch, [sample], links)[0]


def answer_logits_batch(arch: Arch, samples: Sequence[Sample], links: torch.Tensor | None) -> list[torch.Tensor]:
    """``answer_logits`` of each of ``samples`` ([T_i, V] each) from one packed forward
    (``forward_hidden_batch``) and one LM-head call over all their answer rows."""
    hidden = forward_hidden_batch(arch, samples, links)
    rows = [h[s.answer_start - 1 : s.n - 1] for h, s in zip(hidden, samples)]
    return list(arch.logits(_join(rows)).split([r.shape[0] for r in rows]))
