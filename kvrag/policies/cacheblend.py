"""``cacheblend``: recompute the tokens whose K/V deviate most (CacheBlend, EuroSys'25).

Layer 0 and the check layers are computed for every token (that is how the true K/V are
known); at a check layer the value deviation ``d_i = sum_{h,d} (V_new - V_cached)^2`` of each
cached token ranks them, and only the top fraction (the HKVD tokens) stays computed from that
layer on. Several check layers with shrinking ratios implement the paper's *gradual
filtering*; the reference code's default is one check layer (layer 1).

``deviation="attention"`` is kvrag's cheaper estimate of the same ranking, not the paper's: the
check costs layer 0 for every token (its MLP is most of a layer) and layer 1's projections. A
cached token's K/V at layer 1 deviate because its layer-0 attention read other passages; that
read is measured directly, at layer 0, from the projections alone: ``d_i = sum_{h,d} (o_i -
o_i^own)^2``, ``o_i`` token ``i``'s layer-0 attention output over the whole prompt and
``o_i^own`` over its own passage and the prompt's first token (the sink the passage was
precomputed behind). Only the chosen tokens then run layer 0's attention and MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.arch import visible_keys
from kvrag.checks import check_int, check_real, check_seq
from kvrag.policies.base import Policy, RecomputeParams, param, top_indices
from kvrag.policies.registry import register

DEVIATIONS = ("value", "attention")
#: Rows of the attention-deviation estimate per attention call: at most this many float32
#: scores ([H, rows, N]) exist at once, so a long prompt is ranked in row blocks.
SCORE_BUDGET = 1 << 24


@dataclass
class CacheBlendParams(RecomputeParams):
    check_layers: tuple = param((1,), "layers where deviation is measured and tokens are filtered")
    layer_ratios: tuple | None = param(
        None,
        "gradual filtering: ratio kept at each check layer (when given, it replaces "
        "recompute_ratio: its last entry is the final ratio); None = recompute_ratio at every check layer",
    )
    deviation: str = param(
        "value",
        "what ranks the cached tokens: 'value' (the paper) = V deviation at check_layers, every "
        "token computed up to there; 'attention' (kvrag's estimate, cheaper) = at layer 0, how much "
        "a token's attention output changes between the whole prompt and its own passage "
        "(check_layers and layer_ratios do not apply)",
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
        if self.deviation not in DEVIATIONS:
            raise ValueError(f"deviation must be one of {DEVIATIONS}, got {self.deviation!r}")
        if self.deviation == "attention" and (self.check_layers != (1,) or self.layer_ratios is not None):
            raise ValueError(
                "deviation='attention' ranks once, at layer 0: check_layers and layer_ratios do not "
                f"apply (got check_layers={self.check_layers}, layer_ratios={self.layer_ratios})"
            )


def attention_deviation(state, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Layer 0 with every token active: q [H, N, D], k/v [Hkv, N, D] (rotated keys) -> float32
    [N], per token ``sum_{h,d} (o - o_own)^2`` of its attention output [H*D] over every earlier
    token (``o``) and over its own piece and the prompt's first token (``o_own``), both within
    the layer's sliding window if it has one. Both outputs of a row block come from one
    attention call (queries stacked twice, one mask each). Every row is scored, not only the
    cached ones: contiguous row blocks are views, where gathering the cached rows would cost
    ops per block. A block reads only the keys its rows can see: none after its last row
    (positions follow prompt order) and, under a sliding window, only the first token before
    the window of its first row, so the check costs a causal (or windowed) attention, not a
    square one."""
    arch, lay = state.arch, state.layout
    host_pos = lay.positions
    pos, seg = host_pos.to(q.device), lay.segment.to(q.device)
    n = pos.numel()
    window = arch.windows[0]
    block = max(1, SCORE_BUDGET // (2 * q.shape[0] * n))
    blocks = [(lo, min(n, lo + block)) for lo in range(0, n, block)]
    # Each block's keys [first, end): every key for one block (it reads them all anyway);
    # with positions in prompt order, bounds read from the host copy (no device sync).
    bounds = [(0, n)] * len(blocks)
    if len(blocks) > 1 and lay.in_prompt_order:
        los, lasts = [lo for lo, _ in blocks], [hi - 1 for _, hi in blocks]
        firsts, ends = visible_keys(host_pos, host_pos[los].tolist(), host_pos[lasts].tolist(), window)
        bounds = list(zip(firsts, ends))
    out = []
    for (lo, hi), (first, end) in zip(blocks, bounds):
        kb, vb, pk, sk = k, v, pos, seg
        if first > 1:  # the sink, then the block's window: a copy of what the window holds
            keys = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(first, end)]).to(q.device)
            kb, vb, pk, sk = k[:, keys], v[:, keys], pos[keys], seg[keys]
        elif end < n:  # a prefix: views
            kb, vb, pk, sk = k[:, :end], v[:, :end], pos[:end], seg[:end]
        whole = pk[None, :] <= pos[lo:hi, None]  # [B, K]
        in_window = arch.window_mask(0, pos[lo:hi], pk)
        if in_window is not None:
            whole = whole & in_window
        own = whole & (sk[None, :] == seg[lo:hi, None])
        own[:, 0] = whole[:, 0]  # the sink (key 0, always read): every passage was precomputed behind it
        o = arch.attention(q[:, lo:hi].repeat(1, 2, 1), kb, vb, torch.cat([whole, own])).float()  # [2B, H*D]
        out.append(((o[: hi - lo] - o[hi - lo :]) ** 2).sum(dim=-1))
    return out[0] if len(out) == 1 else torch.cat(out)


@register
class CacheBlend(Policy):
    name = "cacheblend"
    summary = "recompute the ~15% cached tokens with the largest KV deviation at the check layer(s)"
    Params = CacheBlendParams

    def check_model(self, arch) -> None:
        if self.params.deviation == "attention":
            return  # ranks at layer 0, which every model has
        L = arch.n_layers
        if self.params.check_layers[-1] >= L:
            raise ValueError(f"check_layers={self.params.check_layers} but the model has only {L} layers (0..{L - 1})")

    def initial_active(self, state):
        # Everything is computed until the first check layer has ranked the tokens (with
        # deviation="attention", only layer 0's projections: the ranking narrows before its attention).
        return torch.ones(state.layout.n, dtype=torch.bool)

    def ratio_at(self, i: int) -> float:
        p = self.params
        return p.layer_ratios[i] if p.layer_ratios is not None else p.recompute_ratio

    def select(self, layer, state, q, k, v):
        p = self.params
        if p.deviation == "attention":
            return self.select_by_attention(state, q, k, v) if layer == 0 else None
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
        # The rows it must compute stay (a kept prefix's exact rows need not).
        required = state.required.to(active.device)[active]
        return torch.cat([chosen, required.nonzero().squeeze(1)]).unique()

    def rows_fixed_after(self) -> int | None:
        p = self.params
        return 0 if p.deviation == "attention" else p.check_layers[-1]

    def select_by_attention(self, state, q, k, v):
        """Layer 0's selection under ``deviation="attention"``: every token is active (row ==
        token index), so the chosen cached tokens are returned as token indices; the engine
        keeps the non-cached ones computed."""
        rows = state.layout.cached.nonzero().squeeze(1).to(q.device)
        k_keep = int(rows.numel() * self.params.recompute_ratio)
        return rows[top_indices(attention_deviation(state, q, k, v)[rows], k_keep)]
