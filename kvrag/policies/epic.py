"""``epic``: recompute the first (and optionally last) tokens of every cached chunk (EPIC's
LegoLink; Hu et al., "EPIC: Efficient Position-Independent Context Caching for Serving Large
Language Models", arXiv 2410.15332).

Every chunk was prefilled without its context (from position 0, or behind kvrag's anchor
token), so its first tokens carry what a prompt start carries (attention sinks, with no
anchor) and soak up or misdirect attention in the fused prompt. LegoLink recomputes those few tokens at every
layer (a static choice: no check layer, no scoring), together with the non-cached tokens
(template, question), and reuses everything else. A3's paper describes LegoLink as
recomputing "a few initial and final tokens within each text chunk", hence ``k_tail``.

Cost: recompute fraction = (k_head + k_tail) x chunks / cached tokens (fewer when a chunk is
shorter than k_head + k_tail), the same at every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.checks import check_int
from kvrag.policies.base import Policy, param
from kvrag.policies.registry import register


@dataclass
class EpicParams:
    k_head: int = param(32, "tokens recomputed at the start of every cached chunk (EPIC: tens suffice)")
    k_tail: int = param(0, "tokens recomputed at the end of every cached chunk")

    def __post_init__(self) -> None:
        for name in ("k_head", "k_tail"):
            setattr(self, name, check_int(name, getattr(self, name), 0))


@register
class Epic(Policy):
    name = "epic"
    summary = "recompute the first k_head (and last k_tail) tokens of every cached chunk at every layer"
    Params = EpicParams

    def recompute_mask(self, layout) -> torch.Tensor:
        """bool [N]: the head/tail tokens of each cached chunk."""
        # From each token's offset in its piece: a fixed number of ops whatever the number of
        # chunks (the fusion engine's ops should not grow with it, policy hooks included).
        spans = layout.spans()
        starts = torch.tensor([s for _, s, _ in spans], dtype=torch.long)[layout.segment]
        ends = torch.tensor([e for _, _, e in spans], dtype=torch.long)[layout.segment]
        offset = torch.arange(layout.n) - starts
        edge = offset < self.params.k_head
        if self.params.k_tail:
            edge |= (ends - starts - offset) <= self.params.k_tail
        return layout.cached & edge

    def initial_active(self, state):
        # The engine adds the non-cached tokens; nothing is narrowed later (select -> None),
        # so these tokens are computed at every layer.
        return self.recompute_mask(state.layout)
