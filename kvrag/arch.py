"""Architecture adapter: where the pieces of a Llama-family decoder live, and one layer step.

kvrag runs the decoder layer by layer itself (instead of calling ``model.forward``) because
fusion needs to compute only *some* tokens at a layer while they attend to a K/V that mixes
cached and freshly computed rows. The step reuses the model's own modules (projections,
norms, MLP, rotary embedding), so any HF Llama, Mistral, Qwen2 or Qwen3 checkpoint works
without re-implementing its maths.

Shapes: ``A`` active tokens at a layer, ``N`` tokens in the K/V, ``H`` query heads, ``Hkv``
KV heads, ``D`` head dim, ``E`` hidden size.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")


# Held around every forward of a length-dependent rotary module (see ``serialize_rotary``). One
# lock for all of them: a forward is microseconds, and a lock cannot live on the module
# (``copy.deepcopy(model)``, as the KVLink adapter does, cannot copy a lock).
_ROPE_LOCK = threading.Lock()


class _LockedForward:
    """A rotary module's own forward, run under ``_ROPE_LOCK`` (installed as the module's
    ``forward``). A small object rather than a closure, so that ``copy.deepcopy`` and pickle
    of the model give the copy a forward of its own module."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        with _ROPE_LOCK:
            return type(self.module).forward(self.module, *args, **kwargs)


