"""Decoding after a prefill: sampling, stop conditions, streaming.

Two back-ends continue from a prefilled cache:
* ``HFStepper`` hands the fused K/V to a transformers ``DynamicCache`` and calls the model's
  own forward one token at a time (exactly what ``generate`` does, so ``full_prefill`` equals
  plain greedy generation token for token);
* ``FusedStepper`` runs kvrag's own layer step and asks the policy, per layer, which cache
  slots each new token attends to (A2ATS' top-k retrieval).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvrag.arch import Arch
from kvrag.defaults import DEFAULT_MAX_NEW_TOKENS, MAX_LOGIT_BIAS, MAX_PENALTY
from kvrag.query.constrain import JsonConstraint

# The temperatures sampling can use: logits (shifted by their maximum) divided by one of these
# stay finite in float32; below it, 5e-324 say, the division overflows (or rounds to 0/0).
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6


@dataclass
class Sampling:
    """Decoding options. temperature 0 = greedy, else in [MIN_TEMPERATURE, MAX_TEMPERATURE].

    ``presence_penalty`` / ``frequency_penalty`` / ``logit_bias``: OpenAI's adjustments, made
    to the logits before every draw, greedy ones included (``adjust_logits``): each token
    already generated loses ``presence_penalty`` once and ``frequency_penalty`` per time it
    was drawn (the prompt's tokens are not counted: a RAG answer should be free to repeat its
    context's words), and ``logit_bias`` adds a bias in [-100, 100] to the token ids it names."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: Sequence[str] = field(default_factory=tuple)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def is_int(x) -> bool:
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        def is_real(x) -> bool:  # NaN and inf fail every range check below by being excluded here
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got "
                f"{self.temperature!r} (sampling cannot divide logits by it without overflow; use 0 for greedy)"
            )
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k), got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(self, name)
            if not is_real(x) or not -MAX_PENALTY <= x <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {x!r}")
        if self.logit_bias is None:
            self.logit_bias = {}
        if not isinstance(self.logit_bias, Mapping):
            raise ValueError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}")
        for tok, bias in self.logit_bias.items():
            if not is_int(tok) or tok < 0:
                raise ValueError(f"logit_bias: token ids must be integers >= 0, got {tok!r}")
            if not is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias: a bias must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias!r} for token {tok}"
                )
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.stop is None:
            self.stop = ()
        elif isinstance(self.stop, str):
            if not self.stop:
                raise ValueError("stop must be a non-empty string (or a sequence of them, or None), got ''")
            self.stop = (self.stop,)
        else:
            self.stop = tuple(self.stop)
            bad = [x for x in self.stop if not isinstance(x, str) or not x]
            if bad:
                raise ValueError(f"stop must be a string or a sequence of non-empty strings, got {bad[0]!r} in it")

    @property
    def adjusts(self) -> bool:
        """Whether ``adjust_logits`` changes anything."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def check_vocab(self, vocab: int) -> None:
        """Raise ValueError if ``logit_bias`` names a token id the model's ``vocab`` lacks."""
        bad = sorted(t for t in self.logit_bias if t >= vocab)
        if bad:
            raise ValueError(f"logit_bias: token id(s) {bad[:5]} outside the model's vocabulary of {vocab}")


def adjust_logits(logits: torch.Tensor, s: Sampling, generated: Sequence[int]) -> torch.Tensor:
    """Next-token ``logits`` [V] with ``s``'s penalties over the ``generated`` token ids and
    its ``logit_bias`` applied (a new float32 tensor; ``logits`` itself when nothing applies).
    A token barred at -inf stays barred."""
    if not s.adjusts:
        return logits
    out = logits.float().clone()
    if generated and (s.presence_penalty or s.frequency_penalty):
        ids = torch.tensor(list(generated), dtype=torch.long, device=out.device)
        counts = torch.bincount(ids, minlength=out.numel())[: out.numel()].to(out.dtype)
        out -= counts * s.frequency_penalty + (counts > 0).to(out.dtype) * s.presence_penalty
    if s.logit_bias:
        idx = torch.tensor(list(s.logit_bias), dtype=torch.long, device=out.device)
        out[idx] += torch.tensor(list(s.logit_bias.values()), dtype=out.dtype, device=out.device)
    return out


