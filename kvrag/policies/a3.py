"""``a3``: recompute the cached tokens the question attends to most (A3, Zhou et al. 2025).

Paper: "A3: Attention-Aware Accurate KV Cache Fusion for Fast Large Language Model Serving"
(arXiv 2511.17560), section *Attention-Aware Accurate Fusion*.

1. Position recovery (eq. 2): the engine rotates every cached (pre-RoPE) key to its global
   position.
2. Attention recovery (eq. 3-5): the embedding and decoder block 0 run on the *whole* input
   with true positions, which yields the true q/k at layer 1 (``score_layer``). Each cached
   document token ``d_i`` is scored by the question's softmax attention to it,
   ``s(d_i) = sum_j softmax(q_j K_true^T / sqrt(h))[d_i]`` (summed over question tokens ``j``).
   ``q_j`` and the rows of ``K_true`` are full-width (all heads concatenated, ``h`` the hidden
   size): one softmax over the heads' summed dot products, as the reference code's
   ``compute_attention_sum_wo_head`` (``head_reduce="concat"``; per-head softmaxes combined by
   sum/mean/max are options). The top ``p = r * n`` tokens (``Re``) plus the question ``Q`` are the only
   tokens computed from that layer on; their fresh K/V overwrite the cached rows and they
   attend to the whole fused K/V.
3. Extension (``evict_budget``): after the first token's logits, SnapKV-style eviction to a
   budget of ``C`` cache slots per layer and KV head: the system prompt (tokens before the
   first cached chunk) and the question are always kept, the other ``C - |S| - |Q|`` slots go
   to the tokens the question (SnapKV's observation window) attends to most in that layer and
   head.

Shapes: ``N`` prompt tokens, ``A`` active tokens, ``Q`` question tokens, ``H`` query heads,
``Hkv`` KV heads, ``D`` head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrag.checks import check_int
from kvrag.policies.base import Policy, RecomputeParams, param, top_indices, top_k_indices
from kvrag.policies.registry import register

HEAD_REDUCE = ("concat", "sum", "mean", "max")
RATIO_BASES = ("input", "context", "cached")


@dataclass
class A3Params(RecomputeParams):
    score_layer: int = param(
        1,
        "layer whose true q/k score the cached tokens (paper: layer 1, i.e. after block 0); "
        "layers 0..score_layer are computed for every token",
    )
    ratio_base: str = param(
        "input",
        "n in p = recompute_ratio * n: 'input' = prompt length (paper eq. 3), "
        "'context' = prompt minus question (reference code), 'cached' = cached tokens",
    )
    head_reduce: str = param(
        "concat",
        "how heads are combined: 'concat' = one softmax over the heads' concatenated "
        "q.k / sqrt(H*D) (paper eq. 3 with full-width q_j, K and sqrt(h); reference code), "
        "or per-head softmaxes combined by 'sum', 'mean' (same ranking as sum) or 'max'",
    )
    pool_kernel: int = param(
        1,
        "odd width of an average filter over the token scores before top-k (1 = none, as in "
        "eq. 3; a port of the reference code uses 5)",
    )
    evict_budget: int | None = param(
        None, "extension: KV slots kept per layer and KV head after prefill (SnapKV-style); None = no eviction"
    )
    evict_pool_kernel: int = param(5, "odd width of SnapKV's average pooling of the eviction scores (SnapKV default 5)")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.score_layer = check_int("score_layer", self.score_layer, 0)
        if self.ratio_base not in RATIO_BASES:
            raise ValueError(f"ratio_base must be one of {RATIO_BASES}, got {self.ratio_base!r}")
        if self.head_reduce not in HEAD_REDUCE:
            raise ValueError(f"head_reduce must be one of {HEAD_REDUCE}, got {self.head_reduce!r}")
        for name in ("pool_kernel", "evict_pool_kernel"):
            k = check_int(name, getattr(self, name), 1)
            if k % 2 == 0:
                raise ValueError(f"{name} must be an odd integer >= 1, got {k!r}")
            setattr(self, name, k)
        if self.evict_budget is not None:
            self.evict_budget = check_int("evict_budget", self.evict_budget, 1)


def smooth(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average filter of width ``kernel`` along the last dim of scores [..., N] (same shape);
    zero padding at the ends, as ``avg_pool1d(padding=kernel // 2)`` in SnapKV."""
    if kernel == 1:
        return scores
    shape = scores.shape
    x = scores.reshape(-1, 1, shape[-1])
    return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=True).reshape(shape)