def serialize_rotary(rotary: torch.nn.Module) -> None:
    """Make concurrent forwards of a length-dependent rotary module (LongRoPE, dynamic NTK)
    safe: HF's ``dynamic_rope_update`` first writes the frequencies for this call's sequence
    length into the module's shared ``inv_freq`` buffer, then reads them back; a thread
    serving a long prompt and one serving a short prompt interleave there and rotate with each
    other's frequencies (wrong answers, measured on a tiny LongRoPE Llama). The update and the
    read then run under one lock. Idempotent."""
    if not isinstance(rotary.__dict__.get("forward"), _LockedForward):
        rotary.forward = _LockedForward(rotary)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's RoPE convention (all supported families use it): ``[-x2, x1]`` on the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class Arch:
    """Handles on the modules of a Llama-family causal LM."""

    model: torch.nn.Module

    def __post_init__(self) -> None:
        cfg = self.model.config
        mt = getattr(cfg, "model_type", "")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {mt!r} is not supported by kvrag's fusion engine "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self.config = cfg
        self.body = self.model.model
        self.layers = self.body.layers
        self.n_layers = len(self.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.hidden_size = cfg.hidden_size
        self.scaling = attn.scaling
        # Per-layer attention facts the model's own forward honours, so kvrag's layer step must
        # too: SmolLM3 leaves every 4th layer without RoPE (NoPE), and Mistral / Qwen2 / Qwen3 /
        # SmolLM3 configs may give (some) layers a sliding window.
        self.rope_layers = [bool(getattr(b.self_attn, "use_rope", True)) for b in self.layers]
        self.windows = [self._sliding_window(b.self_attn) for b in self.layers]
        # YaRN / LongRoPE scale cos and sin by an attention factor: a rotation by p multiplies
        # by it, so undoing or composing rotations must divide it back out.
        self.rope_gain = float(getattr(self.body.rotary_emb, "attention_scaling", 1.0) or 1.0)
        # LongRoPE and dynamic NTK choose their frequencies from the sequence length (cos_sin).
        self.length_dependent_rope = getattr(self.body.rotary_emb, "rope_type", "default") in ("longrope", "dynamic")
        if self.length_dependent_rope:
            serialize_rotary(self.body.rotary_emb)  # one model served from several threads
        # Masked attention with grouped-query heads (see ``_sdpa``): None = expand K/V only on
        # CUDA; True/False force it (tests check the expanded path on the CPU).
        self.expand_kv_for_masks: bool | None = None

    def _sliding_window(self, attn) -> int | None:
        """Keys a query of this layer sees (itself included), or None for full attention.
        Qwen2/3 and SmolLM3 attention modules carry their own (None on full layers); Mistral
        reads ``config.sliding_window`` for every layer; Llama has none, even when its config
        carries a stray ``sliding_window`` (llamafied Qwen checkpoints do): Llama's attention
        never reads it, so neither may kvrag."""
        if hasattr(attn, "sliding_window"):
            w = attn.sliding_window
        elif self.config.model_type == "mistral":
            w = getattr(self.config, "sliding_window", None)
        else:
            w = None
        return int(w) if w else None

    def window_mask(self, layer: int, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor | None:
        """bool [A, N]: key (at ``pos_k`` [N]) lies inside the sliding window of the query (at
        ``pos_q`` [A]) at ``layer`` — HF's ``kv_idx > q_idx - sliding_window`` —, or None
        when the layer has no window or no query reaches past it (the common case: no cost)."""
        w = self.windows[layer]
        if w is None or pos_q.numel() == 0 or pos_k.numel() == 0:
            return None
        pos_k = pos_k.to(pos_q.device)
        if int(pos_q.max()) - int(pos_k.min()) < w:
            return None
        return (pos_q[:, None] - pos_k[None, :]) < w

    def windowed(self, layer: int, mask: torch.Tensor | None, pos_q: torch.Tensor, pos_k: torch.Tensor):
        """``mask`` (bool [A, N] or None) restricted to the layer's sliding window, if any."""
        w = self.window_mask(layer, pos_q, pos_k)
        if w is None:
            return mask
        return w if mask is None else mask & w.to(mask.device)

    @property
    def device(self) -> torch.device:
        return self.body.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.body.embed_tokens.weight.dtype

    # ---- positions -------------------------------------------------------------------
    def cos_sin(self, positions: torch.Tensor, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for ``positions`` [P] -> cos, sin [P, D] (model's own rotary module,
        so rope scaling variants such as Llama-3's are honoured).

        ``length``: the sequence length whose frequencies to use. LongRoPE (short/long factors)
        and dynamic NTK pick their frequencies from the sequence length, which HF's rotary
        module infers as ``max(positions) + 1`` of the call; a caller rotating (or undoing the
        rotation of) part of a longer sequence passes that sequence's length, so the tables
        are the ones the whole sequence was rotated with. Static RoPE types ignore it."""
        pos = positions.to(self.device).view(-1)
        n = pos.numel()
        if length is not None and self.length_dependent_rope and (n == 0 or length > int(pos.max()) + 1):
            pos = torch.cat([pos, pos.new_tensor([length - 1])])
        dummy = torch.empty(1, device=self.device, dtype=self.dtype)
        cos, sin = self.body.rotary_emb(dummy, pos.view(1, -1))
        return cos[0, :n], sin[0, :n]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, cos_sin=None,
               out: torch.Tensor | None = None, layer: int | None = None) -> torch.Tensor:
        """Rotate pre-RoPE vectors ``x`` [..., P, D] to ``positions`` [P].

        RoPE is a rotation per frequency pair, so rotating a position-free key by ``p`` gives
        exactly the key the model computes at position ``p``; rotating by ``-p`` undoes it.
        ``out`` (same shape as ``x``, may be a strided view): written in place, without the
        temporaries of ``rotate_half`` — the fusion engine rotates every cached key of a
        prompt (tens of MB) on the TTFT path. ``layer``: the layer ``x`` belongs to; on a NoPE
        layer (no RoPE) the rotation is the identity."""
        if layer is not None and not self.rope_layers[layer]:
            return x if out is None else out.copy_(x)
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if out is None:
            return x * cos + rotate_half(x) * sin
        h = x.shape[-1] // 2
        torch.mul(x, cos, out=out)
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:])
        return out

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor, layer: int,
                 length: int | torch.Tensor | None = None) -> torch.Tensor:
        """Position-free vectors from ``x`` [..., P, D] rotated (by the model) to ``positions``
        [P] at ``layer``, in a sequence of ``length`` tokens (default: max(positions) + 1; see
        ``cos_sin``), or per row ``length`` [P]: the inverse of ``rotate``, attention factor
        included."""
        if not self.rope_layers[layer]:
            return x
        if isinstance(length, torch.Tensor):
            if not self.length_dependent_rope:
                length = None
            else:  # rows rotated in sequences of different lengths (decoded tokens)
                out = torch.empty_like(x)
                for n in length.unique().tolist():
                    sel = (length == n).nonzero().squeeze(1)
                    out[..., sel.to(x.device), :] = self.unrotate(x[..., sel.to(x.device), :], positions[sel], layer, int(n))
                return out
        # R(-p) = (cos p, -sin p) from the very tables x was rotated with: a table for -p
        # would let a length-dependent RoPE pick other frequencies (max(-p) + 1 <= 1).
        cos, sin = self.cos_sin(positions, length)
        return self.rotate(x, None, (cos, -sin)) / self.rope_gain ** 2

    def shift(self, x: torch.Tensor, cos_sin, layer: int) -> torch.Tensor:
        """Move vectors ``x`` [..., P, D] already rotated at ``layer`` by the offsets whose
        tables ``cos_sin`` holds (RoPE composes: R_a R_b = R_(a+b)); the attention factor is
        applied once, as in a vector rotated directly to the sum."""
        if not self.rope_layers[layer]:
            return x
        return self.rotate(x, None, cos_sin) / self.rope_gain

    # ---- embedding / head ------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [P] -> hidden states [P, E]."""
        return self.body.embed_tokens(token_ids.to(self.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """last-layer hidden states [P, E] -> logits [P, V] (final norm + LM head)."""
        return self.model.lm_head(self.body.norm(hidden)).float()

    # ---- one decoder layer -----------------------------------------------------------
    def qkv(self, layer: int, hidden: torch.Tensor, cos_sin) -> tuple[torch.Tensor, ...]:
        """hidden [A, E] -> q [H, A, D], k [Hkv, A, D] (both rotated), v [Hkv, A, D],
        k_pre [Hkv, A, D] (the key before rotation: what the store keeps)."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        a = x.shape[0]
        q = attn.q_proj(x).view(a, -1, self.head_dim)
        k = attn.k_proj(x).view(a, -1, self.head_dim)
        v = attn.v_proj(x).view(a, -1, self.head_dim)
        # Qwen3 normalises q/k per head before RoPE.
        if getattr(attn, "q_norm", None) is not None:
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        q_rot = self.rotate(q, None, cos_sin, layer=layer)
        k_rot = self.rotate(k, None, cos_sin, layer=layer)
        return q_rot, k_rot, v, k

    def attend(
        self,
        layer: int,
        hidden: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool = False,
        key_limits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Finish a layer for the active tokens.

        hidden [A, E] (residual input), q [H, A, D], keys/values [Hkv, N, D],
        mask bool [A, N] (True = may attend) -> new hidden [A, E]. ``causal=True`` (with
        mask None, A == N) lets SDPA use its causal kernel, which skips the masked half.

        ``key_limits`` long [A], non-decreasing: row ``a`` attends to no key at or past
        ``key_limits[a]`` (its mask is False there). SDPA with an explicit mask cannot skip
        masked blocks, so the rows are then attended in groups, each against only the key
        prefix it can see: for rows spread evenly over a prompt this roughly halves the
        attention work of a partial (recompute) layer."""
        attn = self._sdpa_grouped(q, keys, values, mask, key_limits) if key_limits is not None \
            else self._sdpa(q, keys, values, mask, causal)
        block = self.layers[layer]
        hidden = hidden + block.self_attn.o_proj(attn)
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def _expand_for_mask(self, q, keys, values):
        """K/V [Hkv, N, D] -> [H, N, D] where a masked attention call needs them so. On CUDA
        the flash kernel takes no mask and the memory-efficient one no GQA, so a masked GQA
        call falls back to the math kernel, which materialises the float32 scores [H, A, N]
        (GBs for a long chunk). K/V expanded to every query head keep a fused kernel
        (transformers' SDPA does the same)."""
        expand = self.expand_kv_for_masks
        if self.n_heads != self.n_kv_heads and keys.shape[0] != self.n_heads \
                and (q.is_cuda if expand is None else expand):
            group = self.n_heads // self.n_kv_heads
            return keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        return keys, values

    def _sdpa(self, q, keys, values, mask, causal=False) -> torch.Tensor:
        """q [H, A, D], keys/values [Hkv or H, N, D], mask bool [A, N], [H, A, N] (per query
        head) or None -> [A, H*D]."""
        if mask is not None:
            mask = mask.unsqueeze(0) if mask.dim() == 3 else mask.unsqueeze(0).unsqueeze(0)
            keys, values = self._expand_for_mask(q, keys, values)
        gqa = keys.shape[0] != q.shape[0]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            keys.unsqueeze(0).to(q.dtype),
            values.unsqueeze(0).to(q.dtype),
            attn_mask=mask,
            is_causal=causal and mask is None,
            scale=self.scaling,
            enable_gqa=gqa,
        )[0]
        return out.transpose(0, 1).reshape(q.shape[1], -1)

    #: Row groups of the grouped attention; more groups skip more masked work but each SDPA
    #: call has a fixed cost, so groups are at least ``MIN_GROUP_ROWS`` rows.
    ATTN_GROUPS = 8
    MIN_GROUP_ROWS = 64

    def _sdpa_grouped(self, q, keys, values, mask, key_limits) -> torch.Tensor:
        """Like ``_sdpa`` with mask [A, N], rows split into contiguous groups, each attending
        to keys ``[0, key_limits[last row of group])`` only (the rest of its mask is False)."""
        a = q.shape[1]
        n_groups = max(1, min(self.ATTN_GROUPS, a // self.MIN_GROUP_ROWS))
        if n_groups == 1:
            return self._sdpa(q, keys, values, mask)
        # Expanded once for every group (not once per group: that copy was ~10% of a GPU prefill).
        keys, values = self._expand_for_mask(q, keys, values)
        bounds = torch.linspace(0, a, n_groups + 1).round().long()
        # One host read for all groups (each int() of a CUDA tensor would be a sync).
        limits = key_limits[(bounds[1:] - 1).clamp_min(0).to(key_limits.device)].tolist()
        bounds = bounds.tolist()
        outs = []
        for lo, hi, lim in zip(bounds[:-1], bounds[1:], limits):
            if hi <= lo:
                continue
            kmax = max(1, int(lim))
            outs.append(self._sdpa(q[:, lo:hi], keys[:, :kmax], values[:, :kmax], mask[lo:hi, :kmax]))
        return torch.cat(outs)

    def attention_probs(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Softmax attention weights, q [H, A, D], keys [Hkv, N, D] -> [H, A, N] (GQA aware).

        Policies that score tokens by attention (A3, SamKV) use this explicitly, since the
        fused SDPA kernel does not return weights."""
        group = self.n_heads // self.n_kv_heads
        # float32 scores: half-precision ones would round (bf16) or overflow (fp16) the
        # rankings the policies take from them.
        k = keys.float().repeat_interleave(group, dim=0)
        scores = torch.matmul(q.float(), k.transpose(-1, -2)) * self.scaling
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
        return torch.softmax(scores.float(), dim=-1)
