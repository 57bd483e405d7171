"""``samkv``: sparse attention across multiple-context KV caches (SamKV, Cao et al. 2025).

CacheBlend/EPIC repair the missing cross-document attention but keep every cached token.
SamKV keeps only a small, query-relevant part of every document (~15 %), recomputes a few of
the kept tokens against the other kept tokens, and hands the *sparse* cache to decoding, so
memory and decode cost shrink with the prompt.

Query time, before layer 0 (``prepare``):

1. **Generic query vector** (paper §3.1). The initial and local (last) tokens of every
   document form a compressed cache; the prompt's own tokens (template, question) are
   prefilled against it and the question's per-layer Q is mean-pooled: ``Q_que^(n)`` [H, D].
2. **Personalized query** (eq. 1). ``Qhat_i = Q_que + 1/(D-1) * sum_{j!=i} |cos(Q_que,
   Q_loc_j)| * Q_loc_j`` where ``Q_loc_j`` is document j's mean local Q. kvrag stores no Q
   cache; the local tokens are run through the layers against their own document's cached
   K/V (their original context) — at ingestion (``chunk_extras``, stored with the chunk) when
   ``samkv`` is an ingest policy, else in the preliminary pass (then memoized per chunk).
3. **Block selection** (§3.2, eq. 2-3). Middle tokens form blocks scored by ``Qhat_i . mean
   key``; the anchor score comes from the initial/local keys; ``P_i^(n) = (s_max - s_anc) /
   (s_max - s_min)`` per stable layer, averaged over N*; the top ``P_i`` blocks of each
   document are candidates; scores are normalized per document, pooled, and the best blocks
   up to the budget survive (cross-context filtering).
4. **Local recomputation** (§3.3, A.1). Of the kept tokens, the initial/local ones the
   question attends to most and the middle ones that got the most attention in their
   original context are recomputed from layer 0 against the kept sequence; the rest reuse
   their cached K/V.
5. **Update**: overwrite, or fusion ``KV = theta*KV_new + (1-theta)*KV_old`` with ``theta =
   cos(KV_new, KV_old)`` (eq. 4) — applied in ``select`` before the engine writes the rows.
6. The engine re-prefills the question on the fused sparse cache; ``state.keep`` drops every
   unselected cached token from attention and from the cache handed to the decoder.

Departure from the paper (see docs/policies.md, section samkv): the paper lets every layer keep its
own blocks (and pads the misaligned ones); kvrag's cache has one token set for all layers, so
blocks are ranked once by their score averaged over the stable layers N* — the layers the
paper itself found to agree on which blocks matter (A.2).

Shapes: ``N`` prompt tokens, ``L`` layers, ``S`` stable layers, ``H`` query heads, ``Hkv``
KV heads, ``D`` head dim (the *docs* count is written ``Dd`` where both appear).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvrag.checks import check_int, check_real, check_seq
from kvrag.layout.state import CACHED
from kvrag.policies.base import Policy, RecomputeParams, order_by_score, param, rank_keys, top_indices
from kvrag.policies.registry import register

NORMALIZATIONS = ("minmax", "zscore", "none")
#: Per-chunk memo of the query-independent preliminary results (local Q, original-context
#: attention): small ([L, H, D] + [T] floats a chunk), so a few thousand chunks cost little.
DOC_MEMO_SIZE = 4096
_MEMO_LOCK = threading.Lock()
_DOC_MEMO: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
UPDATES = ("fusion", "overwrite")
#: Per-chunk extras stored at ingestion (``SamKV.chunk_extras``): the document's mean local Q
#: float32 [L, H*D] (flat, so ``ChunkEntry.span`` never mistakes D for the token axis) at chunk
#: positions 0..T-1, the attention its tokens get from the local rows float32 [T], and what they
#: were computed for, long [1 + S]: the local span in tokens, then the stable layers.
Q_LOC_KEY, CONTEXT_KEY, META_KEY = "samkv.q_loc", "samkv.context_attn", "samkv.meta"


@dataclass
class SamKVParams(RecomputeParams):
    recompute_ratio: float = param(
        0.143,
        "fraction of the cached tokens recomputed, chosen among the kept ones (so at most the "
        "kept fraction; paper Table 1: 14.3% at 14.9% kept); 1.0 with keep_ratio=1.0, "
        "adaptive_p=False, update='overwrite' is exact",
    )
    keep_ratio: float | None = param(
        0.15,
        "fraction of the cached tokens kept (initial/local blocks included) — the budget of the "
        "cross-context filter; None = the paper's rule: total block count / number of documents",
    )
    block_size: int = param(
        16,
        "tokens per block (paper: 64, sized for multi-thousand-token contexts); "
        "shrunk for a short document so its always-kept initial/local blocks "
        "take at most half of its keep_ratio budget",
    )
    initial_blocks: int = param(1, "blocks at the start of every document that are always kept (paper: 1)")
    local_blocks: int = param(2, "blocks at the end of every document that are always kept (paper: 2)")
    stable_layers: tuple | None = param(
        None,
        "N*: layers that set P_i (eq. 3) and rank blocks (negative = from the end); "
        "None = the last round(0.15*L) layers (the paper's models: last 4-5 of 28-36)",
    )
    adaptive_p: bool = param(
        True,
        "eq. 2-3 anchor-based Top-P per document; False = every middle block is a candidate (keeps exactly keep_ratio)",
    )
    personalized: bool = param(True, "add eq. 1's personalized bias from the other documents' local Q")
    normalize: str = param(
        "minmax", "per-document score normalization before the cross-context filter: minmax | zscore | none"
    )
    update: str = param("fusion", "how recomputed K/V replace the cached ones: fusion (eq. 4) | overwrite")
    theta: float | None = param(
        None, "fusion weight of the new K/V; None = cos(new, old) per token and head, clamped to [0, 1] (eq. 4)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keep_ratio is not None:
            self.keep_ratio = check_real("keep_ratio", self.keep_ratio, 0.0, 1.0, lo_open=True)
        self.block_size = check_int("block_size", self.block_size, 1)
        self.initial_blocks = check_int("initial_blocks", self.initial_blocks, 0)
        # The local tokens are where Q_loc (eq. 1) and the original-context attention come from.
        self.local_blocks = check_int("local_blocks", self.local_blocks, 1)
        for name in ("adaptive_p", "personalized"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.stable_layers is not None:
            layers = check_seq("stable_layers", self.stable_layers, "a sequence of ints or None")
            # Negative layers count from the end, so no lower bound here (check_model bounds them).
            self.stable_layers = tuple(check_int("stable_layers entry", x, None) for x in layers)
            if not self.stable_layers:
                raise ValueError("stable_layers must not be empty (None = the last ~15% layers)")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {self.normalize!r}")
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")
        if self.theta is not None:
            self.theta = check_real("theta", self.theta, 0.0, 1.0)


# ---- pure building blocks (tested directly) ---------------------------------------------
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


def prelim_pass(
    arch,
    ids: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    keys,
    values,
    positions: torch.Tensor,
    stable: list[int],
    cos_sin,
    n_write: int,
    n_query: int,
    member: torch.Tensor,
):
    """Steps 1-2 in one pass: run ``rows`` [R] (token ids ``ids`` [R]) through every layer, row
    r attending to the keys ``mask`` [R, N] lets it see in ``keys``/``values`` (per layer
    [Hkv, N, D], keys rotated to ``positions`` [N]); cos_sin: the rows' RoPE tables [R, D].
    The prompt's own tokens (against the compressed cache) and every document's local rows
    (against their own document) share one batch, so the layers' ops do not grow with the
    number of documents.

    Three groups of rows, in this order: ``rows[:n_write]`` are the prompt's own tokens,
    computed here: their fresh K/V are written into keys/values at their rows before being
    attended (the caller must let no local row see them, and must not need those rows'
    previous contents); of these the last ``n_query`` are the question; ``rows[n_write:]`` are
    cached local rows, which read their context's cached K/V. member [Dd, R - n_write]: each
    document's averaging weights over the local rows.

    Returns q_que [L, H, D] (mean rotated Q of the question rows), q_loc [Dd, L, H, D]
    (``member``'s means of the local rows' rotated Q), query_attn [N] (attention the question
    rows pay to each key relative to uniform over the keys each row sees, mean over heads and
    rows) and context_attn [N] (attention each key gets from the local rows that see it, same
    normalization, mean over those rows), both averaged over the ``stable`` layers; float32, on
    the model's device."""
    L, n = arch.n_layers, mask.shape[1]
    n_loc = rows.numel() - n_write
    probe = n_write - n_query  # question + local rows: a contiguous tail, sliced without a copy
    pos_r = positions[rows]
    hidden = arch.embed(ids)
    qs = []
    query_attn = torch.zeros(n, device=mask.device)
    context_attn = torch.zeros(n, device=mask.device)
    # The mask and its row / column counts, made once per sliding-window size, not per layer.
    by_window: dict = {}
    for layer in range(L):
        q, k, v, _ = arch.qkv(layer, hidden, cos_sin)
        qs.append(q)
        keys_l, vals_l = keys[layer], values[layer]
        if n_write:
            keys_l[:, rows[:n_write]] = k[:, :n_write]
            vals_l[:, rows[:n_write]] = v[:, :n_write]
        w = arch.windows[layer]
        if w not in by_window:
            lm = arch.windowed(layer, mask, pos_r, positions)
            seen = lm[probe:]
            # Relative to uniform over the keys each row sees at this layer (its sliding window,
            # if any); a key is seen only by its own document's local rows in that window.
            by_window[w] = (lm, seen.sum(1, keepdim=True).float(), seen[n_query:].float().sum(0).clamp(min=1))
        lm, visible, hits = by_window[w]
        if layer in stable:
            probs = arch.attention_probs(q[:, probe:], keys_l, lm[probe:]).mean(0) * visible  # [P, N]
            if n_query:
                query_attn += probs[:n_query].mean(0) / len(stable)
            if n_loc:
                context_attn += probs[n_query:].sum(0) / hits / len(stable)
        if layer < L - 1:  # the last layer's output is never used, only its q
            hidden = arch.attend(layer, hidden, q, keys_l, vals_l, lm)
    q_all = torch.stack(qs).float()  # [L, H, R, D]
    q_que = q_all[:, :, probe:n_write].mean(2)
    q_loc = torch.einsum("dr,lhrk->dlhk", member, q_all[:, :, n_write:])
    return q_que, q_loc, query_attn, context_attn


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


