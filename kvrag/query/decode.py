"""Decoding after a prefill: the options of a generation (``Sampling``), the one per-reply
decoder that applies them (``Decoder``: drawing, accepting a token, the finish reason, the
token budget), and the steppers that continue the model.

Two back-ends continue from a prefilled cache:
* ``HFStepper`` hands the fused K/V to a transformers ``DynamicCache`` and calls the model's
  own forward one token at a time (exactly what ``generate`` does, so ``full_prefill`` equals
  plain greedy generation token for token);
* ``FusedStepper`` runs kvrag's own layer step and asks the policy, per layer, which cache
  slots each new token attends to (A2ATS' top-k retrieval).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvrag.arch import Arch
from kvrag.defaults import DEFAULT_MAX_NEW_TOKENS, MAX_LOGIT_BIAS, MAX_PENALTY
from kvrag.query.constrain import GrammarGaveUp, JsonConstraint

# The temperatures sampling can use: logits (shifted by their maximum) divided by one of these
# stay finite in float32; below it, 5e-324 say, the division overflows (or rounds to 0/0).
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6


@dataclass
class Sampling:
    """The options of one generation, every one of them: what ``KVRag.stream`` takes, what a
    served request holds (``GenerationRequest.sampling``) and what the framework wrappers
    expose as fields and per-call options (``kvrag.frameworks.options``). Checked here, at
    construction (ValueError names the bad option); ``kvrag.query.decoder.Decoder`` applies them.

    ``max_new_tokens``: None (unnamed) = ``DEFAULT_MAX_NEW_TOKENS`` cut to the room the prompt
    leaves in the model's context; a number is a demand, refused when the prompt leaves less
    (``budget``). ``temperature`` 0 = greedy, else in [MIN_TEMPERATURE, MAX_TEMPERATURE].
    ``presence_penalty`` / ``frequency_penalty`` / ``logit_bias``: OpenAI's adjustments, made
    to the logits before every draw, greedy ones included (``adjust_logits``): each token
    already generated loses ``presence_penalty`` once and ``frequency_penalty`` per time it
    was drawn (the prompt's tokens are not counted: a RAG answer should be free to repeat its
    context's words), and ``logit_bias`` adds a bias in [-100, 100] to the token ids it names.
    ``min_tokens`` / ``ignore_eos`` (vLLM's extras, e.g. for benchmarks at a fixed answer
    length): EOS cannot be drawn before ``min_tokens`` tokens (a stop string still ends the
    reply); ``ignore_eos`` decodes past EOS up to the token budget. ``json_schema``: hold the
    reply to a JSON document valid under this schema (``kvrag.query.constrain``;
    ``{"type": "object"}`` for any object), ended when it is complete."""

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: Sequence[str] = field(default_factory=tuple)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False
    json_schema: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        def is_int(x) -> bool:
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        def is_real(x) -> bool:  # NaN and inf fail every range check below by being excluded here
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 0):
            raise ValueError(
                f"max_new_tokens must be an integer >= 0 (or None: the default, cut to the room the prompt "
                f"leaves), got {self.max_new_tokens!r}"
            )
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
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is over the request's max_new_tokens={self.max_new_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.json_schema is not None and not isinstance(self.json_schema, Mapping):
            raise ValueError(f"a JSON schema must be a JSON object, got {type(self.json_schema).__name__}")

    def budget(self, prompt_tokens: int, context: int) -> int:
        """The tokens this generation may draw after a prompt of ``prompt_tokens`` in a context
        of ``context`` tokens: the one rule of the library and the server alike. Positions past
        the context were never trained, and decoding there degenerates silently, so an unnamed
        limit is ``DEFAULT_MAX_NEW_TOKENS`` cut to the room left, while a named one that does
        not fit is refused (ValueError), as OpenAI and vLLM refuse it. A prompt that leaves no
        room is refused unless no token is asked for."""
        room = context - prompt_tokens
        if self.max_new_tokens is None:
            if room < 1:
                raise ValueError(
                    f"prompt of {prompt_tokens} tokens leaves no room to generate in the model context "
                    f"({context} tokens); shorten the prompt (context exceeded)"
                )
            budget = min(DEFAULT_MAX_NEW_TOKENS, room)
        elif self.max_new_tokens > room:
            raise ValueError(
                f"the model's context is {context} tokens; the prompt takes {prompt_tokens} and "
                f"max_new_tokens={self.max_new_tokens} asks for more than the {max(room, 0)} left (context exceeded)"
            )
        else:
            budget = self.max_new_tokens
        if self.min_tokens > budget:
            raise ValueError(f"min_tokens={self.min_tokens} is over the request's max_new_tokens={budget}")
        return budget

    @property
    def adjusts(self) -> bool:
        """Whether ``adjust_logits`` changes anything."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def check_vocab(self, vocab: int) -> None:
        """Raise ValueError if ``logit_bias`` names a token id the model's ``vocab`` lacks."""
        bad = sorted(t for t in self.logit_bias if t >= vocab)
        if bad:
            raise ValueError(f"logit_bias: token id(s) {bad[:5]} outside the model's vocabulary of {vocab}")


#: The names of the generation options (``Sampling``'s fields): what ``KVRag.stream`` takes
#: as keywords beside the policy's parameters, and what the framework wrappers expose.
SAMPLING_OPTIONS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(Sampling))


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


