"""SamKV's block selection (paper §3.1-3.2, A.2): documents split into always-kept initial and
local spans and middle blocks, the personalized queries (eq. 1), the anchor-based share of
blocks kept per document (eq. 2-3), and the cross-context filter that ranks every document's
candidate blocks against one budget. Pure tensor math on what the preliminary pass computed.

Shapes: ``S`` stable layers, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim, ``N`` prompt
tokens, ``Dd`` documents, ``B`` middle blocks of all documents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvrag.policies.base import order_by_score, rank_keys

#: How a document's block scores are normalized before the cross-context filter pools them.
NORMALIZATIONS = ("minmax", "zscore", "none")


@dataclass
class DocBlocks:
    """One cached document ``[start, end)`` in prompt positions: its always-kept initial and
    local spans and the middle blocks [(s, e), ...] that compete for the budget."""

    start: int
    end: int
    init: tuple[int, int]
    local: tuple[int, int]
    middle: list[tuple[int, int]]
    block_size: int

    @property
    def forced(self) -> list[tuple[int, int]]:
        """The always-kept spans (initial, local), empty ones left out."""
        return [s for s in (self.init, self.local) if s[1] > s[0]]

    @property
    def n_blocks(self) -> int:
        """Blocks of the whole document (initial + middle + local)."""
        return len(self.middle) + sum(math.ceil((e - s) / self.block_size) for s, e in self.forced)


def doc_blocks(start: int, end: int, block_size: int, initial_blocks: int, local_blocks: int) -> DocBlocks:
    """Split a document into initial / middle blocks / local. A document shorter than its
    initial + local spans is all forced (no middle); the last middle block may be shorter."""
    t = end - start
    n_init = min(t, initial_blocks * block_size)
    n_loc = min(t - n_init, local_blocks * block_size)
    init = (start, start + n_init)
    local = (end - n_loc, end)
    middle = [(s, min(s + block_size, local[0])) for s in range(init[1], local[0], block_size)]
    return DocBlocks(start, end, init, local, middle, block_size)


def personalized_queries(q_que: torch.Tensor, q_loc: torch.Tensor) -> torch.Tensor:
    """Eq. 1. q_que [S, F...] (generic query per layer), q_loc [Dd, S, F...] (each document's
    mean local Q) -> [Dd, S, F...]:
    ``Qhat_i = Q_que + 1/(Dd-1) * sum_{j!=i} |cos(Q_que, Q_loc_j)| * Q_loc_j``, the cosine
    taken over the whole per-layer vector (all heads). One document gets Q_que itself."""
    n_docs = q_loc.shape[0]
    if n_docs <= 1:
        return q_que.unsqueeze(0).expand_as(q_loc).clone()
    s = q_que.shape[0]
    qf, lf = q_que.reshape(s, -1).float(), q_loc.reshape(n_docs, s, -1).float()
    w = torch.nn.functional.cosine_similarity(lf, qf.unsqueeze(0), dim=-1).abs()  # [Dd, S]
    weighted = w.unsqueeze(-1) * lf  # [Dd, S, F]
    others = (weighted.sum(0, keepdim=True) - weighted) / (n_docs - 1)
    return (qf.unsqueeze(0) + others).reshape(q_loc.shape).to(q_loc.dtype)


def anchor_proportion(s_max: torch.Tensor, s_min: torch.Tensor, s_anc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Eq. 2, elementwise: share of a document's ``m`` middle blocks worth keeping at one layer,
    from their max and min score and the anchor score (tensors of one shape; m long).
    ``(s_max - s_anc) / (s_max - s_min)`` if ``s_min < s_anc <= s_max``, else 0 — except that
    an anchor below every block means all of them beat it (P = 1; the paper's interval leaves
    this case out, but its own argument — keep what beats the anchor — gives 1), a single
    block (or all equal) is kept iff it beats the anchor, and no middle block gives 0."""
    frac = (s_max - s_anc) / (s_max - s_min)
    p = torch.where(s_anc <= s_min, 1.0, torch.where(s_anc > s_max, 0.0, frac))
    p = torch.where(s_max <= s_min, (s_max > s_anc).to(p.dtype), p)
    return torch.where(m > 0, p, 0.0)


