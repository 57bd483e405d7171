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

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvrag.checks import check_int, check_real, check_seq
from kvrag.layout.state import CACHED
from kvrag.policies.base import Policy, RecomputeParams, param, top_indices
from kvrag.policies.registry import register
from kvrag.policies.samkv.preliminary import prelim_pass
from kvrag.policies.samkv.selection import (
    NORMALIZATIONS,
    DocBlocks,
    Selection,
    doc_blocks,
    personalized_queries,
    select_blocks,
)

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
        stored_as = piece.entry.kv_format or str(piece.entry.keys.dtype)
        return (piece.key, tuple(piece.span), stored_as, span, tuple(stable), freq)

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
