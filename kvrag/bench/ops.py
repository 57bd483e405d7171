"""Op counts: how many work-doing aten ops a fused prefill, a decode step, or transformers'
own forward runs.

On a GPU at RAG sizes the time goes to launching kernels, not to computing them, so the number
of ops that do work is the cost a CPU can measure of what a GPU pays. The count is exact and
deterministic (a ``TorchDispatchMode`` sees every aten op after autograd and the composite
decompositions, i.e. the ops a backend runs), cheaper than the profiler, and a test can assert
it.

Not counted, because they launch no kernel:

* views and other metadata-only ops: every op whose schema says all its outputs alias an
  input without writing it (``view``, ``expand``, ``slice``, ``select``, ``as_strided``,
  ``transpose``, ``permute``, ``t``, ``unsqueeze``, ``squeeze``, ``detach``, ``alias``,
  ``split``/``chunk``/``unbind``, ``unfold``...), plus ``_unsafe_view`` and ``_reshape_alias``
  (views whose schema does not say so) and ``lift_fresh`` (``torch.tensor``'s identity);
* allocations without a fill (``empty``, ``empty_like``, ``empty_strided``): a caching
  allocator hands memory back without a kernel;
* shape queries (``sym_size``, ``sym_stride``, ``sym_numel``, ``is_same_size``).

In-place ops (``add_``, ``copy_``, ``index_put_``) write their input and are counted.

``syncs`` counts the ops that make a CUDA host wait for the device: ``_local_scalar_dense``
(``int(t)``, ``bool(t)``, ``t.item()``) and the ops whose output size depends on the data
(``nonzero``, ``unique``, ``masked_select``). ``.tolist()`` and ``.cpu()`` of a CPU tensor
dispatch nothing, so a CPU count misses those syncs (on CUDA they are ``_to_copy`` ops).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Metadata-only ops whose schema does not mark their output as an alias (see the docstring).
NOT_WORK = frozenset(
    {
        "_unsafe_view",
        "_reshape_alias",
        "lift_fresh",
        "empty",
        "empty_like",
        "empty_strided",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "size",
        "stride",
        "dim",
        "is_contiguous",
        "resolve_conj",
        "resolve_neg",
    }
)
#: Ops that make the host wait for the device on CUDA.
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "masked_select",
        "nonzero_static",
    }
)


def is_view(func) -> bool:
    """True when every output of the aten op ``func`` aliases an input it does not write
    (a view), per its schema's alias annotations (``Tensor(a)``, not ``Tensor(a!)``)."""
    returns = func._schema.returns
    if not returns:
        return False
    for r in returns:
        info = r.alias_info
        if info is None or info.is_write:
            return False
    return True


def does_work(func) -> bool:
    """True for an aten op that runs a kernel (see the module docstring for what is excluded)."""
    name = func.overloadpacket.__name__
    return name not in NOT_WORK and not is_view(func)


@dataclass
class OpCount:
    """total: work-doing ops; syncs: of them, host-device syncs on CUDA; by_op: op name -> count."""

    total: int = 0
    syncs: int = 0
    by_op: Counter = field(default_factory=Counter)

    def top(self, k: int = 10) -> list[tuple[str, int]]:
        return self.by_op.most_common(k)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` counts the work-doing aten ops run inside into ``c.count``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = OpCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if does_work(func):
            name = func.overloadpacket.__name__
            self.count.total += 1
            self.count.by_op[name] += 1
            if name in SYNC_OPS:
                self.count.syncs += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn, *args, **kwargs) -> tuple[OpCount, object]:
    """(ops of ``fn(*args, **kwargs)``, its result)."""
    with OpCounter() as c:
        out = fn(*args, **kwargs)
    return c.count, out


def prefilled_cache(model, n_cached: int):
    """A transformers ``DynamicCache`` holding ``n_cached`` tokens of (zero) K/V per layer in
    the model's dtype and device: the prefix cache a plain forward of the question runs over.
    The values do not matter for counting or timing the question's forward."""
    from kvrag.query.decode import cache_from_kv

    cfg = model.config
    n_layers = cfg.num_hidden_layers
    hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p = next(model.parameters())
    kv = [torch.zeros(hkv, n_cached, d, dtype=p.dtype, device=p.device) for _ in range(2 * n_layers)]
    return cache_from_kv(kv[:n_layers], kv[n_layers:])


@torch.no_grad()
def plain_forward(model, n_cached: int, n_new: int, cache=None):
    """transformers' own forward of ``n_new`` tokens over a pre-filled cache of ``n_cached``
    (``model(ids, past_key_values=cache)``): the floor a fused prefill that computes only the
    non-cached tokens compares with. Returns the model's output."""
    from kvrag.query.decode import cache_kwargs

    p = next(model.parameters())
    cache = prefilled_cache(model, n_cached) if cache is None else cache
    ids = torch.ones(1, n_new, dtype=torch.long, device=p.device)
    return model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)


def plain_forward_ops(model, n_cached: int, n_new: int) -> OpCount:
    """Ops of ``plain_forward`` (the cache is built outside the count)."""
    cache = prefilled_cache(model, n_cached)
    return count_ops(plain_forward, model, n_cached, n_new, cache)[0]


def query_ops(rag, prompt, policy, **policy_params) -> dict:
    """Ops of one query of ``rag`` (a ``KVRag``): ``prefill`` = the fused prefill (chunk reads
    excluded: they happen before it), ``decode`` = one decode step after it, ``plain`` =
    ``plain_forward`` of the same non-cached count over the same cached count, plus the
    layout's ``tokens``/``cached``/``chunks``. Raises ValueError when no chunk of ``prompt``
    is cached (there is no fused prefill to count)."""
    from kvrag.layout.state import CACHED

    prep = rag.prepare(prompt, policy, **policy_params)
    if prep.layout is None:
        raise ValueError("query_ops: no chunk of the prompt is cached (nothing fused to count)")
    layout = prep.layout
    prefill, _ = count_ops(rag.fusion.prefill, layout, prep.policy)
    stepper = rag.fuse(prep).stepper
    decode, _ = count_ops(stepper.step, [1])
    n_cached = int(layout.cached.sum())
    plain = plain_forward_ops(rag.handle.model, n_cached, layout.n - n_cached)
    return {
        "prefill": prefill,
        "decode": decode,
        "plain": plain,
        "tokens": layout.n,
        "cached": n_cached,
        "chunks": sum(p.kind == CACHED for p in layout.pieces),
    }
