"""The batched decode step compiled with ``torch.compile``: the whole step (embedding, every
layer, final norm and LM head) as one graph over a ``DecodeArena``'s padded buffers.

Run op by op, a decode step is ~40 small kernels a layer, each paying the host's dispatch
(tens of microseconds on a CPU, more on a GPU where the kernels themselves take microseconds);
compiled, inductor fuses the element-wise work (norms, RoPE, residuals, the activation) into a
few generated kernels around the matrix products, and on a GPU ``mode="reduce-overhead"``
replays the step as one CUDA graph.

The sizes stay symbolic (marked dynamic): the rows every request has filled grow by one each
step and the batch changes as requests come and go, and a graph specialised to one length
would recompile (a minute on a 2-core CPU) at every step. Two graphs are built, for one
request and for several (dynamo specialises a size of 1), at ``warm_up`` or at first use. On
a GPU, CUDA graphs are recorded per shape, so there the keys read are padded up to a bucket
of ``GPU_ROW_BUCKET`` rows (the padding masked out) and a recording serves a whole bucket.

What stays eager (``CompiledStep.supports``): models with sliding-window or soft-capped
attention (the arena's own limit: Gemma 2/3, windowed Mistral/Qwen2), and rotary tables that
depend on the sequence length (LongRoPE, dynamic NTK), which the eager step computes per
request. Requests decoded outside the arena (A2ATS' per-step row selection, thinned caches of
windowed models) keep their own steppers.

Shapes: ``B`` requests, ``S`` arena slots (>= B), ``Hkv`` KV heads, ``R`` arena rows, ``D``
head dim, ``L`` layers, ``V`` vocabulary.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable, Sequence

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

from kvrag.arch import Arch
from kvrag.defaults import COMPILE_CHOICES

log = logging.getLogger("kvrag")

#: Keys read per step are padded to a multiple of this many rows on a GPU, so one recorded
#: CUDA graph serves every length in the bucket.
GPU_ROW_BUCKET = 256


def compile_wanted(choice: str | bool, device: torch.device, serving: bool) -> bool:
    """Whether ``choice`` (one of ``COMPILE_CHOICES``, or a bool) turns the compiled step on.

    ``"auto"``: on for a long-running server (``serving``), whose warm-up pays the compile
    once for every request after, and on a GPU, where the host's launches are most of a step;
    off in a library process on the CPU, where the first answer would wait for the compile
    (~1 to 2 minutes for a 135M model on 2 cores; docs/bench/host_floor) to save tens of
    milliseconds a token."""
    if isinstance(choice, bool):
        return choice
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {COMPILE_CHOICES} (or a bool), got {choice!r}")
    if choice == "auto":
        return serving or device.type == "cuda"
    return choice == "on"


def _arena_step(
    arch: Arch,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    rows: torch.Tensor,
    key_index: torch.Tensor,
    grouped: bool,
) -> torch.Tensor:
    """One decode step of an arena's first B slots: token_ids, positions long [B]; keys /
    values per layer [B, Hkv, R, D] (written in place: row ``rows[layer, b]`` of slot ``b``
    gets the new token's k/v); rows long [L, B], each slot's filled rows per layer;
    key_index long [T] = arange(T), T <= R the keys read (at least ``rows.max() + 1``: a
    length carried by a tensor's size, which stays symbolic where a Python int would be
    specialised); ``grouped``: the model has fewer KV heads than query heads -> logits
    float32 [B, V].

    The same arithmetic as ``kvrag.query.batch.decode_step`` over the arena, every layer
    masked by key padding (a slot's rows past its own are hidden)."""
    b, top = token_ids.shape[0], key_index.shape[0]
    hidden = arch.embed(token_ids)  # [B, E]
    cs = arch.cos_sin(positions)
    slots = torch.arange(b, device=token_ids.device)
    for layer in range(arch.n_layers):
        q, k, v, _ = arch.qkv(layer, hidden, cs)  # q [H, B, D], k/v [Hkv, B, D]
        K, V = keys[layer], values[layer]
        n = rows[layer]
        K[slots, :, n] = k.transpose(0, 1).to(K.dtype)
        V[slots, :, n] = v.transpose(0, 1).to(V.dtype)
        mask = (key_index[None, :] <= n[:, None]).view(b, 1, 1, top)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(2),  # [B, H, 1, D]
            K[:, :, :top].to(q.dtype),
            V[:, :, :top].to(q.dtype),
            attn_mask=mask,
            scale=arch.scaling,
            enable_gqa=grouped,
        )  # [B, H, 1, D]
        hidden = arch.finish_layer(layer, hidden, out.reshape(b, -1))
    return arch.logits(hidden)


def _rows_forward(
    arch: Arch,
    start: int,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    active: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    mask: torch.Tensor,
) -> torch.Tensor:
    """The fused prefill's layer loop from layer ``start`` on, for a fixed set of computed
    rows: hidden [A, E] (the active rows' input to layer ``start``); cos/sin [A, D] their RoPE
    rows; active long [A], their slots among the prompt's N; keys/values per layer [Hkv, N, D],
    the stored rows placed (the active rows written here, in place, from layer ``start``
    on); mask float [A, N], SDPA's additive causal mask -> the last layer's hidden [A, E].

    The arithmetic of ``FusionEngine.prefill``'s eager loop where no hook narrows the rows,
    each layer's attention one call over every key (the eager loop may split the rows into
    groups over key prefixes: the same result)."""
    for layer in range(start, arch.n_layers):
        q, k, v, _ = arch.qkv(layer, hidden, (cos, sin))
        keys[layer].index_copy_(1, active, k)
        values[layer].index_copy_(1, active, v)
        hidden = arch.attend(layer, hidden, q, keys[layer], values[layer], mask)
    return hidden


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own. Dynamo keeps graphs per code object, guarded on
    the arguments (the model among them): with one shared code object, every model a process
    compiles for (a test suite, a base model beside its adapted copy) would share one limit of
    recompiles (eight), and the model past it would silently run eagerly."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class _Compiled:
    """One function compiled with inductor: ``compiles`` counts the graphs built (each a
    compile), ``compile_s`` the seconds the calls that built them took."""

    def __init__(self, fn: Callable, options: dict[str, object]):
        self.compiles = 0
        self.compile_s = 0.0

        def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]):
            self.compiles += 1
            return torch._inductor.compile(gm, list(example_inputs), options=options)

        self._fn = torch.compile(_own_code(fn), backend=backend, dynamic=False)
        # Compiling is not something two threads should do at once; running the built graph is.
        self._lock = threading.Lock()

    def _build(self, args: tuple, what: str) -> torch.Tensor:
        """``fn(*args)`` as the call that may build a graph (its sizes marked symbolic by the
        caller), its compile time counted and logged as ``what``."""
        # Without duck sizing, sizes that happen to be equal in the call that builds the graph
        # (the rows read and the rows held, say) stay separate symbols instead of one the
        # graph then guards on.
        with self._lock, fx_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            before, t0 = self.compiles, time.perf_counter()
            out = self._fn(*args)
            if self.compiles > before:
                took = time.perf_counter() - t0
                self.compile_s += took
                log.info("compiled %s in %.1f s", what, took)
        return out


