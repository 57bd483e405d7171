"""The reuse-policy interface.

A policy is one algorithm (CacheBlend, A3, EPIC, KVLink, SamKV, A2ATS, ...) behind a handful
of hooks the fusion engine calls in a fixed order. The engine never names a policy: it only
calls these hooks, so adding a policy means adding one small class and registering it.

Query-time call order (see ``kvrag.query.fusion.FusionEngine.prefill``):

1. ``insertions(layout, arch)``  extra tokens after segments (KVLink link tokens)
2. ``prepare(state)``            anything before layer 0 (SamKV's query vector, keep masks)
3. ``initial_active(state)``     tokens computed at layer 0
4. per layer ``select(layer, state, q, k, v)``  narrow the set of computed tokens
5. per layer ``extra_mask(state, rows)``        extra attention restrictions
6. ``after_prefill(state)``      eviction, decode-time indices
7. per decode step ``decode_select(layer, q, state)`` (only if the policy overrides it)

Ingestion time: ``chunk_extras(arch, keys, values, token_ids)`` adds per-chunk tensors stored
beside the chunk's K/V (A2ATS codes, SamKV's per-chunk query-independent results).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvrag.checks import check_real

if TYPE_CHECKING:  # pragma: no cover
    from kvrag.arch import Arch
    from kvrag.layout.state import FusionState, Layout


@dataclass
class NoParams:
    """A policy without hyper-parameters."""


def param(default, help: str, **kw):
    """A documented hyper-parameter (``kvrag policies`` prints the help)."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


