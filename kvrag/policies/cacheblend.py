"""``cacheblend``: recompute the tokens whose K/V deviate most (CacheBlend, EuroSys'25).

Layer 0 and the check layers are computed for every token (that is how the true K/V are
known); at a check layer the value deviation ``d_i = sum_{h,d} (V_new - V_cached)^2`` of each
cached token ranks them, and only the top fraction (the HKVD tokens) stays computed from that
layer on. Several check layers with shrinking ratios implement the paper's *gradual
filtering*; the reference code's default is one check layer (layer 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.checks import check_int, check_real, check_seq
from kvrag.policies.base import Policy, RecomputeParams, param, top_indices
from kvrag.policies.registry import register


@dataclass
class CacheBlendParams(RecomputeParams):
    check_layers: tuple = param((1,), "layers where deviation is measured and tokens are filtered")
    layer_ratios: tuple | None = param(
        None,
        "gradual filtering: ratio kept at each check layer (when given, it replaces "
        "recompute_ratio: its last entry is the final ratio); None = recompute_ratio at every check layer",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = check_seq("check_layers", self.check_layers, "a sequence of layer indices, e.g. (1,)")
        self.check_layers = tuple(check_int("check_layers entry", x, 0) for x in layers)
        if not self.check_layers or list(self.check_layers) != sorted(set(self.check_layers)):
            raise ValueError(f"check_layers must be a non-empty increasing list, got {self.check_layers}")
        if self.check_layers[0] < 1:
            raise ValueError("check_layers must be >= 1 (layer 0 is always fully computed)")
        if self.layer_ratios is not None:
            ratios = check_seq("layer_ratios", self.layer_ratios, "a sequence of ratios or None")
            self.layer_ratios = tuple(check_real("layer_ratios entry", r, 0.0, 1.0) for r in ratios)
            if len(self.layer_ratios) != len(self.check_layers):
                raise ValueError("layer_ratios needs one ratio per check layer")


@register
class CacheBlend(Policy):
    name = "cacheblend"
    summary = "recompute the ~15% cached tokens with the largest KV deviation at the check layer(s)"
    Params = CacheBlendParams

    def check_model(self, arch) -> None:
        L = arch.n_layers
        if self.params.check_layers[-1] >= L:
            raise ValueError(f"check_layers={self.params.check_layers} but the model has only {L} layers (0..{L - 1})")

    def initial_active(self, state):
        # Everything is computed until the first check layer has ranked the tokens.
        return torch.ones(state.layout.n, dtype=torch.bool)

    def ratio_at(self, i: int) -> float:
        p = self.params
        return p.layer_ratios[i] if p.layer_ratios is not None else p.recompute_ratio

    def select(self, layer, state, q, k, v):
        p = self.params
        if layer not in p.check_layers:
            return None
        i = p.check_layers.index(layer)
        active = state.active
        cached_rows = state.layout.cached.to(active.device)[active]
        # Deviation of values only, as in the reference implementation (keys differ by
        # position too, which is not the error we want to rank by).
        old_v = state.V[layer][:, active]
        dev = ((v.float() - old_v.float()) ** 2).sum(dim=(0, 2))  # [A]
        dev = dev.masked_fill(~cached_rows, float("-inf"))
        n_cached = int(state.layout.cached.sum())
        k_keep = int(n_cached * self.ratio_at(i))
        k_keep = min(k_keep, int(cached_rows.sum()))
        chosen = top_indices(dev, k_keep)
        return torch.cat([chosen, (~cached_rows).nonzero().squeeze(1)]).unique()