def _normalize(
    blk: torch.Tensor, blk_doc: torch.Tensor, m: torch.Tensor, s_max: torch.Tensor, s_min: torch.Tensor, how: str
) -> torch.Tensor:
    """Every document's block scores normalized over its own blocks, all documents at once:
    blk [S, B] (the B middle blocks of all documents), blk_doc [B] their document, m [Dd]
    blocks per document, s_max/s_min [S, Dd] -> [S, B]. minmax: (x - min) / span (1 when the
    span is 0); zscore: (x - mean) / population std (0 when that is 0, or for one block);
    none: x."""
    if how == "none":
        return blk
    if how == "minmax":
        span = (s_max - s_min)[:, blk_doc]
        return torch.where(span > 0, (blk - s_min[:, blk_doc]) / span, 1.0)
    cnt = m.clamp(min=1).to(blk.dtype)
    dev = blk - (blk.new_zeros(s_max.shape).index_add_(1, blk_doc, blk) / cnt)[:, blk_doc]
    std = (blk.new_zeros(s_max.shape).index_add_(1, blk_doc, dev * dev) / cnt).sqrt()
    std = torch.where(m > 1, std, 0.0)[:, blk_doc]
    return torch.where(std > 0, dev / std, 0.0)


def tie_scale(scores: list[torch.Tensor]) -> float:
    """The magnitude block scores tie relative to: the largest |score| of every document's
    blocks (``scores[i]`` [M_i]). One document's own scores are not it: two blocks whose
    z-scores average to 0 over the layers are rounding noise around 0, a tie to break by
    position, not a ranking to read from that noise."""
    flat = torch.cat([s.reshape(-1) for s in scores]) if scores else torch.zeros(0)
    return float(flat.abs().max()) if flat.numel() else 0.0  # one reduction, whatever the document count


def pool_order(scores: list[torch.Tensor], cands: list[list[int]]) -> list[tuple[int, int]]:
    """The cross-context filter's order: every document's candidate blocks (``cands[i]``,
    ascending) pooled and ranked by normalized score (``scores[i]`` [M_i]), best first; ties
    (relative to ``tie_scale(scores)``) go to the earlier document, then the earlier block."""
    pool = [(i, b) for i, c in enumerate(cands) for b in c]
    if not pool:
        return []
    vals = torch.stack([scores[i][b] for i, b in pool])
    return [pool[j] for j in order_by_score(vals, tie_scale(scores)).tolist()]


@dataclass
class Selection:
    """Result of the block selection: per document P_i (eq. 3), per-layer P_i^(n) [S], the
    ranking score of each middle block (mean over S of normalized scores), the candidate and
    the finally kept middle blocks (indices into ``DocBlocks.middle``)."""

    p: list[float]
    p_layers: list[torch.Tensor]
    scores: list[torch.Tensor]
    candidates: list[list[int]]
    kept: list[list[int]]