class Policy:
    """Base class: the defaults are exactly ``naive_reuse`` (compute only non-cached tokens,
    keep everything, no inserted tokens, exact attention at decode time)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: What must be done once (per model) before the policy can run; shown by ``kvrag policies``.
    setup: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    #: False: the engine skips fusion and runs the model's own forward on all tokens.
    uses_cache: ClassVar[bool] = True

    def __init__(self, **params) -> None:
        names = {f.name for f in dataclasses.fields(self.Params)}
        unknown = sorted(set(params) - names)
        if unknown:
            raise ValueError(
                f"policy {self.name!r} has no parameter(s) {unknown}; its parameters are {sorted(names) or 'none'}"
            )
        self.params = self.Params(**params)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError on out-of-range hyper-parameters."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"

    def check_model(self, arch: Arch) -> None:
        """Raise (ValueError, or a KVRagError naming the fix) if this policy cannot run on
        ``arch``'s model: a layer it names that the model lacks, a per-model artefact it needs.
        ``prepare`` runs it on every fused prefill; a ``KVRag`` also runs it when it adopts the
        policy as its default, so a misconfiguration fails at construction rather than at the
        first prompt with a cached chunk (prompts without one never reach the policy)."""

    def check_layout(self, layout: Layout, arch: Arch) -> None:
        """Raise ValueError if this policy cannot serve ``layout`` (A3: an eviction budget
        smaller than the tokens it always keeps). Runs before the prefill, so a ``stream``
        fails at the call; ``prepare`` runs it too. Default: every layout is fine."""

    @classmethod
    def forget(cls) -> None:
        """Drop what the policy remembers across queries in this process (per-chunk results it
        computed at query time and memoized). Benchmarks of the cold path call it before every
        timed run, so they report what a chunk's first query costs. Default: nothing kept."""

    # ---- ingestion -------------------------------------------------------------------
    def chunk_extras(
        self, arch: Arch, keys: torch.Tensor, values: torch.Tensor, token_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Extra per-chunk tensors to store with the chunk. keys/values: [L, Hkv, T, D] (keys
        pre-RoPE) as stored, i.e. already rounded to the storage dtype, so extras match what a
        query computes from the stored chunk; token_ids: long [T]. Names must be prefixed with
        the policy name ("a2ats.codes")."""
        return {}

    # ---- query time ------------------------------------------------------------------
    def insertions(self, layout: Layout, arch: Arch) -> dict[int, torch.Tensor]:
        """Tokens to insert: {segment index: embeddings [m, E]} placed right after that
        segment, computed at query time like plain tokens."""
        return {}

    def prepare(self, state: FusionState) -> None:
        """Called once before layer 0; may set ``state.keep`` or stash data in ``state.scratch``.
        The default runs ``check_model`` and ``check_layout``."""
        self.check_model(state.arch)
        self.check_layout(state.layout, state.arch)

    def initial_active(self, state: FusionState) -> torch.Tensor:
        """bool [N]: tokens whose hidden states are computed from layer 0 on. The engine adds
        every token it must compute (``FusionState.required``: neither cached nor a kept
        prefix, and the last, whose logits are the first output). A kept prefix's rows are
        exact: a policy that activates them (to read their fresh projections) may drop them
        when it narrows."""
        return ~state.layout.stored

    def select(self, layer: int, state: FusionState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Narrow the computed set at ``layer``.

        q [H, A, D], k/v [Hkv, A, D] are the active tokens' fresh (rotated) projections;
        ``state.K[layer]``/``state.V[layer]`` [Hkv, N, D] still hold the *old* rows, so a policy
        can measure deviation. Return a LongTensor of positions into ``state.active`` that
        keep being computed (their outputs at this layer and all later layers), or None.
        All active K/V rows are written back whatever is returned."""
        return None

    def extra_mask(self, state: FusionState, rows: torch.Tensor) -> torch.Tensor | None:
        """bool [A, N] AND-ed with the causal/keep mask for the active query ``rows`` [A]."""
        return None

    def after_prefill(self, state: FusionState) -> None:
        """Called after the last layer, before the cache is handed to the decoder."""

    def rows_fixed_after(self) -> int | None:
        """The last layer whose ``select`` may narrow the computed rows: -1 if none does, None
        if any may or ``extra_mask`` masks more than causality. From the layer after it the
        hooks are inert (None, no side effect to skip) and the fusion engine may run the rest
        of its loop as one compiled graph. A policy that overrides either hook says when."""
        if type(self).extra_mask is not Policy.extra_mask:
            return None
        return -1 if type(self).select is Policy.select else None

    #: Set to a method ``decode_select(layer, q, state) -> LongTensor | None`` (q [H, 1, D];
    #: returns cache slots to attend to: [R] shared by all KV heads, or [Hkv, R] one row set
    #: per KV head) to get a decode loop that calls it at every layer.
    decode_select: Callable[..., Any] | None = None


@dataclass
class RecomputeParams:
    """Shared by the recompute-selection policies."""

    recompute_ratio: float = param(0.15, "fraction of cached tokens recomputed (0..1)")

    def __post_init__(self) -> None:
        self.recompute_ratio = check_real("recompute_ratio", self.recompute_ratio, 0.0, 1.0)


# Ties within a tolerance, broken by position. Scores that are equal in exact arithmetic
# (two blocks' z-scores averaged over heads, a token's deviation in two documents) come out of
# float rounding a few ulps apart, and which way depends on the order of the operations: the
# batched and the per-document code, the CPU vendor's kernels, the GPU. A selection that
# compared them raw would hang on that rounding. So every ranking first rounds each score to a
# grid of 2**TIE_GRID_LOG2 times the largest |score| being ranked (that scale rounded down to a
# power of two, so two implementations whose scales differ by rounding share the grid: 4 to 8
# float32 ulps of the largest score, far above the rounding noise of these sums, far below any
# difference a policy means), then orders equal grid values by position, the earlier first.
# Rounding, not a position-ordered epsilon added to the scores: it never changes how many are
# chosen (exact limits: ratio 1 keeps all, 0 none), never lifts a masked -inf score, and does
# not grow with the number of tokens as an epsilon times the position would.
TIE_GRID_LOG2 = -18
_TIE_GRID = 2 ** (-TIE_GRID_LOG2)  # grid values lie in [-_TIE_GRID, _TIE_GRID]


def rank_keys(scores: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Integer keys [..., M] (int64) of ``scores`` [..., M], ranked along the last dim: a larger
    key ranks first, scores equal on the tie grid rank by position (earlier first), and no two
    keys of a row are equal, so ``torch.topk`` / ``argsort`` of them are deterministic on every
    device. -inf (masked) ranks last, NaN below it. ``scale``: the magnitude the grid is
    relative to, where the row alone does not show it (scores that are all rounding noise
    around 0 must tie, not be ranked by that noise); default the row's largest finite |score|."""
    x = scores.float()
    m = x.shape[-1]
    finite = torch.isfinite(x)
    if scale is None:
        ref = torch.where(finite, x.abs(), 0.0).amax(-1, keepdim=True)
    else:
        ref = torch.full((1,), abs(float(scale)), dtype=x.dtype, device=x.device)
    _, exp = torch.frexp(ref)  # ref = f * 2**exp, 0.5 <= f < 1 (exp 0 for 0)
    step = torch.ldexp(torch.ones_like(ref), exp.to(x.dtype) + TIE_GRID_LOG2)
    grid = torch.round(torch.where(finite, x, 0.0) / step)  # exact: a power-of-two step, |grid| <= 2**18
    grid = torch.where(finite, grid, torch.where(x > 0, _TIE_GRID + 1.0, -_TIE_GRID - 1.0))
    grid = torch.where(torch.isnan(x), -_TIE_GRID - 2.0, grid).long()
    pos = torch.arange(m, device=x.device)
    return grid * m + (m - 1 - pos)


def top_k_indices(scores: torch.Tensor, k: int, scale: float | None = None) -> torch.Tensor:
    """Indices [..., k] of the ``k`` largest ``scores`` [..., M] along the last dim, largest
    first, ties within the tie grid going to the earlier position (``scale``: see rank_keys)."""
    return torch.topk(rank_keys(scores, scale), k, dim=-1).indices


def order_by_score(scores: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Every index [M] of ``scores`` [M], largest first, ties within the tie grid by position."""
    return torch.argsort(rank_keys(scores, scale), descending=True)


def top_indices(scores: torch.Tensor, k: int, scale: float | None = None) -> torch.Tensor:
    """Indices of the ``k`` largest ``scores`` [M] (ties within the tie grid: the earlier
    position), sorted ascending (positions order)."""
    k = max(0, min(int(k), scores.numel()))
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    return top_k_indices(scores, k, scale).sort().values
