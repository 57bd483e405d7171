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
from kvrag.policies.base import Policy, RecomputeParams, param, top_indices
from kvrag.policies.registry import register
from kvrag.query.state import CACHED

NORMALIZATIONS = ("minmax", "zscore", "none")
#: Per-chunk memo of the query-independent preliminary results (local Q, original-context
#: attention): small ([L, H, D] + [T] floats a chunk), so a few thousand chunks cost little.
DOC_MEMO_SIZE = 4096
_MEMO_LOCK = threading.Lock()
_DOC_MEMO: "OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()
UPDATES = ("fusion", "overwrite")
#: Per-chunk extras stored at ingestion (``SamKV.chunk_extras``): the document's mean local Q
#: float32 [L, H*D] (flat, so ``ChunkEntry.span`` never mistakes D for the token axis) at chunk
#: positions 0..T-1, the attention its tokens get from the local rows float32 [T], and what they
#: were computed for, long [1 + S]: the local span in tokens, then the stable layers.
Q_LOC_KEY, CONTEXT_KEY, META_KEY = "samkv.q_loc", "samkv.context_attn", "samkv.meta"


@dataclass
class SamKVParams(RecomputeParams):
    recompute_ratio: float = param(
        0.143, "fraction of the cached tokens recomputed, chosen among the kept ones (so at most the "
               "kept fraction; paper Table 1: 14.3% at 14.9% kept); 1.0 with keep_ratio=1.0, "
               "adaptive_p=False, update='overwrite' is exact")
    keep_ratio: float | None = param(
        0.15, "fraction of the cached tokens kept (initial/local blocks included) — the budget of the "
              "cross-context filter; None = the paper's rule: total block count / number of documents")
    block_size: int = param(16, "tokens per block (paper: 64, sized for multi-thousand-token contexts); "
                                "shrunk for a short document so its always-kept initial/local blocks "
                                "take at most half of its keep_ratio budget")
    initial_blocks: int = param(1, "blocks at the start of every document that are always kept (paper: 1)")
    local_blocks: int = param(2, "blocks at the end of every document that are always kept (paper: 2)")
    stable_layers: tuple | None = param(
        None, "N*: layers that set P_i (eq. 3) and rank blocks (negative = from the end); "
              "None = the last round(0.15*L) layers (the paper's models: last 4-5 of 28-36)")
    adaptive_p: bool = param(True, "eq. 2-3 anchor-based Top-P per document; False = every middle "
                                   "block is a candidate (keeps exactly keep_ratio)")
    personalized: bool = param(True, "add eq. 1's personalized bias from the other documents' local Q")
    normalize: str = param("minmax", "per-document score normalization before the cross-context filter: "
                                     "minmax | zscore | none")
    update: str = param("fusion", "how recomputed K/V replace the cached ones: fusion (eq. 4) | overwrite")
    theta: float | None = param(None, "fusion weight of the new K/V; None = cos(new, old) per token and "
                                      "head, clamped to [0, 1] (eq. 4)")

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


