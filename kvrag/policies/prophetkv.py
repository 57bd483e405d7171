"""``prophetkv``: recompute the cached tokens the user's question needs, ranked by its attention
fused over several layers (ProphetKV, Wang et al., ICML 2026, arXiv 2602.02579).

The paper's observation (the *crowding-out effect*): a selection by global salience -- CacheBlend's
KV deviation, EPIC's chunk edges -- spends the recompute budget on tokens that matter to the
passages' own reading but not to the question, and the tokens that carry the answer are left
stale. ProphetKV ranks cached tokens by their relevance to the user query instead, and runs a
two-stage recompute that fuses layer-wise attention into one ranking.

As built here (docs/policies.md lists what the paper's public text leaves open and what was
chosen):

1. Stage 1, dense probe: layers ``0 .. score_layers[-1]`` compute *every* token, so at each
   score layer the question's queries meet the true (cross-attended) keys of the context.
   At each score layer ``l`` the relevance of context token ``j`` is the question's attention
   to it, ``a_l(j) = sum_{h, i in Q} softmax_j(q_{h,i} . k_{h,j} * scale)``, the softmax taken
   per head over the *context* (the tokens before the question; the question's attention to
   itself is not a budget candidate), within the layer's sliding window if it has one.
2. Layer fusion: every ``a_l`` holds the same mass (``H x |Q|``), so the layers weigh alike;
   ``fusion="mean"`` sums them (a token relevant across depth wins), ``"max"`` keeps each
   token's best layer.
3. Stage 2, sparse recompute: after the last score layer only the top
   ``recompute_ratio x (cached tokens)`` cached tokens (and the non-cached ones, which the
   engine always computes) stay computed through the remaining layers, attending to the whole
   fused K/V. Ties within ``tie_tolerance`` (of the fused score as a share of the question's
   attention) go to the earlier position, so a selection does not depend on the device's
   summation order.

Cost: one narrowing of the active set (as CacheBlend), and per score layer one small
``[H, |Q|, context]`` attention of the question rows: a fixed number of ops whatever the
number of chunks.

Shapes: ``N`` prompt tokens, ``C`` context tokens (before the question), ``Q`` question
tokens, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.checks import check_int, check_real, check_seq
from kvrag.layout.state import CACHED
from kvrag.policies.base import Policy, RecomputeParams, param
from kvrag.policies.registry import register

FUSIONS = ("mean", "max")


@dataclass
class ProphetKVParams(RecomputeParams):
    recompute_ratio: float = param(0.2, "fraction of cached tokens recomputed after the probe (paper: 20%)")
    score_layers: tuple | None = param(
        None,
        "layers whose question attention is fused into the ranking; every token is computed up "
        "to the last of them (stage 1), the selected ones after it (stage 2); None: (1, 2), or "
        "the first global layer where layer 1 or 2 has a sliding window",
    )
    fusion: str = param("mean", "how the layers' attention combines: 'mean' (sum of equal-mass layers) or 'max'")
    tie_tolerance: float = param(
        1e-6,
        "fused scores (as a share of the question's attention) this close rank by position, earlier first",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.score_layers is not None:
            layers = check_seq("score_layers", self.score_layers, "a sequence of layer indices, e.g. (1, 2)")
            self.score_layers = tuple(check_int("score_layers entry", x, 0) for x in layers)
            if not self.score_layers or list(self.score_layers) != sorted(set(self.score_layers)):
                raise ValueError(f"score_layers must be a non-empty increasing list, got {self.score_layers}")
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {self.fusion!r}")
        self.tie_tolerance = check_real("tie_tolerance", self.tie_tolerance, 0.0, 1.0)
        if self.tie_tolerance == 0.0:
            raise ValueError("tie_tolerance must be > 0 (it is the grid ties are read on)")


def default_score_layers(arch) -> tuple[int, ...]:
    """The score layers when none are given: (1, 2), where both see the whole context (layer
    0's attention is mostly positional and lexical). A local layer (sliding window) sees only
    the last ``window`` tokens from the question, so every older token would score 0 there:
    on a model whose layer 1 or 2 is local (Gemma 2/3) the first global layer after layer 0
    is the score layer, and on a model with no global layer at all, (1, 2) (clamped to the
    model's depth) is all there is."""
    L = arch.n_layers
    if L < 2:
        return (0,)
    early = tuple(range(1, min(3, L)))
    if all(arch.windows[i] is None for i in early):
        return early
    first_global = next((i for i in range(1, L) if arch.windows[i] is None), None)
    return (first_global,) if first_global is not None else early


def ranked_top(scores: torch.Tensor, k: int, grid: float, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``k`` best finite ``scores`` [M], best first, never one where ``exclude``
    (bool [M]) is set. Scores are read on a grid of step ``grid`` and equal grid values rank
    by index (earlier first): a stable sort, so the choice among near-ties is the same on every
    device and summation order."""
    k = max(0, min(int(k), scores.numel()))
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    snapped = torch.div(scores.float(), grid, rounding_mode="floor")
    if exclude is not None:
        # After the division: a floor division of -inf is NaN, which sorts first.
        snapped = snapped.masked_fill(exclude, float("-inf"))
    return torch.sort(snapped, descending=True, stable=True).indices[:k]


@register
class ProphetKV(Policy):
    name = "prophetkv"
    summary = (
        "recompute the ~20% cached tokens the question attends to most, its attention fused "
        "over early layers that see the whole context (counters CacheBlend's crowding-out by "
        "query-irrelevant tokens)"
    )
    Params = ProphetKVParams

    def score_layers(self, arch) -> tuple[int, ...]:
        """The layers this policy scores at on ``arch``: its ``score_layers``, or the model's
        default (``default_score_layers``)."""
        given = self.params.score_layers
        return tuple(given) if given is not None else default_score_layers(arch)

    def check_model(self, arch) -> None:
        L = arch.n_layers
        layers = self.score_layers(arch)
        if layers[-1] >= L:
            raise ValueError(f"score_layers={layers} but the model has only {L} layers (0..{L - 1})")

    def prepare(self, state) -> None:
        super().prepare(state)  # check_model, check_layout
        lay = state.layout
        # Host-side arithmetic only (no tensor ops): the question is the trailing span
        # (Layout.build), and the cached count comes from the pieces.
        qs = lay.n - lay.query.numel()
        n_cached = sum(end - start for _, start, end in lay.spans(CACHED))
        k = int(n_cached * self.params.recompute_ratio)
        state.scratch["prophetkv.plan"] = (qs, k, self.score_layers(state.arch))
        state.scratch.setdefault("policy_stats", {})["prophetkv.selected"] = k

    def initial_active(self, state):
        # Stage 1 computes every token up to the last score layer: that is how the question's
        # queries meet the context's true keys there.
        return torch.ones(state.layout.n, dtype=torch.bool)

    def question_logits(self, layer: int, state, q: torch.Tensor, k: torch.Tensor, qs: int) -> torch.Tensor:
        """The question rows' attention logits over the context at ``layer``: q [H, N, D], k
        [Hkv, N, D] of every token (stage 1), qs = first question row -> float32 [Hkv, g*Q, C]
        (g = H / Hkv query heads per KV head, C = qs), soft-capped where the model caps them
        (Gemma 2), -inf outside the layer's sliding window if it has one."""
        arch = state.arch
        H, n, D = q.shape
        hkv = k.shape[0]
        # Scaling first makes the question rows one contiguous block, so the query heads that
        # share a KV head (GQA) stack into one batch without repeating the keys.
        qq = (q[:, qs:].float() * arch.scaling).reshape(hkv, (H // hkv) * (n - qs), D)
        logits = torch.bmm(qq, k[:, :qs].float().transpose(1, 2))
        if arch.attn_softcap is not None:
            logits = torch.tanh(logits / arch.attn_softcap) * arch.attn_softcap
        pos = state.layout.positions
        window = arch.window_mask(layer, pos[qs:].to(q.device), pos[:qs].to(q.device))  # [Q, C] or None
        if window is not None:
            logits = logits.masked_fill(~window.repeat(H // hkv, 1).unsqueeze(0), float("-inf"))
        return logits

    def fused_scores(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """Layer fusion of the score layers' logits (each [Hkv, g*Q, C]) -> [C]: per layer, head
        and question row a softmax over the context (each layer so holds the same mass H x Q);
        'mean' sums the layers, 'max' keeps each token's best layer. One softmax over the
        stacked layers, whatever their number."""
        probs = torch.softmax(torch.stack(logits) if len(logits) > 1 else logits[0][None], dim=-1)
        if self.params.fusion == "mean":
            return probs.sum(dim=(0, 1, 2))
        return probs.sum(dim=(1, 2)).amax(dim=0)

    def select(self, layer, state, q, k, v):
        p = self.params
        qs, budget, score_layers = state.scratch["prophetkv.plan"]
        if layer not in score_layers:
            return None
        if qs == 0:
            return None  # no context before the question: nothing to rank
        logits = state.scratch.setdefault("prophetkv.logits", [])
        logits.append(self.question_logits(layer, state, q, k, qs))
        if layer != score_layers[-1]:
            return None
        score = self.fused_scores(logits)
        state.scratch["prophetkv.score"] = score
        del state.scratch["prophetkv.logits"]
        # Stage 2. Only cached tokens compete for the budget (the engine computes the others).
        plain = (state.layout.kind[:qs] != CACHED).to(score.device)
        # Fused mass as a share of the question's attention: H x Q per layer ('mean' sums them).
        H, nq = q.shape[0], state.layout.n - qs
        layers = len(logits) if p.fusion == "mean" else 1
        # Rows are token indices here (every token is active in stage 1); the engine needs no
        # order, so the selection is returned as ranked.
        return ranked_top(score, budget, p.tie_tolerance * H * nq * layers, exclude=plain)