class CompiledStep(_Compiled):
    """``torch.compile`` of one model's arena decode step (``kvrag.query.batch.decode_step``
    calls it for a step of exactly an arena's members)."""

    def __init__(self, arch: Arch):
        gpu = arch.device.type == "cuda"
        super().__init__(_arena_step, {"triton.cudagraphs": True} if gpu else {})
        self.arch = arch
        self._bucket = GPU_ROW_BUCKET if gpu else 1
        self._grouped = arch.n_heads != arch.n_kv_heads
        self._warm: set[bool] = set()  # which graphs (one request, several) are built

    @staticmethod
    def supports(arch: Arch) -> bool:
        """Whether ``arch``'s step compiles here, given that its caches fit an arena (no
        sliding windows, no soft-cap): not where the rotary tables depend on the length."""
        return not arch.length_dependent_rope

    def __call__(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        rows: torch.Tensor,
        top: int,
    ) -> torch.Tensor:
        """The step of an arena's first B slots: token_ids, positions long [B] on the model's
        device; keys / values per layer [S, Hkv, R, D], with two free rows past every slot's
        filled ones (``DecodeArena.reserve``); rows long [L, B] (filled rows per layer and
        slot); ``top`` = rows.max() + 1 (known on the host) -> logits float32 [B, V]."""
        b = int(token_ids.shape[0])
        top = min(-(-top // self._bucket) * self._bucket, int(keys[0].shape[2]))
        key_index = torch.arange(top, device=token_ids.device)
        # The first B slots (a leading slice of a contiguous buffer: contiguous, written in
        # place), so the graph sees one batch size where the arena may hold spare slots.
        keys, values = [k[:b] for k in keys], [v[:b] for v in values]
        args = (self.arch, token_ids, positions, keys, values, rows, key_index, self._grouped)
        many = b > 1
        if many in self._warm:
            return self._fn(*args)
        # The sizes that change from step to step are marked symbolic, so the graph built
        # here serves them all (a size of 1 stays specialised: dynamo's rule).
        for t in (token_ids, positions, key_index):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(rows, 1)
        for t in (*keys, *values):
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)
        out = self._build(args, f"the decode step for {'several requests' if many else 'one'}")
        self._warm.add(many)
        return out


class CompiledRows(_Compiled):
    """``torch.compile`` of the fused prefill's layer loop (``_rows_forward``) from the layer
    where a policy's computed rows are fixed (``Policy.rows_fixed_after``): from layer 0 for
    ``naive_reuse``, ``epic`` and ``kvlink`` without recompute (the question, template and
    inserted tokens after the placed chunks), after the ranking layer for ``cacheblend`` (and
    ``kvlink`` with its recompute). Op by op that loop is ~30 small kernels a layer for a few
    dozen rows, each paying the host's dispatch (most of such a forward on a GPU, docs/gpu.md);
    compiled, inductor fuses the element-wise work around the matrix products.

    The rows (A) and keys (N) of a prompt stay symbolic, so one graph per start layer serves
    every prompt (dynamo specialises a size of 1: a prompt of one computed row runs eagerly).
    The engine calls it only for rows attended in one call (``Arch.attention_plan`` None):
    many rows spread over a prompt are attended op by op in groups over key prefixes, about
    half the arithmetic, which one call over the whole mask would not skip.
    Supported
    where the compiled decode step is (``CompiledStep.supports``) and no layer has a sliding
    window (whose attention the eager loop splits by window)."""

    def __init__(self, arch: Arch):
        super().__init__(_rows_forward, {})
        self.arch = arch
        self._warm: set[int] = set()  # the start layers whose graphs are built
        #: Why the graph could not be built (the engine then runs the loop op by op), or None.
        self.failed: str | None = None

    @staticmethod
    def supports(arch: Arch) -> bool:
        return CompiledStep.supports(arch) and arch.attn_softcap is None and all(w is None for w in arch.windows)

    def __call__(
        self,
        start: int,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        active: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor | None:
        """``_rows_forward`` (same arguments, cos/sin as a pair) -> the last layer's hidden
        [A, E]; None when the graph cannot be built here (``failed`` says why; logged once):
        the caller runs the loop op by op, which rewrites every active row it reads."""
        if self.failed is not None:
            return None
        args = (self.arch, start, hidden, *cos_sin, active, keys, values, mask)
        try:
            if start in self._warm:
                return self._fn(*args)
            out = self._first(args)
        except Exception as e:  # noqa: BLE001 - a compiler's failure (a recompile's too) leaves the eager loop
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("the fused prefill's rows run op by op: compiling them failed (%s)", self.failed)
            return None
        self._warm.add(start)
        return out

    def _first(self, args: tuple) -> torch.Tensor:
        """A start layer's first call: the sizes that change from prompt to prompt marked
        symbolic, so the graph built here serves them all."""
        _, start, hidden, cos, sin, active, keys, values, mask = args
        for t in (hidden, cos, sin, active, mask):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(mask, 1)
        for t in (*keys, *values):
            torch._dynamo.maybe_mark_dynamic(t, 1)
        return self._build(args, f"the fused prefill's computed rows from layer {start}")

    def warm_up(self, start: int = 0) -> float:
        """Build the graph from layer ``start`` now, on a dummy prompt of a few rows -> the
        seconds it took (~0 when it was built)."""
        arch, t0 = self.arch, time.perf_counter()
        n, a = 8, 3
        active = torch.arange(n - a, n, device=arch.device)
        shape = (arch.n_kv_heads, n, arch.head_dim)
        keys = [torch.zeros(shape, dtype=arch.dtype, device=arch.device) for _ in range(arch.n_layers)]
        values = [torch.zeros(shape, dtype=arch.dtype, device=arch.device) for _ in range(arch.n_layers)]
        pos = torch.arange(n, device=arch.device)
        mask = torch.zeros(a, n, dtype=arch.dtype, device=arch.device).masked_fill_(
            active[:, None] < pos[None, :], float("-inf")
        )
        cos, sin = arch.cos_sin(active)
        hidden = arch.embed(torch.zeros(a, dtype=torch.long, device=arch.device))
        with torch.no_grad():
            self(start, hidden, (cos, sin), active, keys, values, mask)
        return time.perf_counter() - t0