@dataclass
class SamKVInfo:
    """What ``prepare`` decided (in ``state.scratch['samkv']``; tests and debugging read it).
    q_que [L, H, D], q_loc [Dd, L, H, D], qhat [Dd, S, H, D]; keep/recompute bool [N]."""

    docs: list[DocBlocks]
    stable: list[int]
    q_que: torch.Tensor
    q_loc: torch.Tensor
    qhat: torch.Tensor
    selection: Selection
    keep: torch.Tensor
    recompute: torch.Tensor
    query_attn: torch.Tensor
    context_attn: torch.Tensor
    prelim_rows: int


@register
class SamKV(Policy):
    name = "samkv"
    summary = (
        "keep ~15% of each document's KV (anchor-based Top-P blocks for a personalized query), "
        "recompute most kept tokens locally, decode on the sparse cache"
    )
    Params = SamKVParams

    @classmethod
    def forget(cls) -> None:
        with _MEMO_LOCK:
            _DOC_MEMO.clear()

    # ---- ingestion -----------------------------------------------------------------------
    def chunk_extras(self, arch, keys, values, token_ids):
        """{"samkv.q_loc": float32 [L, H*D], "samkv.context_attn": float32 [T], "samkv.meta":
        long [1 + S]}: the chunk's query-independent step-2 results, for a prompt that reuses
        the whole chunk under these parameters (local span, stable layers). They are what the
        query would compute — the local rows against the chunk's own K/V — so a chunk's first
        query skips that pass. keys/values [L, Hkv, T, D] (keys pre-RoPE), token_ids [T].
        Nothing under a length-dependent RoPE (the local Q would carry the prompt's
        frequencies) or for an empty chunk."""
        t = int(token_ids.numel())
        if t == 0 or arch.length_dependent_rope:
            return {}
        stable = self.stable_layers(arch.n_layers)
        local = self.params.local_blocks * self.block_size_for(t)
        dev, dt = arch.device, arch.dtype
        positions = torch.arange(t, device=dev)
        cos, sin = arch.cos_sin(positions)
        k = keys.to(device=dev, dtype=dt)
        rot = [arch.rotate(k[layer], None, (cos, sin), layer=layer) for layer in range(arch.n_layers)]
        vals = values.to(device=dev, dtype=dt)
        rows = torch.arange(max(0, t - local), t, device=dev)
        mask = rows[:, None] >= positions[None, :]
        member = torch.ones(1, rows.numel(), device=dev) / rows.numel()
        _, q_loc, _, ctx = prelim_pass(
            arch,
            token_ids[rows.cpu()].to(dev),
            rows,
            mask,
            rot,
            vals,
            positions,
            stable,
            (cos[rows], sin[rows]),
            0,
            0,
            member,
        )
        return {
            Q_LOC_KEY: q_loc[0].reshape(arch.n_layers, -1).contiguous().cpu(),
            CONTEXT_KEY: ctx.cpu(),
            META_KEY: torch.tensor([local, *stable], dtype=torch.long),
        }

    # ---- configuration -------------------------------------------------------------------
    def stable_layers(self, n_layers: int) -> list[int]:
        sl = self.params.stable_layers
        if sl is None:
            k = max(1, int(0.15 * n_layers + 0.5))
            return list(range(n_layers - k, n_layers))
        out = []
        for x in sl:
            if not -n_layers <= x < n_layers:
                raise ValueError(f"stable_layers entry {x} is out of range for a {n_layers}-layer model")
            out.append(x % n_layers)
        return sorted(set(out))

    def block_size_for(self, doc_tokens: int) -> int:
        """Block size for a document of ``doc_tokens`` tokens.

        The paper's 64-token blocks assume documents of thousands of tokens; a 200-token
        passage would then be all initial/local blocks, kept unconditionally, and the
        keep_ratio budget could not hold. So the always-kept blocks of a document get at most
        half of its share of the budget, and the rest is left to query-selected blocks."""
        p = self.params
        if p.keep_ratio is None:
            return p.block_size
        fit = int(p.keep_ratio * doc_tokens / (2 * (p.initial_blocks + p.local_blocks)))
        return max(1, min(p.block_size, fit))

    def _memo_key(self, piece, stable: list[int], span: int, arch=None, n: int = 0):
        """Memo key of a document's query-independent results, None = do not memoize. The
        chunk key already binds model and token ids, and the piece's span which of its tokens
        the prompt reuses (two prompts may reuse different parts of one chunk); the storage
        dtype changes the cached K/V, and the local span and stable layers change what is
        computed from them. Under a length-dependent RoPE (LongRoPE, dynamic NTK) the local
        queries carry the frequencies of the prompt's length ``n``, so only a prompt of that
        length may reuse them."""
        if piece.key is None or piece.entry is None or piece.span is None:
            return None
        freq = n if arch is not None and arch.length_dependent_rope else None
        return (piece.key, tuple(piece.span), str(piece.entry.keys.dtype), span, tuple(stable), freq)

    # ---- step 2's per-chunk results, stored at ingestion ---------------------------------
    def _stored(self, piece, local: int, stable: list[int], arch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A document's per-chunk results computed at ingestion (``chunk_extras``): (q_loc
        [L, H, D] at chunk positions 0..T-1, context_attn [T]) when they were computed for
        what this query needs — the whole chunk, the same local span and stable layers — else
        None. Under a length-dependent RoPE none are stored (their frequencies would be the
        chunk's, not the prompt's)."""
        e = piece.entry
        if e is None or piece.span is None or arch.length_dependent_rope:
            return None
        extras = getattr(e, "extras", None) or {}
        q, ctx, meta = (extras.get(k) for k in (Q_LOC_KEY, CONTEXT_KEY, META_KEY))
        if q is None or ctx is None or meta is None:
            return None
        if tuple(piece.span) != (0, ctx.numel()) or meta.tolist() != [local, *stable]:
            return None  # part of the chunk, or computed under other parameters
        if tuple(q.shape) != (arch.n_layers, arch.n_heads * arch.head_dim):
            return None
        return q.float().view(arch.n_layers, arch.n_heads, arch.head_dim), ctx.float()

    # ---- step 1-2: preliminary prefill against the compressed cache ---------------------
    def _preliminary(
        self, state, docs: list[DocBlocks], pieces: list, doc_keys: list, stable: list[int], forced: torch.Tensor
    ):
        """Run the prompt's own tokens against the compressed cache (initial + local tokens of
        every document, ``forced`` bool [N]) and every document's local tokens against that
        document alone, in one batch (``prelim_pass``).

        pieces: the documents' prompt pieces; doc_keys: per document a hashable key of its
        chunk (or None). The per-document results do not depend on the query or on where the
        document sits (RoPE is relative), so they are taken from the chunk's stored extras
        (computed at ingestion) or a per-chunk memo, and the local rows are only run for
        documents with neither.

        Returns q_que [L, H, D], q_loc [Dd, L, H, D] (rotated to the documents' prompt
        positions), query_attn [N] (attention the question pays to each compressed-cache
        token, relative to uniform, mean over heads, question tokens and stable layers) and
        context_attn [N] (attention each document token gets from its own local tokens in its
        original context, same normalization)."""
        arch, lay = state.arch, state.layout
        dev = arch.device
        n = lay.n
        pos = lay.positions.to(dev)
        hits, todo, from_store = [], [], 0
        for j, (d, piece, key) in enumerate(zip(docs, pieces, doc_keys)):
            hit = self._stored(piece, self.params.local_blocks * d.block_size, stable, arch)
            if hit is not None:
                from_store += 1
            elif key is not None:
                with _MEMO_LOCK:
                    hit = _DOC_MEMO.get(key)
                    if hit is not None:
                        _DOC_MEMO.move_to_end(key)
            if hit is None:
                todo.append(j)
            else:
                hits.append((j, hit))

        # Rows: the prompt's own tokens (template + question: computed, fresh K/V), the
        # question last, then the local rows of the documents without stored results -- the
        # last local-span-many tokens, even in a document too short to have a local span of its
        # own (its tokens are all initial then), so Q_loc is never empty.
        cached = lay.cached.tolist()  # host lists: no op per token
        query = set(lay.query.tolist())
        own_rows = [r for r in range(n) if not cached[r] or r in query]
        head = [r for r in own_rows if r not in query]
        q_rows = [r for r in own_rows if r in query]
        loc_rows: list[int] = []
        loc_doc: list[int] = []
        doc_of_host = [-1] * n  # each row's document, -1 for rows outside every document
        for j, d in enumerate(docs):
            doc_of_host[d.start : d.end] = [j] * (d.end - d.start)
        for t, j in enumerate(todo):
            d = docs[j]
            lo = max(d.start, d.end - self.params.local_blocks * d.block_size)
            loc_rows.extend(range(lo, d.end))
            loc_doc.extend([t] * (d.end - lo))
        n_own = len(head) + len(q_rows)
        rows_cpu = torch.tensor(head + q_rows + loc_rows)
        rows, doc_of = rows_cpu.to(dev), torch.tensor(doc_of_host, device=dev)
        # Own rows see the compressed cache and the own rows before them; local rows their own
        # document's keys before them (their original context, RoPE being relative).
        see_own = (forced.to(dev) | (doc_of < 0))[None, :]
        same_doc = doc_of[rows][:, None] == doc_of[None, :]
        is_local = (torch.arange(rows.numel(), device=dev) >= n_own)[:, None]
        mask = (pos[rows][:, None] >= pos[None, :]) & torch.where(is_local, same_doc, see_own)
        loc_t = torch.tensor(loc_doc, dtype=torch.long, device=dev)
        member = (loc_t[None, :] == torch.arange(len(todo), device=dev)[:, None]).float()
        member /= member.sum(1, keepdim=True)  # [Dt, R_loc]: mean over each document's rows
        # The own rows' K/V are written into the engine's cache in place (the engine recomputes
        # and rewrites them at every layer before its attention reads them), unless one of them
        # is a cached token (a question span that overlaps a chunk), whose cached K/V must stay.
        if all(not cached[r] for r in own_rows):
            keys, values = state.K, state.V
        else:
            keys, values = [k.clone() for k in state.K], [v.clone() for v in state.V]
        q_que, q_new, query_attn, ctx_new = prelim_pass(
            arch,
            lay.token_ids[rows_cpu].to(dev),
            rows,
            mask,
            keys,
            values,
            pos,
            stable,
            (state.cos[rows], state.sin[rows]),
            n_own,
            len(q_rows),
            member,
        )

        L = arch.n_layers
        q_loc = torch.zeros(len(docs), L, arch.n_heads, arch.head_dim)
        context_attn = ctx_new.cpu()  # zero outside the documents run here
        if hits:
            # Stored rotated to chunk positions 0..T-1; R(start) moves them to the prompt (RoPE
            # rotations compose, so rotating the mean equals the mean of rotated vectors).
            idx = torch.tensor([j for j, _ in hits])
            q_loc[idx] = self._shift(arch, torch.stack([h[0] for _, h in hits]), [docs[j].start for j, _ in hits], n)
            toks = torch.tensor([t for j, _ in hits for t in range(docs[j].start, docs[j].end)], dtype=torch.long)
            context_attn[toks] = torch.cat([h[1] for _, h in hits])
        if todo:
            q_new = q_new.cpu()
            q_loc[torch.tensor(todo)] = q_new
            memo = [t for t, j in enumerate(todo) if doc_keys[j] is not None]
            if memo:
                # Views of one shifted block and one gather: a fixed number of ops however many
                # documents are memoized (the entries share those tensors' storage).
                sel = torch.tensor(memo)
                shifted = self._shift(arch, q_new[sel], [-docs[todo[t]].start for t in memo], n)
                spans = [(docs[todo[t]].start, docs[todo[t]].end) for t in memo]
                ctx = context_attn[torch.tensor([i for s0, e0 in spans for i in range(s0, e0)], dtype=torch.long)]
                parts = ctx.split([e0 - s0 for s0, e0 in spans])
                with _MEMO_LOCK:
                    for t, q_t, c_t in zip(memo, shifted.unbind(0), parts):
                        _DOC_MEMO[doc_keys[todo[t]]] = (q_t, c_t)
                    while len(_DOC_MEMO) > DOC_MEMO_SIZE:
                        _DOC_MEMO.popitem(last=False)
        state.scratch["samkv_prelim_rows"] = int(rows_cpu.numel())
        state.scratch["samkv_from_store"] = from_store
        return q_que.cpu(), q_loc, query_attn.cpu(), context_attn

    @staticmethod
    def _shift(arch, q: torch.Tensor, deltas: list[int], length: int) -> torch.Tensor:
        """Move rotated query vectors q [Dd, L, H, D] (one per document) by ``deltas`` [Dd]
        positions (RoPE composition; NoPE layers' queries carry no position and stay as they
        are), with the RoPE tables of a ``length``-token prompt (``Arch.cos_sin``): every
        document and layer at once. float32 on the CPU."""
        cs = arch.cos_sin(torch.tensor(deltas, device=arch.device), length)
        cs = (cs[0].float().cpu(), cs[1].float().cpu())
        # [L, H, Dd, D]: the documents take the position axis.
        return arch.shift_layers(q.float().permute(1, 2, 0, 3), cs).permute(2, 0, 1, 3)

    # ---- hooks ---------------------------------------------------------------------------
    def prepare(self, state) -> None:
        p = self.params
        lay = state.layout
        n = lay.n

        spans = lay.spans(CACHED)
        recompute = torch.zeros(n, dtype=torch.bool)
        if not spans:
            state.scratch["samkv"] = None
            state.scratch["samkv_recompute"] = recompute
            return
        L = state.arch.n_layers
        stable = self.stable_layers(L)
        docs = [doc_blocks(s, e, self.block_size_for(e - s), p.initial_blocks, p.local_blocks) for _, s, e in spans]
        doc_keys = [
            self._memo_key(lay.pieces[si], stable, p.local_blocks * d.block_size, state.arch, lay.n)
            for (si, _, _), d in zip(spans, docs)
        ]
        # Index lists built on the host, one write each: no op per document or block.
        forced_mask = torch.zeros(n, dtype=torch.bool)
        forced_mask[torch.tensor([t for d in docs for s, e in d.forced for t in range(s, e)], dtype=torch.long)] = True
        q_que, q_loc, query_attn, context_attn = self._preliminary(
            state, docs, [lay.pieces[si] for si, _, _ in spans], doc_keys, stable, forced_mask
        )
        sq, sl = q_que[stable], q_loc[:, stable]
        qhat = personalized_queries(sq, sl) if p.personalized else sq.unsqueeze(0).expand_as(sl).clone()

        cached = lay.cached
        n_cached = int(cached.sum())
        forced = sum(e - s for d in docs for s, e in d.forced)
        if p.keep_ratio is None:
            total = sum(d.n_blocks for d in docs)
            budget = dict(budget_blocks=total // len(docs))
        else:
            target = int(round(p.keep_ratio * n_cached))
            budget = dict(budget_tokens=max(0, target - forced))
        sel = select_blocks(
            qhat,
            [state.K[layer] for layer in stable],
            docs,
            adaptive_p=p.adaptive_p,
            normalize=p.normalize,
            **budget,
        )
        keep = ~cached | forced_mask
        keep[
            torch.tensor(
                [t for d, kept in zip(docs, sel.kept) for b in kept for t in range(*d.middle[b])], dtype=torch.long
            )
        ] = True

        # Local recomputation (§3.3 / A.1): initial/local tokens ranked by the question's
        # attention in the compressed prefill, kept middle tokens by the attention they got in
        # their original context; the budget is split in proportion to the two pools so that
        # the two differently-normalized scores are never compared with each other.
        pool_a = (forced_mask & keep & cached).nonzero().squeeze(1)
        pool_b = (~forced_mask & keep & cached).nonzero().squeeze(1)
        n_kept = pool_a.numel() + pool_b.numel()
        r_total = min(n_kept, int(round(p.recompute_ratio * n_cached)))
        r_a = int(round(r_total * pool_a.numel() / n_kept)) if n_kept else 0
        r_b = r_total - r_a
        if r_b > pool_b.numel():
            r_a, r_b = r_total - pool_b.numel(), pool_b.numel()
        recompute[pool_a[top_indices(query_attn[pool_a], r_a)]] = True
        recompute[pool_b[top_indices(context_attn[pool_b], r_b)]] = True

        state.keep = keep.to(state.keep.device)
        kept_cached = int((keep & cached).sum())
        state.scratch.setdefault("policy_stats", {}).update(
            {
                "samkv.kept_fraction": kept_cached / n_cached,
                "samkv.mean_p": sum(sel.p) / len(sel.p),
                "samkv.middle_blocks_kept": sum(len(k) for k in sel.kept),
                "samkv.recomputed": int(recompute.sum()),
                "samkv.prelim_rows": state.scratch["samkv_prelim_rows"],
                "samkv.docs_from_store": state.scratch.pop("samkv_from_store"),
            }
        )
        state.scratch["samkv_recompute"] = recompute
        state.scratch["samkv"] = SamKVInfo(
            docs=docs,
            stable=stable,
            q_que=q_que.cpu(),
            q_loc=q_loc.cpu(),
            qhat=qhat.cpu(),
            selection=sel,
            keep=keep,
            recompute=recompute,
            query_attn=query_attn,
            context_attn=context_attn,
            prelim_rows=state.scratch.pop("samkv_prelim_rows"),
        )

    def initial_active(self, state) -> torch.Tensor:
        # Rule 1 of §3.3 holds by construction: a recomputed token is computed from layer 0,
        # so its input at every layer is its own recomputed output; rule 2: every other kept
        # token reuses its cached K/V at every layer.
        return state.scratch["samkv_recompute"].clone()

    def select(self, layer, state, q, k, v):
        if self.params.update == "overwrite":
            return None
        # The active set is fixed after prepare (select never narrows it): the cached active
        # rows and their slots are found once, not once per layer.
        memo = state.scratch.get("samkv_rows")
        if memo is None or memo[0] is not state.active:
            rows = state.layout.cached.to(k.device)[state.active]
            memo = state.scratch["samkv_rows"] = (state.active, rows, state.active[rows], bool(rows.any()))
        _, rows, idx, any_rows = memo
        if not any_rows:
            return None
        # K and V side by side [2 Hkv, R, D]: one eq. 4 for both (the cosine is per token and head).
        hkv = k.shape[0]
        fresh = torch.cat([k[:, rows], v[:, rows]]).float()
        old = torch.cat([state.K[layer][:, idx], state.V[layer][:, idx]]).float()
        if self.params.theta is None:
            # Eq. 4: theta = cos(new, old) per token and head; a negative cosine would
            # extrapolate away from both, so it is clamped to [0, 1].
            theta = torch.nn.functional.cosine_similarity(fresh, old, dim=-1).clamp(0, 1).unsqueeze(-1)
        else:
            theta = float(self.params.theta)
        fused = (theta * fresh + (1 - theta) * old).to(k.dtype)
        # In place: the engine writes these very tensors into the cache right after this
        # hook and attends with them, so the fused K/V are what this and later layers see.
        k[:, rows] = fused[:hkv]
        v[:, rows] = fused[hkv:]
        return None