class Decoder:
    """One reply's decoding rules, the one place they live: drawing each token (``Sampling``'s
    options: EOS barred before ``min_tokens``, penalties and biases, the JSON document's mask,
    then greedy or sampled with the reply's own generator), accepting it (its text, stop
    strings, the document it advances) and deciding when and why the reply ends. ``KVRag.stream``
    drives one over its stepper; the server's scheduler drives one per request and choice,
    drawing a whole batched step's tokens with ``draw_batch``.

    ``budget``: tokens it may draw (``Sampling.budget``); ``eos``: the model's end ids;
    ``constraint``: this reply's matcher for ``sampling.json_schema`` (a fresh one each: it
    holds the reply's state); ``choice``: which of a request's choices this is (its generator
    is seeded ``seed + choice``, so choice 0 draws what a lone request draws)."""

    def __init__(
        self,
        sampling: Sampling,
        budget: int,
        tokenizer,
        eos: set[int],
        constraint: JsonConstraint | None = None,
        choice: int = 0,
    ):
        self.sampling = sampling
        self.budget = budget
        self.eos = eos
        self._eos_ids = torch.tensor(sorted(eos), dtype=torch.long)
        self.constraint = constraint
        self.gen = torch.Generator().manual_seed(sampling.seed + choice) if sampling.seed is not None else None
        self.text = TextStream(tokenizer, sampling.stop)
        #: The tokens drawn so far, an EOS that ended the reply included.
        self.tokens: list[int] = []
        #: "stop" (EOS, a stop string or a complete document) or "length" once the reply ended.
        self.finish_reason: str | None = None if budget > 0 else "length"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def plain_greedy(self) -> bool:
        """Whether the next draw is the argmax of the (EOS-barred) logits: no sampling, no
        adjustment, no document mask (the batched step then takes the device's argmax)."""
        s = self.sampling
        return s.temperature == 0 and not s.adjusts and self.constraint is None

    def bar_eos(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] with EOS at -inf, in place, while the reply is short of ``min_tokens``."""
        if len(self.tokens) < self.sampling.min_tokens and len(self._eos_ids):
            logits[self._eos_ids.to(logits.device)] = float("-inf")
        return logits

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """The (EOS-barred) next-token logits [V] as the options shape them before the draw:
        penalties and biases, then what the JSON document may take next."""
        logits = adjust_logits(logits, self.sampling, self.tokens)
        return self.constraint.mask(logits) if self.constraint is not None else logits

    def draw(self, logits: torch.Tensor) -> int:
        """The next token from the model's next-token logits [V] (any device; EOS is barred in
        place when ``min_tokens`` asks it)."""
        return sample(self.shape(self.bar_eos(logits)).cpu(), self.sampling, self.gen)

    def accept(self, tok: int) -> str:
        """Take the drawn token: its text (the delta to show, maybe ''), and the end of the
        reply on EOS (unless ``ignore_eos``), a stop string, a complete document or the token
        budget -- "stop" winning over "length" when both end on the same token."""
        ends = self.ends_reply(tok)
        self.tokens.append(tok)
        cut = False
        if self.constraint is not None and not ends:  # EOS ends the reply: nothing to match
            try:
                self.constraint.accept(tok)
            except GrammarGaveUp:
                # The document cannot go on: the reply ends here, cut short as a token limit
                # cuts it ("length"), rather than failing the request after its tokens streamed.
                cut = True
        delta = self.text.push(tok)
        if cut:
            self.finish_reason = "length"
        elif self.text.stopped or ends or (self.constraint is not None and self.constraint.done):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.budget:
            self.finish_reason = "length"
        return delta

    def ends_reply(self, tok: int) -> bool:
        """Whether ``tok`` is an EOS that ends the reply (not part of its text, nor of its
        reported log-probabilities)."""
        return tok in self.eos and not self.sampling.ignore_eos

    def flush(self) -> str:
        """The text held back (a possible stop string's start), once the reply ended without one."""
        return self.text.flush() if not self.text.stopped else ""


def draw_batch(decoders: Sequence[Decoder], logits: torch.Tensor) -> list[int]:
    """The next token of each reply of a batched step from its logits [B, V] (row ``i`` for
    ``decoders[i]``; EOS is barred in place where ``min_tokens`` asks it), each drawn as its
    ``Decoder.draw`` would. One host read for the batch: plain greedy rows take the device's
    argmax; sampled, adjusted or constrained rows are shaped on the device and drawn on the
    host with their own generators."""
    for i, d in enumerate(decoders):
        if len(d.tokens) < d.sampling.min_tokens:
            d.bar_eos(logits[i])
    toks = logits.argmax(-1).tolist()
    own = [i for i, d in enumerate(decoders) if not d.plain_greedy]
    if own:
        rows = torch.stack([decoders[i].shape(logits[i]).float() for i in own])
        for i, row in zip(own, rows.cpu()):
            toks[i] = sample(row, decoders[i].sampling, decoders[i].gen)
    return toks