def token_scores(qhat: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Inner products of one query vector with every key, summed over heads (GQA aware):
    qhat [H, D], keys [Hkv, T, D] -> [T]. A block's score is the mean of its tokens' scores,
    i.e. the query's inner product with the block's mean key (the paper's representative)."""
    hkv = keys.shape[0]
    qg = qhat.float().to(keys.device).reshape(hkv, -1, qhat.shape[-1]).sum(1)  # heads sharing a KV head
    return torch.einsum("kd,ktd->t", qg, keys.float())


def anchor_proportion(s_blocks: torch.Tensor, s_anc: float) -> float:
    """Eq. 2: share of middle blocks worth keeping, from the anchor score. s_blocks [M].
    ``(s_max - s_anc) / (s_max - s_min)`` if ``s_min < s_anc <= s_max``, else 0 — except that
    an anchor below every block means all of them beat it (P = 1; the paper's interval leaves
    this case out, but its own argument — keep what beats the anchor — gives 1), and a single
    block is kept iff it beats the anchor."""
    if s_blocks.numel() == 0:
        return 0.0
    s_max, s_min = float(s_blocks.max()), float(s_blocks.min())
    if s_max <= s_min:  # one block, or all equal
        return 1.0 if s_max > s_anc else 0.0
    if s_anc <= s_min:
        return 1.0
    if s_anc > s_max:
        return 0.0
    return (s_max - s_anc) / (s_max - s_min)


def _normalize(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "none" or x.numel() == 0:
        return x
    if how == "minmax":
        span = x.max() - x.min()
        return (x - x.min()) / span if span > 0 else torch.ones_like(x)
    std = x.std(unbiased=False) if x.numel() > 1 else x.new_zeros(())
    return (x - x.mean()) / std if std > 0 else torch.zeros_like(x)


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


def local_pass(arch, ids: torch.Tensor, rows: torch.Tensor, doc_of: torch.Tensor, keys, values,
               positions: torch.Tensor, n_docs: int, stable: list[int], cos_sin):
    """Run documents' local tokens through every layer against their own document's cached K/V
    (their original context, RoPE being relative): step 2's Q_loc and the original-context
    attention that ranks middle tokens for recomputation (step 4).

    ids [R]: token ids of the local rows; rows [R]: their indices on the key axis; doc_of [N]:
    document (0..n_docs-1) of every key, -1 = none; keys/values: per layer [Hkv, N, D], keys
    rotated to ``positions`` [N]; cos_sin: the rows' RoPE tables [R, D]. Returns q_loc
    [n_docs, L, H, D] (mean rotated Q of each document's local rows, float32, CPU) and
    context_attn [N] (attention each key gets from its document's local rows relative to
    uniform, mean over heads, those rows and the stable layers; float32, CPU)."""
    dev = arch.device
    L = arch.n_layers
    # Only the documents' own keys take part: the others are never attended to here, and rows
    # of the engine's cache not computed yet (template, question) hold uninitialised memory.
    cols = (doc_of >= 0).nonzero().squeeze(1)
    doc_r, doc_k, pos_k = doc_of[rows], doc_of[cols], positions[cols]
    mask = (positions[rows][:, None] >= pos_k[None, :]) & (doc_r[:, None] == doc_k[None, :])
    member = (doc_r[None, :] == torch.arange(n_docs, device=dev)[:, None]).float()
    member /= member.sum(1, keepdim=True)  # [Dd, R]: mean over each document's rows
    hidden = arch.embed(ids)
    q_loc = torch.zeros(n_docs, L, arch.n_heads, arch.head_dim, device=dev)
    attn = torch.zeros(cols.numel(), device=dev)
    for layer in range(L):
        q, _, _, _ = arch.qkv(layer, hidden, cos_sin)
        q_loc[:, layer] = torch.einsum("dr,hrk->dhk", member, q.float())
        lmask = arch.windowed(layer, mask, positions[rows], pos_k)
        k, v = keys[layer][:, cols], values[layer][:, cols]
        if layer in stable:
            # Relative to uniform over the keys each row sees at this layer (its sliding window,
            # if any); a key is seen only by its own document's rows in that window.
            visible = lmask.sum(1, keepdim=True).float()
            hits = lmask.float().sum(0).clamp(min=1)
            probs = arch.attention_probs(q, k, lmask).mean(0) * visible  # [R, C]
            attn += probs.sum(0) / hits / len(stable)
        if layer < L - 1:  # the last layer's output is never used, only its q
            hidden = arch.attend(layer, hidden, q, k, v, lmask)
    context_attn = torch.zeros(positions.numel(), device=dev)
    context_attn[cols] = attn
    return q_loc.cpu(), context_attn.cpu()


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
    blocks / Dd) bounds the cross-context filter."""
    if (budget_tokens is None) == (budget_blocks is None):
        raise ValueError("give exactly one of budget_tokens / budget_blocks")
    ps, p_layers, scores, cands = [], [], [], []
    for i, d in enumerate(docs):
        m = len(d.middle)
        per_layer_p, per_layer_s = [], []
        anchor = torch.tensor([t for s, e in d.forced for t in range(s, e)], dtype=torch.long)
        for n, kn in enumerate(keys):
            ts = token_scores(qhat[i, n], kn[:, d.start:d.end])  # [T]
            if m == 0:
                continue
            blk = torch.stack([ts[s - d.start:e - d.start].mean() for s, e in d.middle])
            s_anc = float(ts[anchor - d.start].mean()) if anchor.numel() else float("-inf")
            per_layer_p.append(anchor_proportion(blk, s_anc))
            per_layer_s.append(_normalize(blk, normalize))
        if m == 0:
            ps.append(0.0)
            p_layers.append(torch.zeros(len(keys)))
            scores.append(torch.zeros(0))
            cands.append([])
            continue
        pl = torch.tensor(per_layer_p)
        p = float(pl.mean()) if adaptive_p else 1.0  # eq. 3
        sc = torch.stack(per_layer_s).mean(0)
        k = min(m, math.ceil(p * m - 1e-9))
        ps.append(p)
        p_layers.append(pl)
        scores.append(sc)
        cands.append(top_indices(sc, k).tolist())
    # Cross-context filter: pool every document's candidates by normalized score.
    pool = sorted(((float(scores[i][b]), i, b) for i in range(len(docs)) for b in cands[i]), reverse=True)
    kept: list[list[int]] = [[] for _ in docs]
    used = 0
    for _, i, b in pool:
        if budget_blocks is not None:
            if used >= budget_blocks:
                break
            kept[i].append(b)
            used += 1
        else:
            s, e = docs[i].middle[b]
            if used + (e - s) <= budget_tokens:
                kept[i].append(b)
                used += e - s
    return Selection(ps, p_layers, scores, cands, [sorted(k) for k in kept])


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
    summary = ("keep ~15% of each document's KV (anchor-based Top-P blocks for a personalized query), "
               "recompute most kept tokens locally, decode on the sparse cache")
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
        q_loc, ctx = local_pass(arch, token_ids[rows.cpu()], rows, torch.zeros(t, dtype=torch.long, device=dev),
                                rot, vals, positions, 1, stable, (cos[rows], sin[rows]))
        return {Q_LOC_KEY: q_loc[0].reshape(arch.n_layers, -1).contiguous(), CONTEXT_KEY: ctx,
                META_KEY: torch.tensor([local, *stable], dtype=torch.long)}

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
    def _preliminary(self, state, docs: list[DocBlocks], pieces: list, doc_keys: list, stable: list[int]):
        """Run the prompt's own tokens against the compressed cache (initial + local tokens of
        every document) and every document's local tokens against that document alone.

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
        L = arch.n_layers
        pos = lay.positions.to(dev)
        cached = lay.cached.to(dev)
        query = lay.query.to(dev)
        q_loc = torch.zeros(len(docs), L, arch.n_heads, arch.head_dim)
        context_attn = torch.zeros(n)
        todo, from_store = [], 0
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
                continue
            # Stored rotated to chunk positions 0..T-1; R(start) moves it to the prompt (RoPE
            # rotations compose, so rotating the mean equals the mean of rotated vectors).
            q_loc[j] = self._shift(arch, hit[0], d.start, n)
            context_attn[d.start:d.end] = hit[1]

        compressed = torch.zeros(n, dtype=torch.bool, device=dev)
        doc_of = torch.full((n,), -1, dtype=torch.long, device=dev)
        for j, d in enumerate(docs):
            for s, e in d.forced:
                compressed[s:e] = True
            doc_of[d.start:d.end] = j
        own = ~cached
        own[query] = True
        rows = own.nonzero().squeeze(1)  # template + question: computed, fresh K/V
        mask = (pos[rows][:, None] >= pos[None, :]) & (compressed | own)[None, :]
        q_rows = (rows[:, None] == query[None, :]).any(1).nonzero().squeeze(1)

        cs = (state.cos[rows], state.sin[rows])
        hidden = arch.embed(lay.token_ids[rows.cpu()])
        q_que = torch.zeros(L, arch.n_heads, arch.head_dim, device=dev)
        query_attn = torch.zeros(n, device=dev)
        for layer in range(L):
            q, k, v, _ = arch.qkv(layer, hidden, cs)
            q_que[layer] = q[:, q_rows].float().mean(1)
            keys, vals = state.K[layer].clone(), state.V[layer].clone()
            keys[:, rows], vals[:, rows] = k, v
            lmask = arch.windowed(layer, mask, pos[rows], pos)
            if layer in stable:
                # Relative to uniform over the keys each question row sees at this layer.
                visible = lmask[q_rows].sum(1, keepdim=True).float()
                probs = arch.attention_probs(q[:, q_rows], keys, lmask[q_rows]).mean(0) * visible
                query_attn += probs.mean(0) / len(stable)
            if layer < L - 1:  # the last layer's output is never used, only its q
                hidden = arch.attend(layer, hidden, q, keys, vals, lmask)

        n_local = 0
        if todo:
            # Local rows = the last local-span-many tokens, even in a document too short to have
            # a local span of its own (its tokens are all initial then), so Q_loc is never empty.
            loc = [torch.arange(max(docs[j].start, docs[j].end - self.params.local_blocks * docs[j].block_size),
                                docs[j].end, device=dev) for j in todo]
            loc_rows = torch.cat(loc)
            n_local = loc_rows.numel()
            # Renumber the documents 0..len(todo)-1; the others' keys take no part.
            sub = torch.full((len(docs) + 1,), -1, dtype=torch.long, device=dev)
            sub[torch.tensor(todo, device=dev)] = torch.arange(len(todo), device=dev)
            q_new, ctx_new = local_pass(arch, lay.token_ids[loc_rows.cpu()], loc_rows, sub[doc_of], state.K, state.V,
                                        pos, len(todo), stable, (state.cos[loc_rows], state.sin[loc_rows]))
            for t, j in enumerate(todo):
                d = docs[j]
                q_loc[j] = q_new[t]
                context_attn[d.start:d.end] = ctx_new[d.start:d.end]
                if doc_keys[j] is not None:
                    value = (self._shift(arch, q_loc[j], -d.start, n), ctx_new[d.start:d.end].clone())
                    with _MEMO_LOCK:
                        _DOC_MEMO[doc_keys[j]] = value
                        while len(_DOC_MEMO) > DOC_MEMO_SIZE:
                            _DOC_MEMO.popitem(last=False)
        state.scratch["samkv_prelim_rows"] = int(rows.numel()) + n_local
        state.scratch["samkv_from_store"] = from_store
        return q_que.cpu(), q_loc, query_attn.cpu(), context_attn

    @staticmethod
    def _shift(arch, q: torch.Tensor, delta: int, length: int) -> torch.Tensor:
        """Move rotated query vectors q [L, H, D] by ``delta`` positions (RoPE composition;
        NoPE layers' queries carry no position and stay as they are), with the RoPE tables of
        a ``length``-token prompt (``Arch.cos_sin``)."""
        cs = arch.cos_sin(torch.tensor([delta], device=arch.device), length)
        cs = (cs[0].float().cpu(), cs[1].float().cpu())
        return torch.stack([arch.shift(q[layer].float().unsqueeze(-2), cs, layer).squeeze(-2)
                            for layer in range(q.shape[0])])

    # ---- hooks ---------------------------------------------------------------------------
    def prepare(self, state) -> None:
        p = self.params
        lay = state.layout
        n = lay.n

        spans = lay.spans(CACHED)
        keep = torch.ones(n, dtype=torch.bool)
        recompute = torch.zeros(n, dtype=torch.bool)
        if not spans:
            state.scratch["samkv"] = None
            state.scratch["samkv_recompute"] = recompute
            return
        L = state.arch.n_layers
        stable = self.stable_layers(L)
        docs = [doc_blocks(s, e, self.block_size_for(e - s), p.initial_blocks, p.local_blocks) for _, s, e in spans]
        doc_keys = [self._memo_key(lay.pieces[si], stable, p.local_blocks * d.block_size, state.arch, lay.n)
                    for (si, _, _), d in zip(spans, docs)]
        q_que, q_loc, query_attn, context_attn = self._preliminary(
            state, docs, [lay.pieces[si] for si, _, _ in spans], doc_keys, stable)
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
            qhat, [state.K[layer] for layer in stable], docs,
            adaptive_p=p.adaptive_p, normalize=p.normalize, **budget,
        )
        keep[cached] = False
        for d, kept in zip(docs, sel.kept):
            for s, e in d.forced:
                keep[s:e] = True
            for b in kept:
                s, e = d.middle[b]
                keep[s:e] = True

        # Local recomputation (§3.3 / A.1): initial/local tokens ranked by the question's
        # attention in the compressed prefill, kept middle tokens by the attention they got in
        # their original context; the budget is split in proportion to the two pools so that
        # the two differently-normalized scores are never compared with each other.
        forced_mask = torch.zeros(n, dtype=torch.bool)
        for d in docs:
            for s, e in d.forced:
                forced_mask[s:e] = True
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
        state.scratch.setdefault("policy_stats", {}).update({
            "samkv.kept_fraction": kept_cached / n_cached,
            "samkv.mean_p": sum(sel.p) / len(sel.p),
            "samkv.middle_blocks_kept": sum(len(k) for k in sel.kept),
            "samkv.recomputed": int(recompute.sum()),
            "samkv.prelim_rows": state.scratch["samkv_prelim_rows"],
            "samkv.docs_from_store": state.scratch.pop("samkv_from_store"),
        })
        state.scratch["samkv_recompute"] = recompute
        state.scratch["samkv"] = SamKVInfo(
            docs=docs, stable=stable, q_que=q_que.cpu(), q_loc=q_loc.cpu(), qhat=qhat.cpu(),
            selection=sel, keep=keep, recompute=recompute, query_attn=query_attn, context_attn=context_attn,
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
        rows = state.layout.cached.to(k.device)[state.active]
        if not bool(rows.any()):
            return None
        idx = state.active[rows]
        for new, old_all in ((k, state.K[layer]), (v, state.V[layer])):
            fresh, old = new[:, rows].float(), old_all[:, idx].float()
            if self.params.theta is None:
                # Eq. 4: theta = cos(new, old) per token and head; a negative cosine would
                # extrapolate away from both, so it is clamped to [0, 1].
                theta = torch.nn.functional.cosine_similarity(fresh, old, dim=-1).clamp(0, 1).unsqueeze(-1)
            else:
                theta = float(self.params.theta)
            # In place: the engine writes these very tensors into the cache right after this
            # hook and attends with them, so the fused K/V are what this and later layers see.
            new[:, rows] = (theta * fresh + (1 - theta) * old).to(new.dtype)
        return None
