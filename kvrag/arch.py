"""Architecture adapter: where the pieces of a decoder live, and one layer step.

kvrag runs the decoder layer by layer itself (instead of calling ``model.forward``) because
fusion needs to compute only *some* tokens at a layer while they attend to a K/V that mixes
cached and freshly computed rows. The step reuses the model's own modules (projections,
norms, MLP, rotary embedding), so any HF Llama, Mistral, Qwen2/3, SmolLM3, Gemma 2/3, OLMo 2,
Granite or Phi-3/Phi-4-mini checkpoint works without re-implementing its maths. What differs between the
families is the wiring around those modules (where the norms sit, multipliers, soft-capping,
one RoPE table per layer type), which ``Arch`` reads from the model once; a module or a
config feature it does not know is refused (``Arch`` raises), never run approximately.

Shapes: ``A`` active tokens at a layer, ``N`` tokens in the K/V, ``H`` query heads, ``Hkv``
KV heads, ``D`` head dim, ``E`` hidden size.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvrag.model.gemv import DecodeWeights, half_product

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm3",
    "gemma3_text",
    "gemma2",
    "olmo2",
    "granite",
    "phi3",
)

# The submodules of a decoder layer / its attention whose role ``Arch`` knows. A layer with any
# other (a new family's extra norm, gate or projection) is refused instead of being skipped.
_KNOWN_BLOCK_PARTS = {
    "self_attn",
    "mlp",
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
}
_KNOWN_ATTN_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_norm", "k_norm"}


# Held around every forward of a length-dependent rotary module (see ``serialize_rotary``). One
# lock for all of them: a forward is microseconds, and a lock cannot live on the module
# (``copy.deepcopy(model)``, as the KVLink adapter does, cannot copy a lock).
_ROPE_LOCK = threading.Lock()

#: Row groups of a planned attention: (first row, end row, first key, end key) per group, each
#: group attending only to the keys in its range (the rest of its mask rows is False).
AttentionPlan = list[tuple[int, int, int, int]]
#: Ways a masked attention call meets grouped-query heads (``Arch._grouped_for_mask``).
GQA_MASKED = ("native", "expand", "fold")


def visible_keys(
    key_pos: torch.Tensor, first_pos: list[int], last_pos: list[int], window: int | None
) -> tuple[list[int], list[int]]:
    """The keys each group of rows can see, for keys in prompt order (``key_pos`` long [K],
    never decreasing): per group, [first, end) = none after its last row's position
    (``last_pos``) and, under a sliding ``window``, none before its first row's window
    (``first_pos``; no window: from key 0). One search for all groups, one host read."""
    lows = [p - window if window else -1 for p in first_pos]  # positions are >= 0
    bounds = torch.tensor([lows, last_pos], dtype=key_pos.dtype, device=key_pos.device)
    firsts, ends = torch.searchsorted(key_pos, bounds, right=True).tolist()
    return firsts, ends


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
    """Handles on the modules of a decoder-only causal LM of a supported family."""

    # A transformers causal LM (``PreTrainedModel``): its submodules are built from the config,
    # so attribute reads are typed ``Any`` rather than torch's ``Tensor | Module``.
    model: Any

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
        self._check_parts()
        self._read_family(cfg)
        # Per-layer attention facts the model's own forward honours, so kvrag's layer step must
        # too: SmolLM3 leaves every 4th layer without RoPE (NoPE), and Mistral / Qwen2 / Qwen3 /
        # SmolLM3 configs may give (some) layers a sliding window.
        self.rope_layers = [bool(getattr(b.self_attn, "use_rope", True)) for b in self.layers]
        self.windows = [self._sliding_window(b.self_attn) for b in self.layers]
        self._read_rope(cfg)
        if self.length_dependent_rope:
            serialize_rotary(self.body.rotary_emb)  # one model served from several threads
        # Masked attention with grouped-query heads (see ``_grouped_for_mask``): one of
        # GQA_MASKED, or None = "native" on the CPU and the smaller of "fold"/"expand" on CUDA
        # (tests force each on the CPU).
        self.gqa_masked: str | None = None
        #: Half-precision copies that one-row products read (``with_decode_weights``); None:
        #: every product reads the model's own weights.
        self.decode_weights: DecodeWeights | None = None

    def with_decode_weights(self, choice: str) -> Arch:
        """This arch, or (where ``choice``, one of ``DECODE_WEIGHTS``, gives copies for this
        model: ``kvrag.model.gemv``) a shallow copy of it whose one-row products read
        half-precision copies of the projections. A copy: the arch a handle shares (other
        ``KVRag`` instances over the same model) keeps reading its own weights."""
        weights = DecodeWeights.build(self.model, choice)
        if weights is None:
            return self
        other = copy.copy(self)
        other.decode_weights = weights
        return other

    def _project(self, layer: int, name: str, linear, x: torch.Tensor) -> torch.Tensor:
        """``linear(x)`` for x [A, E]; one row (A == 1) reads the projection's half-precision
        copy where there is one (``layer`` -1: the LM head)."""
        if self.decode_weights is None or x.shape[0] != 1:
            return linear(x)
        dw = self.decode_weights
        half = dw.head if layer < 0 else dw.layers[layer].get(name)
        return linear(x) if half is None else half_product(half, x, linear.bias)

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP over x [A, E]; one row through the half-precision copies, as
        transformers' gated (or Phi-3's fused) MLP computes it, where they exist."""
        mlp = self.layers[layer].mlp
        if self.decode_weights is None or x.shape[0] != 1 or "down_proj" not in self.decode_weights.layers[layer]:
            return mlp(x)
        if hasattr(mlp, "gate_up_proj"):
            gate, up = self._project(layer, "gate_up_proj", mlp.gate_up_proj, x).chunk(2, dim=-1)
            return self._project(layer, "down_proj", mlp.down_proj, up * mlp.activation_fn(gate))
        gate = mlp.act_fn(self._project(layer, "gate_proj", mlp.gate_proj, x))
        return self._project(layer, "down_proj", mlp.down_proj, gate * self._project(layer, "up_proj", mlp.up_proj, x))

    def _check_parts(self) -> None:
        """Refuse a layer with a submodule whose role in the layer step is unknown."""
        for i, block in enumerate(self.layers):
            for owner, known in ((block, _KNOWN_BLOCK_PARTS), (block.self_attn, _KNOWN_ATTN_PARTS)):
                # Dropouts are the identity in inference (Phi-3's resid_*_dropout).
                extra = sorted({n for n, m in owner.named_children() if not isinstance(m, torch.nn.Dropout)} - known)
                if extra:
                    raise ValueError(
                        f"{self.config.model_type} layer {i} has modules kvrag's layer step does not "
                        f"know ({', '.join(extra)}); refusing to run it approximately"
                    )

    def _read_family(self, cfg) -> None:
        """The wiring of the layer step that differs between families (see ``attend``)."""
        block = self.layers[0]
        # Gemma 2/3 norm the attention and MLP outputs too ("sandwich"), OLMo 2 only those
        # ("post": no input norm); Llama's post_attention_layernorm is the MLP's input norm.
        if hasattr(block, "pre_feedforward_layernorm"):
            self.norm_style = "sandwich"
        elif not hasattr(block, "input_layernorm"):
            self.norm_style = "post"
        else:
            self.norm_style = "pre"
        if hasattr(block, "post_feedforward_layernorm") != (self.norm_style != "pre"):
            raise ValueError(f"{cfg.model_type}: a decoder layer whose norms kvrag does not know how to wire")
        # Granite scales the embeddings, each residual branch and the logits.
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0)
        self.residual_multiplier = float(getattr(cfg, "residual_multiplier", 1.0) or 1.0)
        self.logits_scaling = float(getattr(cfg, "logits_scaling", 1.0) or 1.0)
        # Gemma 2: tanh soft-capping of the attention scores and the logits (None = off).
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(f"{cfg.model_type} with use_bidirectional_attention is not a causal LM kvrag can serve")
        q_norm = getattr(block.self_attn, "q_norm", None)
        # Qwen3 and Gemma 3 norm q/k per head, OLMo 2 over all heads at once.
        self.qk_norm_per_head = q_norm is None or q_norm.weight.numel() == self.head_dim

    def _read_rope(self, cfg) -> None:
        """RoPE facts: ``rope_kinds`` (the distinct tables: Gemma 3's local and global layers
        rotate with different bases, every other family with one), ``rope_index[layer]``."""
        rot = self.body.rotary_emb
        types = getattr(rot, "rope_type", "default")
        if isinstance(types, dict):  # Gemma 3: one table per layer type
            self.rope_kinds = sorted(types)
            self.rope_index = [self.rope_kinds.index(t) for t in cfg.layer_types]
            gains = {float(getattr(rot, f"{t}_attention_scaling", 1.0) or 1.0) for t in self.rope_kinds}
            types = set(types.values())
        else:
            self.rope_kinds = [None]
            self.rope_index = [0] * self.n_layers
            gains = {float(getattr(rot, "attention_scaling", 1.0) or 1.0)}
            types = {types}
        # YaRN / LongRoPE scale cos and sin by an attention factor: a rotation by p multiplies
        # by it, so undoing or composing rotations must divide it back out.
        if len(gains) != 1:
            raise ValueError(
                f"{cfg.model_type}: RoPE tables with different attention factors per layer type "
                f"({sorted(gains)}) are not supported"
            )
        self.rope_gain = gains.pop()
        # LongRoPE and dynamic NTK choose their frequencies from the sequence length (cos_sin).
        self.length_dependent_rope = bool(types & {"longrope", "dynamic"})
        if self.length_dependent_rope and len(self.rope_kinds) > 1:
            raise ValueError(
                f"{cfg.model_type}: length-dependent RoPE ({', '.join(sorted(types))}) with one table "
                "per layer type is not supported"
            )
        # Partial rotary (Phi-4-mini: 0.75) rotates the first ``rot_dim`` dims of each head
        # and passes the rest through, attention factor included (HF's apply_rotary_pos_emb).
        self.rot_dim = self.cos_sin(torch.zeros(1, dtype=torch.long))[0].shape[-1]
        if not 0 < self.rot_dim <= self.head_dim or self.rot_dim % 2:
            raise ValueError(
                f"{cfg.model_type}: RoPE over {self.rot_dim} of {self.head_dim} head dims "
                "is not a rotation kvrag can apply"
            )

    def _sliding_window(self, attn) -> int | None:
        """Keys a query of this layer sees (itself included), or None for full attention.
        Qwen2/3 and SmolLM3 attention modules carry their own (None on full layers); Mistral
        reads ``config.sliding_window`` for every layer; Llama has none, even when its config
        carries a stray ``sliding_window`` (llamafied Qwen checkpoints do): Llama's attention
        never reads it, so neither may kvrag."""
        if hasattr(attn, "sliding_window"):
            w = attn.sliding_window
        elif self.config.model_type in ("mistral", "phi3"):
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
        are the ones the whole sequence was rotated with. Static RoPE types ignore it.

        With several RoPE kinds (Gemma 3) cos, sin are [P, T, D], T = len(rope_kinds): one
        table per kind, positions still first (callers slice rows the same way); ``rotate``
        with ``layer`` picks the layer's."""
        pos = positions.to(self.device).view(-1)
        n = pos.numel()
        if length is not None and self.length_dependent_rope and (n == 0 or length > int(pos.max()) + 1):
            pos = torch.cat([pos, pos.new_tensor([length - 1])])
        dummy = torch.empty(1, device=self.device, dtype=self.dtype)
        if len(self.rope_kinds) == 1:
            cos, sin = self.body.rotary_emb(dummy, pos.view(1, -1))
            return cos[0, :n], sin[0, :n]
        tables = [self.body.rotary_emb(dummy, pos.view(1, -1), kind) for kind in self.rope_kinds]
        return (torch.stack([c[0, :n] for c, _ in tables], dim=1), torch.stack([s[0, :n] for _, s in tables], dim=1))

    def rotate(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        cos_sin=None,
        out: torch.Tensor | None = None,
        layer: int | None = None,
    ) -> torch.Tensor:
        """Rotate pre-RoPE vectors ``x`` [..., P, D] to ``positions`` [P].

        RoPE is a rotation per frequency pair, so rotating a position-free key by ``p`` gives
        exactly the key the model computes at position ``p``; rotating by ``-p`` undoes it.
        ``out`` (same shape as ``x``, may be a strided view): written in place, without the
        temporaries of ``rotate_half`` — the fusion engine rotates every cached key of a
        prompt (tens of MB) on the TTFT path. ``layer``: the layer ``x`` belongs to; on a NoPE
        layer (no RoPE) the rotation is the identity; with several RoPE kinds (Gemma 3) it
        picks the layer's table and is required."""
        if layer is not None and not self.rope_layers[layer]:
            return x if out is None else out.copy_(x)
        if cos_sin is None:
            if positions is None:
                raise ValueError("rotate: pass the positions or their (cos, sin) tables")
            cos_sin = self.cos_sin(positions)
        cos, sin = cos_sin
        if cos.dim() == 3:  # one table per RoPE kind: [P, T, D]
            if layer is None:
                raise ValueError("rotate: this model has one RoPE table per layer type; pass layer=")
            kind = self.rope_index[layer]
            cos, sin = cos[:, kind], sin[:, kind]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        r = cos.shape[-1]
        if r < x.shape[-1]:  # partial rotary: the dims past r pass through
            if out is None:
                return torch.cat([self.rotate(x[..., :r], None, (cos, sin)), x[..., r:]], dim=-1)
            out[..., r:].copy_(x[..., r:])
            self.rotate(x[..., :r], None, (cos, sin), out=out[..., :r])
            return out
        if out is None:
            return x * cos + rotate_half(x) * sin
        h = x.shape[-1] // 2
        torch.mul(x, cos, out=out)
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:])
        return out

    def rotate_layers(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        """Rotate pre-RoPE keys of every layer at once: ``x`` [L, ..., P, D] with the tables
        ``cos_sin`` of ``cos_sin()`` (cos, sin [P, D], or [P, T, D] with one table per RoPE
        kind) -> a new tensor of ``x``'s shape; NoPE layers (SmolLM3) keep the position-free
        key. A fixed number of ops for all layers (one rotation per RoPE kind, a copy per NoPE
        layer), the same arithmetic as ``rotate`` layer by layer."""
        out = torch.empty_like(x)
        cos, sin = cos_sin
        if cos.dim() == 2:
            self.rotate(x, None, (cos, sin), out=out)
        else:  # Gemma 3: local and global layers rotate with their own base
            for kind in range(len(self.rope_kinds)):
                idx = [i for i in range(self.n_layers) if self.rope_index[i] == kind]
                if idx:
                    sel = torch.tensor(idx, device=x.device)
                    out.index_copy_(
                        0, sel, self.rotate(x[sel], None, (cos[:, kind], sin[:, kind]), out=torch.empty_like(x[sel]))
                    )
        for layer, rope in enumerate(self.rope_layers):
            if not rope:
                out[layer].copy_(x[layer])
        return out

    def unrotate(
        self, x: torch.Tensor, positions: torch.Tensor, layer: int, length: int | torch.Tensor | None = None
    ) -> torch.Tensor:
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
                    out[..., sel.to(x.device), :] = self.unrotate(
                        x[..., sel.to(x.device), :], positions[sel], layer, int(n)
                    )
                return out
        # R(-p) = (cos p, -sin p) from the very tables x was rotated with: a table for -p
        # would let a length-dependent RoPE pick other frequencies (max(-p) + 1 <= 1).
        cos, sin = self.cos_sin(positions, length)
        return self._ungain(self.rotate(x, None, (cos, -sin), layer=layer), 2)

    def shift(self, x: torch.Tensor, cos_sin, layer: int) -> torch.Tensor:
        """Move vectors ``x`` [..., P, D] already rotated at ``layer`` by the offsets whose
        tables ``cos_sin`` holds (RoPE composes: R_a R_b = R_(a+b)); the attention factor is
        applied once, as in a vector rotated directly to the sum."""
        if not self.rope_layers[layer]:
            return x
        return self._ungain(self.rotate(x, None, cos_sin, layer=layer), 1)

    def shift_layers(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        """``shift`` at every layer at once: ``x`` [L, ..., P, D], rotated at each layer, moved
        by the offsets whose tables ``cos_sin`` holds (as for ``rotate_layers``) -> a new
        tensor of ``x``'s shape. A fixed number of ops for all layers."""
        out = self.rotate_layers(x, cos_sin)
        if self.rope_gain == 1.0:
            return out
        rope = torch.tensor([i for i, r in enumerate(self.rope_layers) if r], dtype=torch.long, device=x.device)
        return out.index_copy_(0, rope, self._ungain(out[rope], 1))

    def _ungain(self, x: torch.Tensor, power: int) -> torch.Tensor:
        """``x`` [..., D] with its rotated dims divided by ``rope_gain ** power`` (the
        pass-through dims of a partial rotary never got the attention factor)."""
        if self.rope_gain == 1.0:
            return x
        if self.rot_dim == x.shape[-1]:
            return x / self.rope_gain**power
        return torch.cat([x[..., : self.rot_dim] / self.rope_gain**power, x[..., self.rot_dim :]], dim=-1)

    # ---- embedding / head ------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [P] -> hidden states [P, E]. Gemma's embedding module scales by
        sqrt(E) itself (in the weights' dtype); Granite's model multiplies after it."""
        x = self.body.embed_tokens(token_ids.to(self.device))
        return x * self.embedding_multiplier if self.embedding_multiplier != 1.0 else x

    def input_scale(self) -> float:
        """What ``embed`` multiplies an embedding-matrix row by (1 for Llama): vectors built
        from the matrix itself (KVLink's untrained link token) need it to look like inputs."""
        emb = self.body.embed_tokens
        scale = getattr(emb, "embed_scale", None)
        scale = float(scale.to(emb.weight.dtype)) if isinstance(scale, torch.Tensor) else float(scale or 1.0)
        return scale * self.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """last-layer hidden states [P, E] -> logits [P, V] (final norm + LM head, then
        Granite's logit scaling and Gemma 2's soft-cap, in the model's order and dtype)."""
        logits = self._project(-1, "lm_head", self.model.lm_head, self.body.norm(hidden))
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    # ---- one decoder layer -----------------------------------------------------------
    def qkv(self, layer: int, hidden: torch.Tensor, cos_sin) -> tuple[torch.Tensor, ...]:
        """hidden [A, E] -> q [H, A, D], k [Hkv, A, D] (both rotated), v [Hkv, A, D],
        k_pre [Hkv, A, D] (the key before rotation: what the store keeps)."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden) if self.norm_style != "post" else hidden
        a = x.shape[0]
        if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, q then k then v
            nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = self._project(layer, "qkv_proj", attn.qkv_proj, x).split([nq, nkv, nkv], dim=-1)
        else:
            q = self._project(layer, "q_proj", attn.q_proj, x)
            k = self._project(layer, "k_proj", attn.k_proj, x)
            v = self._project(layer, "v_proj", attn.v_proj, x)
        has_qk_norm = getattr(attn, "q_norm", None) is not None
        if has_qk_norm and not self.qk_norm_per_head:  # OLMo 2: over all heads, before the split
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q.view(a, -1, self.head_dim)
        k = k.view(a, -1, self.head_dim)
        v = v.view(a, -1, self.head_dim)
        # Qwen3 and Gemma 3 normalise q/k per head before RoPE.
        if has_qk_norm and self.qk_norm_per_head:
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
        plan: AttentionPlan | None = None,
    ) -> torch.Tensor:
        """Finish a layer for the active tokens.

        hidden [A, E] (residual input), q [H, A, D], keys/values [Hkv, N, D],
        mask bool [A, N] (True = may attend) -> new hidden [A, E]. ``causal=True`` (with
        mask None, A == N) lets SDPA use its causal kernel, which skips the masked half.

        ``key_limits`` long [A], non-decreasing: row ``a`` attends to no key at or past
        ``key_limits[a]`` (its mask is False there). SDPA with an explicit mask cannot skip
        masked blocks, so the rows are then attended in groups, each against only the key
        prefix it can see: for rows spread evenly over a prompt this roughly halves the
        attention work of a partial (recompute) layer. ``plan``: the same groups, from
        ``attention_plan(key_limits)`` (made once for the layers that share the rows: the
        fusion engine), instead of ``key_limits``; a group may also start past key 0 (a
        sliding window's rows see no key before it)."""
        return self.finish_layer(layer, hidden, self.attention(q, keys, values, mask, causal, key_limits, plan))

    def attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool = False,
        key_limits: torch.Tensor | None = None,
        plan: AttentionPlan | None = None,
    ) -> torch.Tensor:
        """The attention part of ``attend`` (same arguments): q [H, A, D] against keys/values
        [Hkv, N, D] -> the heads' outputs [A, H*D], before the output projection. Batched
        decoding runs it per request (each over its own cache) and ``finish_layer`` once for
        all of them."""
        if plan is not None:
            return self._sdpa_planned(q, keys, values, mask, plan)
        if key_limits is not None:
            return self._sdpa_grouped(q, keys, values, mask, key_limits)
        return self._sdpa(q, keys, values, mask, causal)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The token-wise rest of a layer: hidden [A, E] (residual input) and the attention
        output attn [A, H*D] -> new hidden [A, E] (output projection, norms, residuals, MLP;
        rows are independent, so tokens of different requests share the weight reads)."""
        block = self.layers[layer]
        out = self._project(layer, "o_proj", block.self_attn.o_proj, attn)
        if self.norm_style == "pre":  # Llama: post_attention_layernorm is the MLP's input norm
            hidden = hidden + self._residual(out)
            return hidden + self._residual(self._mlp(layer, block.post_attention_layernorm(hidden)))
        hidden = hidden + self._residual(block.post_attention_layernorm(out))
        x = block.pre_feedforward_layernorm(hidden) if self.norm_style == "sandwich" else hidden
        return hidden + self._residual(block.post_feedforward_layernorm(self._mlp(layer, x)))

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        """A residual branch's output as added to the stream (Granite scales it)."""
        return x * self.residual_multiplier if self.residual_multiplier != 1.0 else x

    def per_query_head(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """K or V with its KV heads (along ``dim``) repeated for the query heads that read
        each, [.., Hkv, ..] -> [.., H, ..]: head h reads KV head h // g."""
        return x.repeat_interleave(self.n_heads // self.n_kv_heads, dim)

    def grouped_mode(self, q: torch.Tensor, keys: torch.Tensor) -> str:
        """The ``gqa_masked`` mode of a masked call of q [H, A, D] over keys [Hkv or H, N, D]
        ("native" where there is nothing to group; see ``_grouped_for_mask``). Auto on CUDA:
        whichever writes fewer elements, the folded mask (g A N) or the expanded K/V (2 H N D).
        Batched decoding (``kvrag.query.batch``) folds the same way."""
        if keys.shape[0] == q.shape[0]:
            return "native"
        if self.gqa_masked is not None:
            if self.gqa_masked not in GQA_MASKED:
                raise ValueError(f"gqa_masked must be one of {GQA_MASKED} or None, got {self.gqa_masked!r}")
            return self.gqa_masked
        if not q.is_cuda:
            return "native"
        group = q.shape[0] // keys.shape[0]
        return "fold" if group * q.shape[1] <= 2 * q.shape[0] * q.shape[2] else "expand"

    def _grouped_for_mask(self, q, keys, values, mask):
        """How a masked attention call meets grouped-query heads (g = H / Hkv query heads per
        KV head): q [H, A, D], keys/values [Hkv, N, D], mask [A, N] or [H, A, N] -> the
        (q, keys, values, mask) to call SDPA with and whether q was folded.

        On CUDA the flash kernel takes no mask and the memory-efficient one no GQA, so a
        masked call with ``enable_gqa`` falls back to the math kernel, which materialises the
        float32 scores [H, A, N] (GBs for a long chunk). Two ways keep a fused kernel:

        * "expand": K/V copied to every query head, [H, N, D] (transformers' SDPA does so);
          2 H N D elements written per call.
        * "fold": the g query heads of a KV head become g blocks of rows of one head, q ->
          [Hkv, g A, D], the mask repeated to [g A, N]; g A N mask elements written per call,
          far fewer when few rows attend over a long cache (the question over the chunks).

        The CPU's kernel takes GQA with a mask natively, and is fastest so ("native")."""
        mode = self.grouped_mode(q, keys)
        if mode == "native":
            return q, keys, values, mask, False
        if mode == "expand":
            return q, self.per_query_head(keys), self.per_query_head(values), mask, False
        group = self.n_heads // self.n_kv_heads
        hkv, a = keys.shape[0], q.shape[1]
        # Head h reads KV head h // g (the order repeat_interleave gives), so q's heads fold
        # as [Hkv, g, A, D] -> [Hkv, g A, D] with no copy.
        q = q.reshape(hkv, group * a, q.shape[2])
        mask = mask.reshape(hkv, group * a, -1) if mask.dim() == 3 else mask.repeat(group, 1)
        return q, keys, values, mask, True

    def _sdpa(self, q, keys, values, mask, causal=False) -> torch.Tensor:
        """q [H, A, D], keys/values [Hkv or H, N, D], mask bool [A, N], [H, A, N] (per query
        head) or None -> [A, H*D]."""
        if self.attn_softcap is not None:
            return self._softcapped(q, keys, values, mask, causal)
        heads, rows = q.shape[0], q.shape[1]
        folded = False
        if mask is not None:
            q, keys, values, mask, folded = self._grouped_for_mask(q, keys, values, mask)
            mask = mask.unsqueeze(0) if mask.dim() == 3 else mask.unsqueeze(0).unsqueeze(0)
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
        if folded:
            out = out.reshape(heads, rows, -1)
        return out.transpose(0, 1).reshape(rows, -1)

    def _scores(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Attention logits q [H, A, D] x keys [Hkv or H, N, D] -> [H, A, N] in q's dtype,
        soft-capped where the model caps them (Gemma 2)."""
        k = keys.to(q.dtype)
        if k.shape[0] != q.shape[0]:
            k = self.per_query_head(k)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        if self.attn_softcap is not None:
            scores = torch.tanh(scores / self.attn_softcap) * self.attn_softcap
        return scores

    def _softcapped(self, q, keys, values, mask, causal) -> torch.Tensor:
        """``_sdpa`` for soft-capped attention, which no SDPA kernel implements: the eager
        maths of HF's Gemma 2 (scores, cap, mask, float32 softmax, back to q's dtype)."""
        scores = self._scores(q, keys)
        if mask is None and causal:
            a, n = scores.shape[-2:]
            mask = torch.ones(a, n, dtype=torch.bool, device=q.device).tril(n - a)
        if mask is not None:
            scores = scores.masked_fill(~mask.to(q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        v = values.to(q.dtype)
        if v.shape[0] != q.shape[0]:
            v = self.per_query_head(v)
        return torch.matmul(probs, v).transpose(0, 1).reshape(q.shape[1], -1)

    #: Row groups of the grouped attention; more groups skip more masked work but each SDPA
    #: call has a fixed cost, so groups are at least ``MIN_GROUP_ROWS`` rows.
    ATTN_GROUPS = 8
    MIN_GROUP_ROWS = 64

    def attention_plan(self, key_limits: torch.Tensor) -> AttentionPlan | None:
        """Row groups for ``attend(plan=...)``: ``key_limits`` long [A] (see ``attend``) ->
        [(first row, end row, first key read, end of the keys read)], here every group from
        key 0, or None when the rows make one group (one SDPA call over the whole mask). One
        host read of ``key_limits``."""
        a = key_limits.numel()
        n_groups = max(1, min(self.ATTN_GROUPS, a // self.MIN_GROUP_ROWS))
        if n_groups == 1:
            return None
        edges = torch.linspace(0, a, n_groups + 1).round().long()
        # One host read for all groups (each int() of a CUDA tensor would be a sync).
        limits = key_limits[(edges[1:] - 1).clamp_min(0).to(key_limits.device)].tolist()
        bounds = edges.tolist()
        return [(lo, hi, 0, max(1, int(lim))) for lo, hi, lim in zip(bounds[:-1], bounds[1:], limits) if hi > lo]

    def _sdpa_grouped(self, q, keys, values, mask, key_limits) -> torch.Tensor:
        """Like ``_sdpa`` with mask [A, N], rows split into contiguous groups, each attending
        to keys ``[0, key_limits[last row of group])`` only (the rest of its mask is False)."""
        plan = self.attention_plan(key_limits)
        return self._sdpa(q, keys, values, mask) if plan is None else self._sdpa_planned(q, keys, values, mask, plan)

    def _sdpa_planned(self, q, keys, values, mask, plan) -> torch.Tensor:
        """``_sdpa_grouped`` with its groups given (``attention_plan``)."""
        if self.grouped_mode(q, keys) == "expand":
            # Expanded once for every group (not once per group: that copy was ~10% of a GPU prefill).
            keys, values = self.per_query_head(keys), self.per_query_head(values)
        outs = [
            self._sdpa(q[:, lo:hi], keys[:, k0:k1], values[:, k0:k1], mask[lo:hi, k0:k1]) for lo, hi, k0, k1 in plan
        ]
        return torch.cat(outs)

    def attention_probs(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Softmax attention weights, q [H, A, D], keys [Hkv, N, D] -> [H, A, N] (GQA aware).

        Policies that score tokens by attention (A3, SamKV) use this explicitly, since the
        fused SDPA kernel does not return weights."""
        # float32 scores: half-precision ones would round (bf16) or overflow (fp16) the
        # rankings the policies take from them. Soft-capped as the model's are (Gemma 2).
        scores = self._scores(q.float(), keys.float())
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
        return torch.softmax(scores.float(), dim=-1)