def sample(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> int:
    """Pick the next token from logits [V]."""
    if s.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float()
    logits = (logits - logits.max()) / s.temperature  # shifted first: the same softmax, no overflow
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1:
        sp, si = probs.sort(descending=True)
        cut = sp.cumsum(0) - sp > s.top_p
        sp[cut] = 0
        probs = torch.zeros_like(probs).scatter(0, si, sp)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


@functools.cache
def _cache_kwarg(model_class) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """The forward keyword that takes a KV cache, under the name the installed transformers
    uses: ``cache`` from 5.24 (``past_key_values`` deprecated there, removed in 5.40), else
    ``past_key_values`` (looked up once per model class: this runs at every decode step)."""
    # Classes are hashable; typeshed types lru_cache's argument as Hashable, which type[Any] is not.
    return {_cache_kwarg(type(model)): cache}  # type: ignore[arg-type]


def output_cache(out):
    """The cache a forward returned: ``out.cache`` from transformers 5.24, else
    ``out.past_key_values``."""
    return out["cache"] if "cache" in out else out.past_key_values


def cache_from_kv(K: Sequence[torch.Tensor], V: Sequence[torch.Tensor]) -> DynamicCache:
    """A ``DynamicCache`` holding per-layer K/V [Hkv, M, D] without copying them.

    ``DynamicCache.update`` on an empty layer concatenates onto an empty tensor, i.e. copies
    the whole prompt's K/V (~190 MB at 4k tokens on SmolLM2, tens of ms of TTFT): each layer is
    created by an empty update and then handed the tensors themselves. Layers of another kind
    than ``DynamicLayer`` (sliding window) keep the ``update`` path and its semantics."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(K, V)):
        k, v = k.unsqueeze(0), v.unsqueeze(0)
        cache.update(k[:, :, :0], v[:, :, :0], layer)
        slot = cache.layers[layer]
        if type(slot) is DynamicLayer:
            slot.keys, slot.values = k, v
        else:
            cache.update(k, v, layer)
    return cache


class HFStepper:
    """Continue with the model's own forward over a DynamicCache.

    K/V: per layer [Hkv, M, D] (keys rotated), ``next_position``: position of the next token."""

    def __init__(self, model, K=None, V=None, next_position: int = 0, cache: DynamicCache | None = None):
        self.model = model
        if cache is None:
            cache = cache_from_kv(K, V)
        self.cache = cache
        self.pos = next_position

    @torch.no_grad()
    def step(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Feed tokens [T]; logits [T, V] for the token after each ([1, V] if last_only:
        a long prefill must not materialise T x V logits)."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.model.device)
        t = ids.shape[1]
        pos = torch.arange(self.pos, self.pos + t, device=ids.device).unsqueeze(0)
        past = self.cache.get_seq_length()
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            **cache_kwargs(self.model, self.cache),
            use_cache=True,
            cache_position=torch.arange(past, past + t, device=ids.device),
            logits_to_keep=1 if last_only else 0,
        )
        self.cache = output_cache(out)
        self.pos += t
        return out.logits[0].float()

    def checkpoint(self) -> tuple[int, int]:
        """A point to ``rewind`` to: (cached tokens, next position)."""
        return self.cache.get_seq_length(), self.pos

    def rewind(self, point: tuple[int, int]) -> None:
        """Drop every token fed since ``checkpoint()``, so another continuation can be
        teacher-forced from the same prefill instead of prefilling again."""
        seq, pos = point
        extra = self.cache.get_seq_length() - seq
        if extra < 0:
            raise ValueError("cannot rewind to a checkpoint past the cache's end")
        if extra:
            self.cache.crop(-extra)
        self.pos = pos


class FusedStepper:
    """Continue with kvrag's layer step; ``policy.decode_select`` (if set) picks the slots to
    read. Sliding windows apply by key position, so the cache may be any subset of the prompt."""

    def __init__(self, arch: Arch, K, V, next_position: int, policy, state, positions=None):
        """``positions``: of the cache rows, [M] or [L, Hkv, M] (``FusionResult.positions``;
        None = 0..M-1); read only by the layers with a sliding window."""
        self.arch, self.policy, self.state = arch, policy, state
        self.K, self.V = list(K), list(V)
        self._bufs: dict[int, tuple] = {}  # layer -> (K, V, key positions or None) with spare rows
        self.pos = next_position
        # Per-layer key positions [Hkv, M] for the sliding-window layers only.
        self.kpos: dict[int, torch.Tensor] = {}
        if positions is None and self.K:
            positions = torch.arange(self.K[0].shape[1])
        for layer, w in enumerate(arch.windows):
            if w is not None:
                p = positions[layer] if positions.dim() == 3 else positions.expand(self.K[layer].shape[0], -1)
                self.kpos[layer] = p.to(self.K[layer].device).long()

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add one token's k/v [Hkv, 1, D] (and its key position) after the layer's rows.

        Rows live in buffers with spare capacity that double when full, ``self.K[layer]`` being
        the filled view: a ``torch.cat`` per token would copy the whole cache at every step.
        The first step copies the prefill's K/V into a buffer (not done at construction,
        which is on the TTFT path)."""
        n = self.K[layer].shape[1]
        bufs = self._bufs.get(layer)
        if bufs is None or bufs[0].shape[1] == n:
            cap = max(2 * n, n + 64)
            grown: list[torch.Tensor | None] = []
            for t in (self.K[layer], self.V[layer], self.kpos.get(layer)):
                if t is None:
                    grown.append(None)
                    continue
                b = t.new_empty((t.shape[0], cap, *t.shape[2:]))
                b[:, :n] = t
                grown.append(b)
            bufs = self._bufs[layer] = tuple(grown)
        kb, vb, pb = bufs
        kb[:, n : n + 1] = k
        vb[:, n : n + 1] = v
        self.K[layer], self.V[layer] = kb[:, : n + 1], vb[:, : n + 1]
        if pb is not None:
            pb[:, n] = self.pos
            self.kpos[layer] = pb[:, : n + 1]

    def _window_mask(self, layer: int, idx) -> torch.Tensor | None:
        """bool [H, 1, R] (True = inside the layer's sliding window) for the rows read, or None."""
        if layer not in self.kpos:
            return None
        kp = self.kpos[layer]  # [Hkv, M]
        if idx is not None:
            kp = kp.gather(1, idx) if idx.dim() == 2 else kp[:, idx]
        window = self.arch.windows[layer]
        if window is None:  # a layer without a window: every row is inside
            return None
        inside = (self.pos - kp) < window
        if bool(inside.all()):
            return None
        group = int(self.arch.n_heads) // int(self.arch.n_kv_heads)
        return inside.repeat_interleave(group, dim=0).unsqueeze(1)

    @torch.no_grad()
    def step(self, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        rows = []
        for tok in token_ids:
            pos = torch.tensor([self.pos], device=self.arch.device)
            cs = self.arch.cos_sin(pos)
            hidden = self.arch.embed(torch.tensor([tok]))
            for layer in range(self.arch.n_layers):
                q, k, v, _ = self.arch.qkv(layer, hidden, cs)
                self._append(layer, k, v)
                # None: read every row (a policy without a decode-time selection, run here for
                # position-aware sliding windows over a thinned cache).
                select = self.policy.decode_select
                idx = select(layer, q, self) if select is not None else None
                keys, vals = self.K[layer], self.V[layer]
                if idx is not None and idx.dim() == 2:
                    # Per-KV-head slots [Hkv, R] (A2ATS: each head reads its own top-k rows).
                    gather = idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
                    keys, vals = keys.gather(1, gather), vals.gather(1, gather)
                elif idx is not None:
                    keys, vals = keys[:, idx], vals[:, idx]
                hidden = self.arch.attend(layer, hidden, q, keys, vals, self._window_mask(layer, idx))
            rows.append(self.arch.logits(hidden)[0])
            self.pos += 1
        return torch.stack(rows)


class TextStream:
    """Incremental detokenisation with stop strings: ``push(token) -> new text`` (may be '')."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                text, self.stopped = text[:cut], True
        # Hold back a partial multi-byte character and any tail that could start a stop string.
        hold = 0
        if not self.stopped:
            if text.endswith("\ufffd"):
                return ""
            for s in self.stop:
                for j in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:j]):
                        hold = max(hold, j)
                        break
        visible = text[: len(text) - hold]
        delta = visible[len(self.emitted) :] if visible.startswith(self.emitted) else ""
        self.emitted = visible if visible.startswith(self.emitted) else self.emitted
        return delta

    def flush(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gc = getattr(model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), tokenizer.eos_token_id):
        if src is None:
            continue
        ids.update(src if isinstance(src, (list, tuple)) else [src])
    return ids


def generate_tokens(
    first_logits: torch.Tensor, stepper, sampling: Sampling, eos: set[int], constraint: JsonConstraint | None = None
) -> Iterator[int]:
    """Yield token ids: the first from ``first_logits`` [V], then one stepper call each;
    ``constraint``: the document the reply must be (``kvrag.query.constrain``), which ends it
    when complete."""
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator().manual_seed(sampling.seed)
    logits = first_logits
    drawn: list[int] = []
    for i in range(sampling.max_new_tokens):
        logits = adjust_logits(logits, sampling, drawn)
        if constraint is not None:
            logits = constraint.mask(logits)
        tok = sample(logits.cpu(), sampling, gen)
        drawn.append(tok)
        if constraint is not None and tok not in eos:  # EOS ends the reply: nothing to match
            constraint.accept(tok)
        yield tok
        if tok in eos or i == sampling.max_new_tokens - 1 or (constraint is not None and constraint.done):
            return
        logits = stepper.step([tok])[-1]