def select_blocks(
    qhat: torch.Tensor,
    keys: list[torch.Tensor],
    docs: list[DocBlocks],
    *,
    budget_tokens: int | None = None,
    budget_blocks: int | None = None,
    adaptive_p: bool = True,
    normalize: str = "minmax",
) -> Selection:
    """Sections 3.2 / A.2: pick middle blocks of every document.

    qhat [Dd, S, H, D] personalized queries at the S stable layers; keys: S tensors
    [Hkv, N, D] (keys at those layers, rotated to prompt positions); exactly one of
    ``budget_tokens`` (middle tokens allowed in total) or ``budget_blocks`` (paper: total
    blocks / Dd) bounds the cross-context filter.

    A block's score is the inner product of its document's query with every token's key,
    summed over heads (GQA: the query heads sharing a KV head add up), averaged over the block
    -- the query's inner product with the block's mean key, the paper's representative. Every
    document, stable layer and block is scored by a fixed number of ops (segment sums over
    index tables built on the host), and read back once; the candidates (top P_i of each
    document; equal scores: the earlier block) and the cross-context filter are host work."""
    if (budget_tokens is None) == (budget_blocks is None):
        raise ValueError("give exactly one of budget_tokens / budget_blocks")
    n_docs, s, d = qhat.shape[0], len(keys), qhat.shape[-1]
    hkv, dev = keys[0].shape[0], keys[0].device
    # Index tables built on the host, one entry per document token (its document, middle block
    # -- n_blk for none --, anchor document -- n_docs for a middle token), per middle block
    # (document, length) and per document (middle blocks, anchor tokens).
    cols: list[int] = []
    col_doc: list[int] = []
    col_blk: list[int] = []
    col_anc: list[int] = []
    blk_doc: list[int] = []
    blk_len: list[int] = []
    for i, doc in enumerate(docs):
        cols.extend(range(doc.start, doc.end))
        col_doc.extend([i] * (doc.end - doc.start))
        col_blk.extend([-1] * (doc.init[1] - doc.init[0]))
        for s0, e0 in doc.middle:
            col_blk.extend([len(blk_doc)] * (e0 - s0))
            blk_doc.append(i)
            blk_len.append(e0 - s0)
        col_blk.extend([-1] * (doc.end - doc.local[0]))
        col_anc.extend(
            [i] * (doc.init[1] - doc.init[0]) + [n_docs] * (doc.local[0] - doc.init[1]) + [i] * (doc.end - doc.local[0])
        )
    n_blk = len(blk_doc)
    col_blk = [n_blk if b < 0 else b for b in col_blk]
    cols_t, doc_t, blk_t, anc_t = torch.tensor([cols, col_doc, col_blk, col_anc], device=dev)
    blk_doc_t, blk_len_t = torch.tensor([blk_doc, blk_len], dtype=torch.long, device=dev).view(2, n_blk)
    m, n_anc = torch.tensor(
        [[len(doc.middle) for doc in docs], [sum(e0 - s0 for s0, e0 in doc.forced) for doc in docs]], device=dev
    )

    # Token scores ts [S, C]: every document's queries against every key, each token then
    # taking its own document's (Dd x the arithmetic of scoring each document alone, in one op).
    qg = qhat.float().to(dev).reshape(n_docs, s, hkv, -1, d).sum(3)  # [Dd, S, Hkv, D]
    k_all = torch.stack(keys).float()  # [S, Hkv, N, D]
    ts = torch.einsum("iskd,sknd->sin", qg, k_all)[:, doc_t, cols_t]
    blk = ts.new_zeros(s, n_blk + 1).index_add_(1, blk_t, ts)[:, :n_blk] / blk_len_t  # [S, B]
    s_anc = ts.new_zeros(s, n_docs + 1).index_add_(1, anc_t, ts)[:, :n_docs] / n_anc
    s_anc = torch.where(n_anc > 0, s_anc, float("-inf"))  # [S, Dd]
    idx = blk_doc_t.expand(s, -1)
    s_max = ts.new_full((s, n_docs), float("-inf")).scatter_reduce_(1, idx, blk, "amax")
    s_min = ts.new_full((s, n_docs), float("inf")).scatter_reduce_(1, idx, blk, "amin")
    # Eq. 2 in double precision, as P is a share of blocks; eq. 3: P_i = mean over layers.
    p_layers = anchor_proportion(s_max.double(), s_min.double(), s_anc.double(), m).float().T  # [Dd, S]
    p = p_layers.mean(1) if adaptive_p else (m > 0).float()
    score = _normalize(blk, blk_doc_t, m, s_max, s_min, normalize).mean(0)  # [B]
    score_h, p_h = torch.cat([score, p]).cpu().split([n_blk, n_docs])  # the one read back
    p_h = p_h.tolist()

    ms = [len(doc.middle) for doc in docs]
    scores = list(score_h.split(ms))
    # Each document's candidates: its k best blocks, ties to the earlier block.
    scale = tie_scale(scores)
    # The keys of all documents' blocks at once (a fixed scale makes a block's grid value its own,
    # and a document's blocks keep their order within the whole): top_indices per document, in a
    # number of ops that does not grow with the documents.
    keys = rank_keys(score_h, scale).tolist()
    cands: list[list[int]] = []
    off = 0
    for i, mi in enumerate(ms):
        k = max(0, min(mi, math.ceil(p_h[i] * mi - 1e-9)))
        row = keys[off : off + mi]
        cands.append(sorted(sorted(range(mi), key=row.__getitem__, reverse=True)[:k]))
        off += mi
    kept: list[list[int]] = [[] for _ in docs]
    used = 0
    for i, b in pool_order(scores, cands):
        if budget_blocks is not None:
            if used >= budget_blocks:
                break
            kept[i].append(b)
            used += 1
        elif budget_tokens is not None:  # always, when budget_blocks is None (exactly one is given)
            s0, e0 = docs[i].middle[b]
            if used + (e0 - s0) <= budget_tokens:
                kept[i].append(b)
                used += e0 - s0
    return Selection(p_h, list(p_layers.cpu().unbind(0)), scores, cands, [sorted(k) for k in kept])
