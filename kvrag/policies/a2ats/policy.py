"""``a2ats``: decode-time top-K key retrieval from vector-quantized codes (A²ATS, He et al. 2025).

Prefill fuses the cached chunks as configured (``prefill="naive"`` — naive reuse, the
default — or ``"cacheblend"`` with ``recompute_ratio``). Decoding is where A²ATS acts: every
key in the cache has a small integer code per KV head (computed at precompute time by
``chunk_extras`` and stored with the chunk, or on the fly); at each decode step and layer

1. the query is rotated once by the fixed offset ``b`` (Windowed RoPE, eq. 11-12) and
   multiplied with the codebook: a [G, C] table of approximate scores per KV head;
2. a key's approximate score is a lookup ``table[code]`` (eq. 21) — no key is read;
3. each KV head keeps its top ``topk`` fraction of the context by approximate score, plus the
   first ``sink`` and the last ``window`` tokens (whose scores use exact RoPE, so they are
   simply always attended);
4. exact attention runs over those rows only.

The full K/V stays where it is (CPU memory here); the policy reports how many KV bytes the
decode steps read versus full attention in ``stats.policy_stats`` (``a2ats.*`` keys).
Codebooks come from ``kvrag calibrate a2ats`` (see ``kvrag.policies.a2ats.calibrate``).
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrag.checks import check_int, check_real
from kvrag.layout.state import CACHED
from kvrag.policies.a2ats import codebook as books
from kvrag.policies.base import Policy, param, top_k_indices
from kvrag.policies.registry import register

log = logging.getLogger("kvrag")

PREFILLS = ("naive", "cacheblend")
SELECTIONS = ("per_head", "union")
REDUCES = ("prob", "score")
CODES_KEY = "a2ats.codes"
CODEBOOK_KEY = "a2ats.codebook"


@dataclass
class A2ATSParams:
    topk: float = param(
        0.03,
        "fraction of the context each KV head reads by approximate score, beyond the sink "
        "and window tokens (paper 0.03); 1.0 = every token (exact attention)",
    )
    sink: int = param(4, "first tokens always attended (paper 4)")
    window: int = param(64, "w: the last w tokens are always attended with exact RoPE (paper 64)")
    rope_offset: int | None = param(
        None,
        "b: fixed relative position used to score keys outside the window "
        "(paper 2048); None = the value the codebook was calibrated with",
    )
    selection: str = param(
        "per_head",
        "'per_head': each KV head reads its own top-k rows (paper); "
        "'union': all KV heads read the union of their top-k rows",
    )
    group_reduce: str = param(
        "prob",
        "GQA: combine the approximate scores of the query heads sharing a KV head "
        "as summed softmax probabilities ('prob') or summed raw scores ('score')",
    )
    prefill: str = param("naive", "prefill fusion: 'naive' (naive_reuse) or 'cacheblend' (with recompute_ratio)")
    recompute_ratio: float = param(0.15, "fraction of cached tokens recomputed when prefill='cacheblend'")
    codebook: str | None = param(
        None, "codebook file; None = the one `kvrag calibrate a2ats` fitted for this model under $KVRAG_HOME/a2ats/"
    )


@register
class A2ATS(Policy):
    name = "a2ats"
    summary = (
        "decode-time top-k attention: keys scored from query-aware VQ codes (windowed RoPE); each KV head "
        "reads its top 3% + sink + window rows"
    )
    Params = A2ATSParams
    setup = "needs per-model codebooks first: kvrag calibrate a2ats"

    def validate(self) -> None:
        p = self.params
        p.topk = check_real("topk (a fraction of the context)", p.topk, 0.0, 1.0, lo_open=True)
        p.sink = check_int("sink", p.sink, 0)
        p.window = check_int("window", p.window, 1)  # the token being decoded is the last row and must see itself
        if p.rope_offset is not None:
            p.rope_offset = check_int("rope_offset", p.rope_offset, 0)
        if p.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {p.selection!r}")
        if p.group_reduce not in REDUCES:
            raise ValueError(f"group_reduce must be one of {REDUCES}, got {p.group_reduce!r}")
        if p.prefill not in PREFILLS:
            raise ValueError(f"prefill must be one of {PREFILLS}, got {p.prefill!r}")
        p.recompute_ratio = check_real("recompute_ratio", p.recompute_ratio, 0.0, 1.0)
        if p.codebook is not None and not Path(p.codebook).is_file():
            raise ValueError(f"codebook file {p.codebook!r} does not exist (fit one with `kvrag calibrate a2ats`)")
        from kvrag.policies.registry import get_policy

        # The prefill is another policy's job: delegate its hooks instead of re-implementing it.
        self.inner = (
            get_policy("naive_reuse")
            if p.prefill == "naive"
            else get_policy("cacheblend", recompute_ratio=float(p.recompute_ratio))
        )
        self._books: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned = False

    # ---- codebooks ---------------------------------------------------------------------
    def codebooks(self, arch, required: bool = True) -> books.Codebooks | None:
        """This model's codebooks (memoized per model); CodebookError if ``required`` and none."""
        cb = self._books.get(arch.model)
        if cb is None:
            if self.params.codebook is not None:
                cb = books.verify_for_model(books.load_cached(self.params.codebook), arch, repr(self.params.codebook))
            else:
                cb = books.find_codebooks(arch)
            if cb is None:
                if required:
                    raise books.CodebookError(
                        f"no A2ATS codebook for this model in {str(books.codebook_dir())!r}; "
                        "fit one with `kvrag calibrate a2ats` (or pass codebook=PATH)"
                    )
                return None
            cb.check_model(arch.n_layers, arch.n_kv_heads, arch.head_dim)
            self._books[arch.model] = cb
        return cb

    # ---- ingestion ---------------------------------------------------------------------
    def chunk_extras(self, arch, keys, values, token_ids):
        """{"a2ats.codes": int16 [L, Hkv, T], "a2ats.codebook": uint8 [16] (which codebook)},
        or {} when the model has no codebook yet (codes are then made at query time)."""
        cb = self.codebooks(arch, required=False)
        if cb is None:
            if not self._warned:
                log.warning(
                    "a2ats: no codebook for this model; chunk codes will be computed at query time "
                    "(run `kvrag calibrate a2ats`)"
                )
                self._warned = True
            return {}
        return {CODES_KEY: cb.codes(keys), CODEBOOK_KEY: cb.digest_tensor()}

    # ---- prefill: delegated ----------------------------------------------------------------
    def insertions(self, layout, arch):
        return self.inner.insertions(layout, arch)

    def check_model(self, arch) -> None:
        self.codebooks(arch)  # CodebookError naming `kvrag calibrate a2ats` if there is none
        self.inner.check_model(arch)

    def prepare(self, state) -> None:
        # Fail before any layer runs if there is no codebook.
        cb = self.codebooks(state.arch)
        assert cb is not None  # required=True raises instead
        b = self.params.rope_offset if self.params.rope_offset is not None else cb.rope_offset
        # Codes are made, scored and selected where the K/V live.
        state.scratch["a2ats"] = {"codebooks": cb.to(state.K[0].device), "rope_offset": b}
        stats = state.scratch.setdefault("policy_stats", {})
        stats.update(
            {
                "a2ats.codes_reused": 0,
                "a2ats.codes_computed": 0,
                "a2ats.decode_tokens": 0,
                "a2ats.kv_bytes_read": 0,
                "a2ats.kv_bytes_full": 0,
                "a2ats.code_bytes_read": 0,
                "a2ats.kv_read_fraction": 1.0,
                "a2ats.kv_bytes_read_per_token": 0.0,
            }
        )
        self.inner.prepare(state)

    def initial_active(self, state):
        return self.inner.initial_active(state)

    def select(self, layer, state, q, k, v):
        return self.inner.select(layer, state, q, k, v)

    def extra_mask(self, state, rows):
        return self.inner.extra_mask(state, rows)

    def after_prefill(self, state) -> None:
        self.inner.after_prefill(state)
        sc = state.scratch["a2ats"]
        sc.update(self.prefill_codes(state, sc["codebooks"]))

    def prefill_codes(self, state, cb: books.Codebooks) -> dict:
        """Codes of every row after the fused prefill, on ``cb``'s device (the K/V's).

        A cached row whose K was never recomputed keeps its chunk's codes (stored extras made
        with this very codebook, else computed from the chunk's pre-RoPE keys); a row computed
        at query time at a layer (plain/inserted tokens, CacheBlend's recomputed tokens) gets
        codes from its fused key un-rotated by its position. The prefills A2ATS delegates to
        keep every token (``state.keep`` stays all True), so the codes cover all N rows, as
        the fused cache does. Returns {"codes": per layer LongTensor [Hkv, N], "m0": N,
        "next_position": int}."""
        arch, layout = state.arch, state.layout
        L, hkv, n = arch.n_layers, arch.n_kv_heads, layout.n
        # Every entry is written: cached rows from their chunk below, and every other row is
        # computed (so coded) at every layer.
        codes = torch.empty(L, hkv, n, dtype=torch.long, device=cb.device)
        from_store = torch.zeros(n, dtype=torch.bool)  # rows whose chunk brought codes of this codebook
        for si, start, end in layout.spans(CACHED):
            c, reused = self.entry_codes(state.entries.get(si, layout.pieces[si].entry), cb)
            codes[:, :, start:end] = c  # one copy per chunk to the device
            from_store[start:end] = reused
        positions = layout.positions
        layers, order, n_at = self.computed_rows(state)
        # Rows and their positions go to the device in one copy; each layer's are a prefix.
        rows, pos = torch.stack([order, positions[order]]).to(cb.device)
        # A length-dependent RoPE rotated the prompt with the tables of its whole length. Every
        # layer computes the last token, which in prompt order holds the largest position, so
        # each layer's rows give that length by themselves (passing it would make ``cos_sin``
        # read their largest position back from the device).
        length = None if layout.in_prompt_order else int(positions.max()) + 1
        for layer in range(L):
            r = n_at[layer]
            if r:
                k = state.K[layer][:, rows[:r]]
                k_pre = arch.unrotate(k, pos[:r], layer, length=length)
                codes[layer][:, rows[:r]] = cb.codes_layer(layer, k_pre, dtype=torch.long)
        # Counted per (token, layer): a cached token CacheBlend recomputed at some layers keeps
        # its stored codes only at the others.
        reused_pairs = int(((L - layers) * from_store).sum())
        stats = state.scratch["policy_stats"]
        stats["a2ats.codes_reused"] += reused_pairs
        stats["a2ats.codes_computed"] += L * n - reused_pairs
        return {"codes": list(codes.unbind(0)), "m0": n, "next_position": int(positions[-1]) + 1}

    @staticmethod
    def computed_rows(state) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(layers [N]: how many layers computed each row, rows [R] computed at layer 0 with
        the most computed first, n_at: per layer how many of them it computed), on the host
        from ``state.layer_counts``. Active sets only shrink layer by layer, so the rows a
        layer computed are those computed at more layers than its index: a prefix of ``rows``
        (``rows[:n_at[layer]]``, in prompt order among rows computed equally often)."""
        L = state.arch.n_layers
        layers = torch.where(state.layout.cached, state.layer_counts, L)  # non-cached rows: every layer
        order = torch.sort(layers, descending=True, stable=True).indices
        n_at = (layers > torch.arange(L)[:, None]).sum(1).tolist()
        return layers, order[: n_at[0]], n_at

    @staticmethod
    def entry_codes(entry, cb: books.Codebooks) -> tuple[torch.Tensor, bool]:
        """(codes int16 [L, Hkv, T], reused?) of a cached chunk: its stored codes (where the
        store keeps them) when they were made with ``cb``, else codes computed on ``cb``'s
        device from its pre-RoPE keys."""
        extras = getattr(entry, "extras", None) or {}
        stored, digest = extras.get(CODES_KEY), extras.get(CODEBOOK_KEY)
        t = entry.keys.shape[2]
        if (
            stored is not None
            and digest is not None
            and bytes(digest.to(torch.uint8).tolist()) == cb.digest
            and tuple(stored.shape) == (cb.n_layers, cb.n_kv_heads, t)
        ):
            return stored, True
        if entry.packed:  # coded from the keys the prefill places: the packed ones expanded
            entry = entry.expanded(cb.device, torch.float32)
        return cb.codes(entry.keys), False

    # ---- decode --------------------------------------------------------------------------
    def _codes_upto(self, layer: int, stepper, sc: dict, upto: int) -> torch.Tensor:
        """Codes [Hkv, >= upto] of the cache rows at ``layer``, on the K/V's device; rows
        appended while decoding are coded when they leave the window (their pre-RoPE key = fused
        key rotated back)."""
        codes = sc["codes"][layer]
        have = codes.shape[1]
        if have < upto:
            K = stepper.K[layer]
            # Decoded row r holds the token at position next_position + r - m0.
            first = sc["next_position"] + have - sc["m0"]
            pos = torch.arange(first, first + upto - have, device=K.device)
            # Each decoded token was rotated with its own tables (sequence length = its position
            # + 1; matters for LongRoPE): what one row's tables give by themselves. Rows coded
            # together (never once the window is full: a step codes one) pass their lengths,
            # which ``unrotate`` reads back to group them.
            length = None if upto - have == 1 else pos + 1
            k_pre = stepper.arch.unrotate(K[:, have:upto], pos, layer, length=length)
            codes = torch.cat([codes, sc["codebooks"].codes_layer(layer, k_pre, dtype=torch.long)], dim=1)
            sc["codes"][layer] = codes
        return codes

    def decode_select(self, layer: int, q: torch.Tensor, stepper):
        """Cache rows the decoded token reads at ``layer``.

        q [H, 1, D] (rotated at the token's position ``stepper.pos``); ``stepper.K[layer]``
        [Hkv, M, D] already holds the token's own key as the last row. Returns LongTensor
        [Hkv, R] (per-head rows, sorted) for ``selection='per_head'``, [R] for 'union', on the
        K/V's device, or None (read everything) when the context is no longer than sink + window.
        Scoring and selection stay on that device: sizes come from shapes and host counters, so
        only a sliding-window layer (one read) and 'union' (``unique``) wait for it."""
        p = self.params
        sc = stepper.state.scratch["a2ats"]
        stats = stepper.state.scratch["policy_stats"]
        arch = stepper.arch
        K = stepper.K[layer]
        hkv, m, d = K.shape
        row_bytes = 2 * d * K.element_size()
        if layer == 0:
            stats["a2ats.decode_tokens"] += 1
        lo, hi = min(p.sink, m), max(m - p.window, 0)
        vis = self._visible(layer, stepper)
        if hi <= lo:
            full = hkv * m if vis is None else int(vis.sum())
            self._count(stats, full * row_bytes, full * row_bytes, 0)
            return None
        n_cand = hi - lo
        k = min(n_cand, math.ceil(float(p.topk) * m))
        # The same at every layer of a step, so made at its first: the sink and window rows, and
        # the tables of the WRoPE query (q at position i rotated by b - i is q_pre R_b). A plain
        # rotation (not ``arch.shift``): with a RoPE attention factor its product with a
        # position-free key then carries the factor twice, as the model's own q . k does.
        step = (int(stepper.pos), m)
        if sc.get("step") != step:
            offset = torch.full((1,), sc["rope_offset"] - step[0], dtype=torch.long, device=K.device)
            sc["step"], sc["cs_b"] = step, arch.cos_sin(offset)
            sc["fixed"] = torch.cat([torch.arange(lo, device=K.device), torch.arange(hi, m, device=K.device)])
        fixed, full = sc["fixed"], hkv * m
        if vis is not None:
            full, k, fixed = self._within_window(vis, lo, hi, k, fixed)
        cb = sc["codebooks"]
        codes = self._codes_upto(layer, stepper, sc, hi)[:, lo:hi]  # [Hkv, n_cand]
        qb = arch.rotate(q[:, 0].float(), None, sc["cs_b"], layer=layer)  # [H, D]
        g = qb.shape[0] // hkv
        table = torch.matmul(qb.view(hkv, g, d), cb.codebook[layer].transpose(1, 2))  # [Hkv, G, C]
        u = table.gather(2, codes[:, None, :].expand(-1, g, -1))  # [Hkv, G, n_cand] eq. 21
        if p.group_reduce == "prob":
            score = torch.softmax(u * arch.scaling, dim=-1).sum(1)
        else:
            score = u.sum(1)
        if vis is not None:
            score = score.masked_fill(~vis[:, lo:hi], float("-inf"))
        top = top_k_indices(score, k) + lo  # [Hkv, k]
        if p.selection == "per_head":
            idx = torch.cat([fixed.expand(hkv, -1), top], dim=1).sort(dim=1).values
            rows_read = hkv * idx.shape[1]
        else:
            idx = torch.cat([fixed, top.flatten()]).unique()
            rows_read = hkv * idx.numel()
        self._count(stats, rows_read * row_bytes, full * row_bytes, hkv * n_cand * 2)
        return idx

    @staticmethod
    def _visible(layer: int, stepper) -> torch.Tensor | None:
        """bool [Hkv, M]: the rows a sliding-window layer sees (its last ``windows[layer]``
        positions), on the K/V's device; None on a layer without a window. A row behind them is
        masked after selection, so picking it would waste a read that a row the layer does see
        should get (and full attention would not read it either)."""
        kpos = stepper.kpos.get(layer)
        if kpos is None:
            return None
        return (stepper.pos - kpos) < stepper.arch.windows[layer]

    @staticmethod
    def _within_window(
        vis: torch.Tensor, lo: int, hi: int, k: int, fixed: torch.Tensor
    ) -> tuple[int, int, torch.Tensor]:
        """(rows the layer sees (its "full attention" rows), ``k`` capped at the most candidates
        [lo, hi) a head sees, the ``fixed`` rows [F] some head sees) for a sliding-window layer
        (``vis`` bool [Hkv, M]). Sizes hang on the key positions, so they are read in one wait
        for the device."""
        seen = vis[:, fixed].any(0)  # [F]
        full, n_cand, n_fixed = torch.stack([vis.sum(), vis[:, lo:hi].sum(1).max(), seen.sum()]).tolist()
        # Rows some head sees first, each part in row order (a stable sort), then keep those.
        fixed = fixed[torch.sort((~seen).to(torch.uint8), stable=True).indices[:n_fixed]]
        return full, min(k, n_cand), fixed

    @staticmethod
    def _count(stats: dict, read: int, full: int, code_bytes: int) -> None:
        stats["a2ats.kv_bytes_read"] += read
        stats["a2ats.kv_bytes_full"] += full
        stats["a2ats.code_bytes_read"] += code_bytes
        stats["a2ats.kv_read_fraction"] = stats["a2ats.kv_bytes_read"] / max(stats["a2ats.kv_bytes_full"], 1)
        stats["a2ats.kv_bytes_read_per_token"] = stats["a2ats.kv_bytes_read"] / max(stats["a2ats.decode_tokens"], 1)
