"""The fusion engine: a layer-by-layer prefill over plain and cached segments.

Cached chunks' keys (stored pre-RoPE) are rotated to their global positions; plain segments
(template, question) and policy-inserted tokens are computed; at every layer the policy may
narrow the set of tokens that are computed ("active"). Active tokens' fresh K/V overwrite the
cached rows, and attend to the whole fused K/V with a causal mask in *global* positions.
The engine names no policy: it only calls the hooks of ``kvrag.policies.base.Policy``.

Shapes: ``N`` tokens in the fused prompt, ``A`` active tokens, ``L`` layers, ``Hkv`` KV heads,
``D`` head dim, ``E`` hidden size, ``V`` vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.arch import Arch
from kvrag.policies.base import Policy
from kvrag.query.state import CACHED, INSERTED, FusionState, FusionStats, Layout, Piece


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


class FusionEngine:
    """Runs a policy-driven fused prefill over a ``Layout``."""

    def __init__(self, arch: Arch) -> None:
        self.arch = arch

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

    @torch.no_grad()
    def prefill(self, layout: Layout, policy: Policy, keep_state: bool = False) -> FusionResult:
        arch = self.arch
        n, dev, dt = layout.n, arch.device, arch.dtype
        L, hkv, d = arch.n_layers, arch.n_kv_heads, arch.head_dim
        positions = layout.positions.to(dev)
        positions_sorted = bool((positions[1:] >= positions[:-1]).all())
        cos, sin = arch.cos_sin(positions)

        # Fused K/V start as the cached rows rotated to their global positions.
        # Uninitialised on purpose (zero-filling ~100 MB costs tens of ms of TTFT): cached rows
        # are filled here, and every other row is a required token, computed -- and so written
        # -- at each layer before any attention reads it.
        # One tensor per layer, not one [L, ...] block: the decoder's cache replaces them layer
        # by layer as it grows, and a shared block would stay alive (twice the KV memory)
        # until the last layer's was replaced.
        K = [torch.empty(hkv, n, d, dtype=dt, device=dev) for _ in range(L)]
        V = [torch.empty(hkv, n, d, dtype=dt, device=dev) for _ in range(L)]
        entries = {}
        for si, start, end in layout.spans(CACHED):
            e = layout.pieces[si].entry
            entries[si] = e
            k = e.keys.to(device=dev, dtype=dt, non_blocking=True)  # async from a pinned read
            v = e.values.to(device=dev, dtype=dt, non_blocking=True)
            cs = (cos[start:end], sin[start:end])
            for layer in range(L):
                # NoPE layers (SmolLM3) keep the position-free key.
                arch.rotate(k[layer], None, cs, out=K[layer][:, start:end], layer=layer)
                V[layer][:, start:end] = v[layer]

        state = FusionState(
            arch=arch, layout=layout, policy=policy, K=K, V=V,
            keep=torch.ones(n, dtype=torch.bool, device=dev), active=torch.empty(0, dtype=torch.long),
            cos=cos, sin=sin, layer_counts=torch.zeros(n, dtype=torch.long), entries=entries,
        )
        del K, V
        policy.prepare(state)
        required = state.required.to(dev)
        active_mask = policy.initial_active(state).to(dev) | required
        active = active_mask.nonzero().squeeze(1)
        state.active = active

        # Input embeddings of the active tokens (inserted tokens bring their own).
        hidden = arch.embed(layout.token_ids[active.cpu()])
        ins = layout.kind.to(dev)[active] == INSERTED
        if ins.any():
            emb_all = torch.zeros(n, arch.hidden_size, dtype=dt, device=dev)
            for si, start, end in layout.spans(INSERTED):
                emb_all[start:end] = layout.pieces[si].embeds.to(device=dev, dtype=dt)
            hidden[ins] = emb_all[active[ins]]

        for layer in range(L):
            q, k, v, _ = arch.qkv(layer, hidden, (cos[active], sin[active]))
            # Counted before narrowing: every active token's K/V is computed at this layer.
            state.layer_counts[active.cpu()] += 1
            sel = policy.select(layer, state, q, k, v)
            state.K[layer][:, active] = k
            state.V[layer][:, active] = v
            if sel is not None:
                # The engine, not the policy, guarantees the question/template/last token
                # stay computed: without them there are no logits and no fresh query rows.
                keep_rows = torch.zeros(active.numel(), dtype=torch.bool, device=dev)
                keep_rows[sel.to(dev)] = True
                keep_rows |= required[active]
                sel = keep_rows.nonzero().squeeze(1)
                active, q, hidden = active[sel], q[:, sel], hidden[sel]
                state.active = active
            # Policies may drop tokens (SamKV) at any layer: attend only to kept rows.
            all_kept = bool(state.keep.all())
            if not all_kept:
                keep_idx = state.keep.nonzero().squeeze(1)
            pos_q = positions[active]
            extra = policy.extra_mask(state, active)
            key_pos = positions if all_kept else positions[keep_idx]
            window = arch.window_mask(layer, pos_q, key_pos)
            if all_kept and extra is None and window is None and active.numel() == n:
                # Every token computed, nothing dropped: plain causal attention.
                hidden = arch.attend(layer, hidden, q, state.K[layer], state.V[layer], None, causal=True)
                continue
            if all_kept:
                keys, vals = state.K[layer], state.V[layer]
            else:
                keys, vals = state.K[layer][:, keep_idx], state.V[layer][:, keep_idx]
            mask = pos_q[:, None] >= key_pos[None, :]
            if extra is not None:
                mask = mask & (extra if all_kept else extra[:, keep_idx])
            if window is not None:  # the layer's sliding window (Mistral, Qwen2/3 configs)
                mask = mask & window
            # Active rows and key slots are both in prompt order, so each row's causal horizon
            # is a key prefix: the attention may skip what lies past it.
            limits = torch.searchsorted(key_pos, pos_q, right=True) if positions_sorted else None
            hidden = arch.attend(layer, hidden, q, keys, vals, mask, key_limits=limits)

        last = (active == n - 1).nonzero()
        logits = arch.logits(hidden[int(last[0, 0])].unsqueeze(0))[0]
        policy.after_prefill(state)

        keep_idx = state.keep.nonzero().squeeze(1)
        if state.kv_index is not None:
            Kout, Vout, out_pos = gather_slots(state.K, state.V, state.kv_index, positions)
        elif bool(state.keep.all()):
            Kout, Vout, out_pos = state.K, state.V, positions
        else:
            Kout = [k[:, keep_idx] for k in state.K]
            Vout = [v[:, keep_idx] for v in state.V]
            out_pos = positions[keep_idx]
        cached = layout.cached
        n_cached = int(cached.sum())
        counts = state.layer_counts[cached]
        stats = FusionStats(
            prompt_tokens=n,
            cached_tokens=n_cached,
            computed_tokens=n - n_cached,
            inserted_tokens=int((layout.kind == INSERTED).sum()),
            recomputed_tokens=int((counts == L).sum()) if n_cached else 0,
            recompute_fraction=float(counts.sum()) / (n_cached * L) if n_cached else 0.0,
            kept_tokens=int(Kout[0].shape[1]) if Kout else int(keep_idx.numel()),
            chunks_hit=len(entries),
            policy=policy.name,
            policy_stats=state.scratch.setdefault("policy_stats", {}),
        )
        return FusionResult(
            logits=logits, K=Kout, V=Vout, positions=out_pos,
            next_position=int(positions[-1]) + 1, stats=stats,
            state=state if keep_state else None,
        )
