"""One-row products from half-precision copies of a float32 model's projection weights.

A decode step of one request multiplies one row by every projection matrix and the LM head:
matrix-vector products, which read each matrix to do two FLOPs an element, so their time is
the bytes read. On a CPU without native half-precision arithmetic (AVX2), torch's float16
matrix-vector kernel (conversion on the fly, float32 accumulation) still reads half the bytes
and ran ~3.5x faster than float32's, a compiled SmolLM2 decode step 2x (docs/benchmarks.md,
"Decode from half-precision weight copies"); with several rows the products are matrix-matrix
ones, whose half-precision kernels there lose to float32's, so only a single row reads the
copies. Prefill and precompute (many rows) keep the float32
weights: stored chunks and every many-row forward are exactly what they were.

The row is scaled to a largest magnitude of 1 before the cast, so float16's range (65,504)
never overflows on a model's large activations, and the product is scaled back in float32:
what is lost is float16's rounding of the row and the weights (~5e-4 relative), not range.

``DecodeWeights.choose`` measures which format pays on this machine (``"auto"``).

Shapes: ``E`` input features, ``F`` output features.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from kvrag.defaults import DECODE_WEIGHTS

log = logging.getLogger("kvrag")

_FORMATS = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# The MLP shapes whose one-row product is spelled out here (transformers' own forward, with the
# projections swapped): gated (Llama, Mistral, Qwen, Gemma, OLMo 2, Granite, SmolLM3) and
# Phi-3's fused gate/up projection. Another MLP keeps its own forward in float32.
GATED_MLP = frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})
FUSED_MLP = frozenset({"gate_up_proj", "down_proj", "activation_fn"})
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
#: Weights a format is timed over by ``choose``: more than a CPU's caches hold, as a step reads them.
_TIMED_BYTES = 64 << 20
#: How much faster a format's one-row products must be than float32's for ``auto`` to take it.
_PAYS = 1.2


def check_choice(choice: str) -> str:
    if choice not in DECODE_WEIGHTS:
        raise ValueError(f"decode_weights must be one of {DECODE_WEIGHTS}, got {choice!r}")
    return choice


class DecodeWeights:
    """Half-precision copies ([F, E], ``dtype``) of a model's projections: per layer, by the
    projection's attribute name (``q_proj``, ``down_proj``, ...), and the LM head's."""

    def __init__(self, model, name: str):
        #: The format's name, one of ``DECODE_WEIGHTS``.
        self.name = name
        self.dtype = _FORMATS[name]
        self.layers: list[dict[str, torch.Tensor]] = []
        for block in model.model.layers:
            halves: dict[str, torch.Tensor] = {}
            for part in _ATTN:
                self._copy(halves, part, getattr(block.self_attn, part, None))
            parts = {n for n, _ in block.mlp.named_children()} | {
                n for n in ("act_fn", "activation_fn") if hasattr(block.mlp, n)
            }
            if parts in (GATED_MLP, FUSED_MLP):
                for part in parts & {"gate_proj", "up_proj", "down_proj", "gate_up_proj"}:
                    self._copy(halves, part, getattr(block.mlp, part))
            self.layers.append(halves)
        head: dict[str, torch.Tensor] = {}
        self._copy(head, "lm_head", model.lm_head)
        self.head = head.get("lm_head")

    def _copy(self, into: dict[str, torch.Tensor], name: str, linear) -> None:
        if isinstance(linear, torch.nn.Linear) and linear.weight.dtype == torch.float32:
            into[name] = linear.weight.detach().to(self.dtype)

    @property
    def nbytes(self) -> int:
        tensors = [w for layer in self.layers for w in layer.values()]
        return sum(w.numel() * w.element_size() for w in [*tensors, *([self.head] if self.head is not None else [])])

    @classmethod
    def build(cls, model, choice: str) -> DecodeWeights | None:
        """The copies ``choice`` (one of ``DECODE_WEIGHTS``) asks for on ``model``: None for
        ``"float32"``, for a model not in float32 (its own weights are already what a copy
        would be) and where ``"auto"`` measured no format that pays."""
        check_choice(choice)
        if choice == "float32" or model.lm_head.weight.dtype != torch.float32:
            return None
        name = cls.choose(model) if choice == "auto" else choice
        if name == "float32":
            return None
        weights = cls(model, name)
        log.info("decode weights: one-row products read %s copies (%.0f MB more memory)", name, weights.nbytes / 1e6)
        return weights

    @staticmethod
    def choose(model) -> str:
        """The format whose one-row products over ``model``'s own MLP weights (at least
        ``_TIMED_BYTES`` of them in float32) are fastest on this machine, float32 unless another
        is ``_PAYS`` times faster."""
        mats: list[torch.Tensor] = []
        for block in model.model.layers:
            mats += [m.weight.detach() for m in block.mlp.children() if isinstance(m, torch.nn.Linear)]
            if sum(w.numel() * 4 for w in mats) >= _TIMED_BYTES:
                break
        if not mats:
            return "float32"
        times = {"float32": _time_rows(mats)}
        for name, dtype in _FORMATS.items():
            times[name] = _time_rows([w.to(dtype) for w in mats])
        best = min(times, key=times.__getitem__)
        picked = best if times["float32"] >= _PAYS * times[best] else "float32"
        log.info(
            "decode weights auto: %s (one-row products over %d MB of weights: %s)",
            picked,
            sum(w.numel() * 4 for w in mats) >> 20,
            ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items()),
        )
        return picked


def half_product(half: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, E] float32 -> x @ half.T (+ bias) [1, F] float32, the row scaled into the half
    format's range and back."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    y = F.linear((x / scale).to(half.dtype), half).to(x.dtype) * scale
    return y if bias is None else y + bias


def _time_rows(mats: list[torch.Tensor], reps: int = 3) -> float:
    """Seconds for one row through every matrix of ``mats`` (best of ``reps``, after one
    untimed pass): float32 products for float32 matrices, ``half_product`` for the others."""
    rows = {w.shape[1]: torch.randn(1, w.shape[1], device=w.device) for w in mats}
    cuda = mats[0].is_cuda
    best = float("inf")
    for rep in range(reps + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for w in mats:
            x = rows[w.shape[1]]
            _ = F.linear(x, w) if w.dtype == torch.float32 else half_product(w, x)
        if cuda:
            torch.cuda.synchronize()
        if rep:
            best = min(best, time.perf_counter() - t0)
    return best
