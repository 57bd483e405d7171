"""The fusion engine: a layer-by-layer prefill over plain and cached segments.

Cached chunks' keys (stored pre-RoPE) are rotated to their global positions, as are a kept
prompt prefix's (``kvrag.query.prefix``: exact, computed only where a policy asks); plain
segments (template, question) and policy-inserted tokens are computed; at every layer the
policy may narrow the set of tokens that are computed ("active"). Active tokens' fresh K/V overwrite the
cached rows, and attend to the whole fused K/V with a causal mask in *global* positions.
The engine names no policy: it only calls the hooks of ``kvrag.policies.base.Policy``.

Shapes: ``N`` tokens in the fused prompt, ``A`` active tokens, ``L`` layers, ``Hkv`` KV heads,
``D`` head dim, ``E`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvrag.arch import Arch, AttentionPlan, visible_keys
from kvrag.layout.state import CACHED, INSERTED, PREFIX, FusionState, FusionStats, Layout, Piece
from kvrag.policies.base import Policy
from kvrag.query.compiled import CompiledRows
from kvrag.store.base import ChunkEntry
from kvrag.store.kv_format import PackedRows, head_dim_of


@dataclass
class FusionResult:
    """logits [V] of the last prompt token; K/V per layer [Hkv, M, D] of the kept tokens
    (M = kept), positions [M] — or [L, Hkv, M] when the policy evicted per layer and head
    (``FusionState.kv_index``); ``next_position`` is where decoding continues."""

    logits: torch.Tensor
    K: list[torch.Tensor]
    V: list[torch.Tensor]
    positions: torch.Tensor
    next_position: int
    stats: FusionStats
    state: FusionState | None = None


def gather_slots(K, V, kv_index, positions):
    """Per-layer, per-head slot selection. K/V: per layer [Hkv, N, D]; kv_index: per layer
    LongTensor [Hkv, M] -> (K, V per layer [Hkv, M, D], positions [L, Hkv, M])."""
    Kout, Vout, pos = [], [], []
    for k, v, idx in zip(K, V, kv_index):
        idx = idx.to(k.device)
        g = idx.unsqueeze(-1).expand(-1, -1, k.shape[-1])
        Kout.append(k.gather(1, g))
        Vout.append(v.gather(1, g))
        pos.append(positions[idx])
    return Kout, Vout, torch.stack(pos)


def on_device(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Chunk tensors [L, Hkv, T_i, D] moved to ``device`` as stored: one asynchronous copy per
    chunk from a pinned read, nothing to do for hot-tier entries already there."""
    return [p.to(device=device, non_blocking=True) for p in parts]


def layer_rows(parts: list[torch.Tensor], layer: int, dtype: torch.dtype) -> torch.Tensor:
    """One layer of chunk tensors [L, Hkv, T_i, D] joined in ``dtype``: [Hkv, sum T_i, D]."""
    return torch.cat([p[layer] for p in parts], dim=1).to(dtype)