@register
class A3(Policy):
    name = "a3"
    summary = (
        "recompute the cached tokens the question attends to most at layer 1 "
        "(+ optional SnapKV-style eviction to a KV budget)"
    )
    Params = A3Params

    # ---- helpers ---------------------------------------------------------------------
    @staticmethod
    def system_prompt(layout) -> torch.Tensor:
        """bool [N]: tokens before the first cached chunk (the paper's system prompt S)."""
        cached = layout.cached
        s = torch.zeros_like(cached)
        idx = cached.nonzero()
        if idx.numel():
            s[: int(idx[0])] = True
        return s

    def budget_p(self, state) -> int:
        """p = int(r * n) for the configured n (floored, as the reference code's int())."""
        lay = state.layout
        base = {
            "input": lay.n,
            "context": lay.n - int(lay.query.numel()),
            "cached": int(lay.cached.sum()),
        }[self.params.ratio_base]
        return int(base * self.params.recompute_ratio)

    # ---- hooks -----------------------------------------------------------------------
    def check_model(self, arch) -> None:
        L = arch.n_layers
        if self.params.score_layer >= L:
            raise ValueError(f"score_layer={self.params.score_layer} but the model has only {L} layers (0..{L - 1})")

    def check_layout(self, layout, arch) -> None:
        p = self.params
        if p.evict_budget is not None:
            protected = self.system_prompt(layout)
            protected[layout.query] = True
            need = int(protected.sum())
            if p.evict_budget < need:
                raise ValueError(
                    f"evict_budget={p.evict_budget} is smaller than the system prompt + question "
                    f"({need} tokens), which A3 always keeps"
                )

    def prepare(self, state) -> None:
        super().prepare(state)  # check_model, check_layout
        if self.params.evict_budget is not None:
            state.scratch["a3.q_obs"] = {}

    def initial_active(self, state):
        # Block 0 (and every layer up to the score layer) runs on the whole input: that is
        # how the true q/k at the score layer are obtained.
        return torch.ones(state.layout.n, dtype=torch.bool)

    @staticmethod
    def question_mask(state, layer: int, rows: torch.Tensor, device) -> torch.Tensor:
        """bool [Q, N]: keys the question rows (token indices ``rows``) may attend to: causal in
        global positions, within the layer's sliding window if any, restricted to ``state.keep``."""
        pos = state.layout.positions.to(device)
        rows = rows.to(device)
        mask = pos[rows][:, None] >= pos[None, :]
        mask = mask & state.keep.to(device)[None, :]
        return state.arch.windowed(layer, mask, pos[rows], pos)

    def question_attention(
        self, state, layer: int, q_obs: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """Per-head softmax attention of question rows at ``layer``. q_obs [H, Q, D], keys
        [Hkv, N, D], rows [Q] (token indices of the question rows) -> probs [H, Q, N]."""
        mask = self.question_mask(state, layer, rows, keys.device)
        return state.arch.attention_probs(q_obs, keys, mask)

    def headless_attention(
        self, state, layer: int, q_obs: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """Eq. 3's softmax with full-width vectors: each question row's q (all H heads
        concatenated) against each key (its KV head repeated for the query heads sharing it,
        GQA), scaled by 1/sqrt(H*D) -- the model's per-head scale / sqrt(H) -- one softmax per
        row. q_obs [H, Q, D], keys [Hkv, N, D] -> probs [Q, N]."""
        arch = state.arch
        H, nq, D = q_obs.shape
        k = arch.per_query_head(keys.float())  # [H, N, D]
        qf = q_obs.float().transpose(0, 1).reshape(nq, H * D)
        kf = k.transpose(0, 1).reshape(k.shape[1], H * D)
        scores = (qf @ kf.T) * (arch.scaling / math.sqrt(H))
        mask = self.question_mask(state, layer, rows, keys.device)
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)

    def select(self, layer, state, q, k, v):
        p = self.params
        if p.evict_budget is not None:
            self._stash_observation(layer, state, q)
        if layer != p.score_layer:
            return None
        active = state.active
        dev = active.device
        n = state.layout.n
        in_q = torch.zeros(n, dtype=torch.bool, device=dev)
        in_q[state.layout.query.to(dev)] = True
        q_rows = in_q[active].nonzero().squeeze(1)  # positions into active
        # Every token is active up to the score layer, so the fresh k are the true keys of the
        # whole input; the general branch covers a narrower active set defensively.
        if active.numel() == n:
            keys = k
        else:
            keys = state.K[layer].clone()
            keys[:, active] = k
        if p.head_reduce == "concat":
            # [Q, N] summed over question tokens (eq. 3)
            score = self.headless_attention(state, layer, q[:, q_rows], keys, active[q_rows]).sum(0)
        else:
            probs = self.question_attention(state, layer, q[:, q_rows], keys, active[q_rows])  # [H, Q, N]
            per_head = probs.sum(dim=1)  # [H, N]: summed over question tokens (eq. 3)
            if p.head_reduce == "sum":
                score = per_head.sum(0)
            elif p.head_reduce == "mean":
                score = per_head.mean(0)
            else:
                score = per_head.amax(0)
        score = smooth(score, p.pool_kernel)  # [N]
        state.scratch["a3.scores"] = score

        cached = state.layout.cached.to(dev)
        cand = cached & ~in_q  # question tokens are recomputed anyway: budget goes to documents
        cand_rows = cand[active]
        row_score = score[active].masked_fill(~cand_rows, float("-inf"))
        k_keep = min(self.budget_p(state), int(cand_rows.sum()))
        chosen = top_indices(row_score, k_keep)
        keep_rows = (~cached[active]) | in_q[active]
        keep_rows[chosen] = True
        return keep_rows.nonzero().squeeze(1)

    # ---- extension: SnapKV-style eviction --------------------------------------------
    def _stash_observation(self, layer, state, q) -> None:
        """Keep the question rows' q [H, Q', D] of this layer (Q' = question tokens active
        here) for the eviction scores computed once the K are final."""
        active = state.active
        in_q = torch.zeros(state.layout.n, dtype=torch.bool, device=active.device)
        in_q[state.layout.query.to(active.device)] = True
        rows = in_q[active].nonzero().squeeze(1)
        state.scratch["a3.q_obs"][layer] = (q[:, rows].clone(), active[rows].clone())

    def after_prefill(self, state) -> None:
        p = self.params
        if p.evict_budget is None:
            return
        arch = state.arch
        dev = state.K[0].device
        n = state.layout.n
        keep = state.keep.to(dev)
        if p.evict_budget >= int(keep.sum()):
            return  # already within budget
        protected = self.system_prompt(state.layout).to(dev)
        protected[state.layout.query.to(dev)] = True
        protected &= keep
        cand = keep & ~protected
        n_free = p.evict_budget - int(protected.sum())
        prot_idx = protected.nonzero().squeeze(1)
        group = arch.n_heads // arch.n_kv_heads
        kv_index = []
        for layer in range(arch.n_layers):
            q_obs, rows = state.scratch["a3.q_obs"][layer]
            # The K here are final (recomputed rows written), i.e. what decoding would read.
            probs = self.question_attention(state, layer, q_obs, state.K[layer], rows)  # [H, Q, N]
            votes = probs.sum(dim=1)  # [H, N]
            # GQA: query heads sharing a KV head vote together for that head's slots.
            votes = votes.view(arch.n_kv_heads, group, n).sum(dim=1)  # [Hkv, N]
            votes = smooth(votes, p.evict_pool_kernel)
            votes = votes.masked_fill(~cand[None, :], float("-inf"))
            top = top_k_indices(votes, n_free)  # [Hkv, n_free]
            idx = torch.cat([prot_idx.expand(arch.n_kv_heads, -1), top], dim=1)
            kv_index.append(idx.sort(dim=-1).values)
        state.kv_index = kv_index
        state.scratch.pop("a3.q_obs", None)