class StoredRows:
    """The stored entries' K/V joined along their tokens (C = sum T_i), in the compute dtype
    on the compute device, served one layer at a time (``layer``) or all layers at once
    (``block``). Served by layer, each run of consecutive packed entries of one format stays
    packed until its layer is asked for (``PackedRows``: only the packed bytes are held for
    the whole prompt), beside the float entries (a kept prefix's, say). All layers at once
    (a GPU's placement), every entry is expanded whole first."""

    def __init__(self, entries: list[ChunkEntry], device: torch.device, dtype: torch.dtype, by_layer: bool) -> None:
        self.dtype = dtype
        # Consecutive entries of one storage format, in prompt order: each run is a
        # PackedRows or the float entries' tensors per kind.
        self._runs: list[PackedRows | dict[str, list[torch.Tensor]]] = []
        kinds = ("keys", "values")
        for _, run in itertools.groupby(entries, key=lambda e: e.kv_format if by_layer else ""):
            group = list(run)
            if by_layer and group[0].packed:
                self._runs.append(
                    PackedRows(
                        group[0].kv_format,
                        head_dim_of(group[0].scales),
                        {k: [getattr(e, k) for e in group] for k in kinds},
                        {k: [e.stats_of(k) for e in group] for k in kinds},
                        device,
                    )
                )
            else:
                floats = [e.expanded(device, dtype) for e in group]
                self._runs.append({k: on_device([getattr(e, k) for e in floats], device) for k in kinds})

    def layer(self, kind: str, layer: int) -> torch.Tensor:
        """``kind`` (``"keys"``, ``"values"``) at ``layer``: [Hkv, C, D]."""
        parts = [
            run.layer(kind, layer, self.dtype)
            if isinstance(run, PackedRows)
            else layer_rows(run[kind], layer, self.dtype)
            for run in self._runs
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def block(self, kind: str) -> torch.Tensor:
        """``kind`` at every layer: [L, Hkv, C, D] (built without ``by_layer``: one float run)."""
        (run,) = self._runs
        assert not isinstance(run, PackedRows)
        return torch.cat(run[kind], dim=2).to(self.dtype)


@dataclass
class _Keys:
    """The key slots attention reads: ``idx`` [N'] of the kept tokens (None: all N), ``pos``
    [N'] their positions."""

    idx: torch.Tensor | None
    pos: torch.Tensor


#: Most row groups of a windowed layer's attention (each is one attention call).
MAX_WINDOW_GROUPS = 32


class _Rows:
    """What the layer loop derives from the active set [A] and ``state.keep`` [N], built once
    per active set / keep tensor instead of once per layer: active positions, their RoPE rows,
    the kept key slots, the causal mask [A, N'] and the attention's row-group plan.

    Keyed by tensor identity: the engine makes a new ``active`` when it narrows, and policies
    replace ``state.keep`` (SamKV, in ``prepare``) rather than writing into it."""

    def __init__(self, arch: Arch, positions: torch.Tensor, positions_sorted: bool) -> None:
        self.arch, self.positions, self.sorted = arch, positions, positions_sorted
        self._active: torch.Tensor | None = None
        self._keep: torch.Tensor | None = None
        self._pos_q: torch.Tensor
        self._keys: _Keys
        self._cs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._causal: tuple[torch.Tensor, AttentionPlan | None] | None = None
        self._windowed: dict[int, AttentionPlan] = {}
        self._additive: torch.Tensor | None = None

    def _see(self, active: torch.Tensor) -> None:
        if active is not self._active:
            self._active = active
            self._pos_q = self.positions[active]
            self._cs = self._causal = None
            self._windowed = {}

    def pos_q(self, active: torch.Tensor) -> torch.Tensor:
        self._see(active)
        return self._pos_q

    def cos_sin(self, active: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        self._see(active)
        if self._cs is None:
            self._cs = (cos[active], sin[active])
        return self._cs

    def keys(self, keep: torch.Tensor) -> _Keys:
        if keep is not self._keep:
            self._keep = keep
            idx = None if bool(keep.all()) else keep.nonzero().squeeze(1)
            self._keys = _Keys(idx, self.positions if idx is None else self.positions[idx])
            self._causal = None
            self._windowed = {}
        return self._keys

    def causal(self, active: torch.Tensor):
        """(mask bool [A, N'], attention plan or None) for the active rows over the kept keys
        (``keys`` first)."""
        self._see(active)
        if self._causal is None:
            key_pos = self._keys.pos
            mask = self._pos_q[:, None] >= key_pos[None, :]
            plan = None
            if self.sorted:  # each row's horizon is a key prefix
                plan = self.arch.attention_plan(torch.searchsorted(key_pos, self._pos_q, right=True))
            self._causal = (mask, plan)
            self._additive = None
        return self._causal

    def windowed(self, active: torch.Tensor, window: int | None) -> AttentionPlan | None:
        """The row groups of a layer whose queries see only the keys of the last ``window``
        positions (``keys`` first): the active rows cut where they span a window's worth of
        positions (at most ``MAX_WINDOW_GROUPS`` groups), each group reading keys from the
        first one inside its first row's window to the last its last row sees. Rows spread
        over a long prompt (a question, link tokens, recomputed tokens) then read a few windows
        of keys, not every key before them. None where the layer has no window or the keys are
        not in prompt order. Two host reads per active set and window size."""
        if window is None or not self.sorted:
            return None
        self._see(active)
        if window not in self._windowed:
            pos = self._pos_q.tolist()
            los = [0]
            for i, p in enumerate(pos):
                if p - pos[los[-1]] >= window:
                    los.append(i)
            if len(los) > MAX_WINDOW_GROUPS:  # each group is an attention call: merge evenly
                los = los[:: -(-len(los) // MAX_WINDOW_GROUPS)]
            his = los[1:] + [len(pos)]
            k0, k1 = visible_keys(self._keys.pos, [pos[lo] for lo in los], [pos[hi - 1] for hi in his], window)
            # At least one key a group (as ``attention_plan``): a group with none would give NaN rows.
            k1 = [max(1, b) for b in k1]
            self._windowed[window] = [(lo, hi, min(a, b - 1), b) for lo, hi, a, b in zip(los, his, k0, k1)]
        return self._windowed[window]

    def additive(self, active: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``causal``'s mask as SDPA's additive float mask [A, N'] (0 = may attend, -inf = not),
        made once: SDPA converts a bool mask to exactly this at every call (3 ops a call, a
        call per layer and row group)."""
        mask, _ = self.causal(active)
        if self._additive is None or self._additive.dtype != dtype:
            self._additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return self._additive


class FusionEngine:
    """Runs a policy-driven fused prefill over a ``Layout``."""

    def __init__(self, arch: Arch) -> None:
        self.arch = arch
        #: How ``cached_kv`` places the chunks' rows. Layer by layer (True: ~7 ops a layer):
        #: a layer's temporaries, a few MB, stay in a CPU's cache, where all layers at once
        #: push hundreds of MB at 4k tokens through memory three times more, into fresh pages
        #: (SmolLM2, 4k tokens, 2 cores: ~55 ms of a 440 ms TTFT). All layers at once (False:
        #: ~2 ops a layer): a GPU, whose bandwidth makes those passes cheap, pays per kernel
        #: launch instead. None: by the device, as said.
        self.layerwise: bool | None = None
        #: The layer loop compiled from where a policy's rows are fixed (``CompiledRows``;
        #: set by ``KVRag(compile=...)``); None: every prefill runs op by op.
        self.compiled: CompiledRows | None = None

    def apply_insertions(self, pieces: list[Piece], policy: Policy, query_tokens=None) -> Layout:
        layout = Layout.build(pieces, query_tokens)
        inserts = policy.insertions(layout, self.arch)
        if not inserts:
            return layout
        out: list[Piece] = []
        for i, p in enumerate(pieces):
            out.append(p)
            if i in inserts:
                emb = inserts[i]
                out.append(Piece(torch.zeros(emb.shape[0], dtype=torch.long), INSERTED, embeds=emb))
        return Layout.build(out, query_tokens)

    def cached_kv(self, layout: Layout, cos: torch.Tensor, sin: torch.Tensor):
        """Fused K/V per layer [Hkv, N, D], the stored rows (cached chunks, a kept prefix)
        filled with their entries' keys rotated to their global positions (cos/sin [N, D]:
        tables of all N positions) and their values; the other rows uninitialised. Returns (K,
        V, {piece index: entry} of the cached chunks).

        A fixed number of ops whatever the number of chunks: the chunks' rows are joined,
        rotated at once and placed with one ``index_copy_`` per layer, rather than rotated and
        copied chunk by chunk, layer by layer (``chunks x L x 5`` ops). How the layers are
        walked depends on what bounds the device (``layerwise``)."""
        arch = self.arch
        n, dev, dt = layout.n, arch.device, arch.dtype
        L, hkv, d = arch.n_layers, arch.n_kv_heads, arch.head_dim
        # Uninitialised on purpose (zero-filling ~100 MB costs tens of ms of TTFT): cached rows
        # are filled here, and every other row is a required token, computed -- and so written
        # -- at each layer before any attention reads it.
        # One tensor per layer, not one [L, ...] block: the decoder's cache replaces them layer
        # by layer as it grows, and a shared block would stay alive (twice the KV memory)
        # until the last layer's was replaced.
        K = [torch.empty(hkv, n, d, dtype=dt, device=dev) for _ in range(L)]
        V = [torch.empty(hkv, n, d, dtype=dt, device=dev) for _ in range(L)]
        stored = [p for p in layout.pieces if p.kind in (CACHED, PREFIX)]
        entries = {si: layout.pieces[si].entry for si, _, _ in layout.spans(CACHED)}
        if not stored:
            return K, V, entries
        rows = layout.stored.nonzero().squeeze(1).to(dev)  # [C], in prompt order like the pieces
        layerwise = self.layerwise if self.layerwise is not None else dev.type == "cpu"
        source = StoredRows([p.entry for p in stored], dev, dt, by_layer=layerwise)
        cos_sin = (cos[rows], sin[rows])
        if layerwise:
            rotated = torch.empty(hkv, rows.numel(), d, dtype=dt, device=dev)
            for layer in range(L):
                arch.rotate(source.layer("keys", layer), None, cos_sin, out=rotated, layer=layer)
                K[layer].index_copy_(1, rows, rotated)
                V[layer].index_copy_(1, rows, source.layer("values", layer))
            return K, V, entries
        all_keys = arch.rotate_layers(source.block("keys"), cos_sin)  # [L, Hkv, C, D]
        all_values = source.block("values")
        for layer in range(L):
            K[layer].index_copy_(1, rows, all_keys[layer])
            V[layer].index_copy_(1, rows, all_values[layer])
        return K, V, entries

    @torch.no_grad()
    def prefill(self, layout: Layout, policy: Policy, keep_state: bool = False) -> FusionResult:
        """Ops per layer do not depend on the number of chunks, and the layer loop reads
        nothing back to the host unless the policy narrows the active set or replaces
        ``state.keep`` (masks, index tables and RoPE rows are built once per active set)."""
        arch = self.arch
        n, dev, dt = layout.n, arch.device, arch.dtype
        L = arch.n_layers
        positions = layout.positions.to(dev)
        positions_sorted = layout.in_prompt_order
        cos, sin = arch.cos_sin(positions)
        K, V, entries = self.cached_kv(layout, cos, sin)

        state = FusionState(
            arch=arch,
            layout=layout,
            K=K,
            V=V,
            keep=torch.ones(n, dtype=torch.bool, device=dev),
            active=torch.empty(0, dtype=torch.long),
            cos=cos,
            sin=sin,
            layer_counts=torch.zeros(n, dtype=torch.long),
            entries=entries,
        )
        del K, V
        policy.prepare(state)
        required_cpu = state.required
        active_cpu = (policy.initial_active(state).cpu() | required_cpu).nonzero().squeeze(1)
        active = active_cpu.to(dev)
        state.active = active

        # Input embeddings of the active tokens (inserted tokens bring their own).
        hidden = arch.embed(layout.token_ids[active_cpu])
        ins = layout.kind[active_cpu] == INSERTED
        if ins.any():
            # Inserted tokens are never cached, so all of them are active, in prompt order:
            # their rows take the pieces' embeddings in one write.
            embeds = [layout.pieces[si].embeds for si, _, _ in layout.spans(INSERTED)]
            emb = torch.cat([e.to(device=dev, dtype=dt) for e in embeds if e is not None])
            hidden[ins.to(dev)] = emb

        # What depends only on the active set and on state.keep, rebuilt when either changes.
        rows = _Rows(arch, positions, positions_sorted)
        counted_from = 0  # layer from which the current active set has been computed
        compiled = self.compiled
        fixed_after = policy.rows_fixed_after() if compiled is not None else None
        for layer in range(L):
            if compiled is not None and fixed_after is not None and layer > fixed_after:
                fixed_after = None  # the rows are fixed from here on: decided once
                fits = 1 < active.numel() < n and rows.keys(state.keep).idx is None
            else:
                fits = False
            if compiled is not None and fits and rows.causal(active)[1] is None:
                # No hook to call from here on: the rest of the loop is one compiled graph
                # (None: it could not be built here, and the loop goes on op by op). Only where
                # each layer's attention is one call over the whole mask: rows spread over the
                # prompt (a recompute policy's hundreds) are attended in groups over key
                # prefixes (``attention_plan``), about half the arithmetic, which the graph
                # would not skip (cacheblend at 4k tokens on a CPU: 1.16x slower compiled).
                cs = rows.cos_sin(active, cos, sin)
                out = compiled(layer, hidden, cs, active, state.K, state.V, rows.additive(active, hidden.dtype))
                if out is not None:
                    hidden = out
                    break
            cs = rows.cos_sin(active, cos, sin)
            q, k, v, _ = arch.qkv(layer, hidden, cs)
            sel = policy.select(layer, state, q, k, v)
            state.K[layer][:, active] = k
            state.V[layer][:, active] = v
            if sel is not None:
                # Counted before narrowing: every active token's K/V is computed at this layer.
                state.layer_counts[active_cpu] += layer + 1 - counted_from
                counted_from = layer + 1
                # The engine, not the policy, guarantees the question/template/last token
                # stay computed: without them there are no logits and no fresh query rows.
                keep_rows = required_cpu[active_cpu]
                keep_rows[sel.cpu()] = True
                sel = keep_rows.nonzero().squeeze(1)
                active_cpu = active_cpu[sel]
                sel = sel.to(dev)
                active, q, hidden = active[sel], q[:, sel], hidden[sel]
                state.active = active
            # Policies may drop tokens (SamKV) at any layer: attend only to kept rows.
            keys_at = rows.keys(state.keep)
            extra = policy.extra_mask(state, active)
            window = arch.window_mask(layer, rows.pos_q(active), keys_at.pos)
            if keys_at.idx is None and extra is None and window is None and active.numel() == n:
                # Every token computed, nothing dropped: plain causal attention.
                hidden = arch.attend(layer, hidden, q, state.K[layer], state.V[layer], None, causal=True)
                continue
            if keys_at.idx is None:
                keys, vals = state.K[layer], state.V[layer]
            else:
                keys, vals = state.K[layer][:, keys_at.idx], state.V[layer][:, keys_at.idx]
            mask, plan = rows.causal(active)
            if extra is None and window is None and arch.attn_softcap is None:
                # (Soft-capped attention, Gemma 2, runs its own maths on the bool mask.)
                mask = rows.additive(active, q.dtype)
            if extra is not None:
                mask = mask & (extra if keys_at.idx is None else extra[:, keys_at.idx])
            if window is not None:  # the layer's sliding window (Mistral, Qwen2/3, Gemma configs)
                mask = mask & window
                plan = rows.windowed(active, arch.windows[layer]) or plan
            # Active rows and key slots are both in prompt order, so each row's causal horizon
            # is a key prefix: the attention may skip what lies past it (``plan``).
            hidden = arch.attend(layer, hidden, q, keys, vals, mask, plan=plan)
        state.layer_counts[active_cpu] += L - counted_from

        # Active rows are in prompt order and the last token is always active: it is the last row.
        logits = arch.logits(hidden[-1:])[0]
        policy.after_prefill(state)

        keep_idx = rows.keys(state.keep).idx  # None: every token kept
        if state.kv_index is not None:
            Kout, Vout, out_pos = gather_slots(state.K, state.V, state.kv_index, positions)
        elif keep_idx is None:
            Kout, Vout, out_pos = state.K, state.V, positions
        else:
            Kout = [k[:, keep_idx] for k in state.K]
            Vout = [v[:, keep_idx] for v in state.V]
            out_pos = positions[keep_idx]
        cached = layout.cached
        n_cached = int(cached.sum())
        n_prefix = sum(int(p.token_ids.numel()) for p in layout.pieces if p.kind == PREFIX)
        counts = state.layer_counts[cached]
        stats = FusionStats(
            prompt_tokens=n,
            cached_tokens=n_cached,
            prefix_tokens=n_prefix,
            computed_tokens=n - n_cached - n_prefix,
            inserted_tokens=int((layout.kind == INSERTED).sum()),
            recomputed_tokens=int((counts == L).sum()) if n_cached else 0,
            recompute_fraction=float(counts.sum()) / (n_cached * L) if n_cached else 0.0,
            kept_tokens=int(Kout[0].shape[1]) if Kout else int(state.keep.sum()),
            chunks_hit=len(entries),
            policy=policy.name,
            policy_stats=state.scratch.setdefault("policy_stats", {}),
        )
        return FusionResult(
            logits=logits,
            K=Kout,
            V=Vout,
            positions=out_pos,
            next_position=int(layout.positions[-1]) + 1,
            stats=stats,
            state=state if keep_state else None,
        )
