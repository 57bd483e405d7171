"""Batched decoding: one decode step for many requests, each over its own cache.

Requests in flight hold caches of different lengths (their prompts differ, and so do the
policies that filled them). A decode step runs the token-wise work of every layer — norms,
q/k/v and output projections, MLP, final norm and LM head, i.e. nearly all the weight reads —
once for the whole batch ([B, E] rows), and only the attention per request, each new query
against its own cache. No cache is padded or copied per step: each ``DecodeCache`` keeps its
K/V in a buffer with spare rows, and the step writes the new token's k/v into the next row.

Where the model has neither sliding windows nor soft-capped attention, the caches of the
requests decoding together can live in one ``DecodeArena``: a padded buffer per layer, each
request's ``DecodeCache`` a view of its slot, so the step attends for all of them in one call
(a key-padding mask hides each slot's unused rows) instead of one call per request and layer.

The step is failure-atomic: rows are written past each cache's filled length and the length
advances only after the whole step succeeded, so a step that raises leaves every cache as it
was and can be retried with fewer requests.

Shapes: ``B`` requests in the step, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim,
``E`` hidden size, ``M`` rows in one request's cache at a layer, ``V`` vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvrag.arch import Arch
from kvrag.query.compiled import CompiledStep
from kvrag.query.decode import FusedStepper, HFStepper

#: The fewest spare rows a cache grows by when a request outgrows the rows it was given.
MIN_SPARE_ROWS = 64


class DecodeCache:
    """One request's decode state: per-layer K/V [Hkv, M, D] (keys rotated) in buffers with
    spare rows, and the position of the next token.

    ``key_positions``: layer -> [Hkv, M], the positions of a sliding-window layer's rows. Rows
    holding the consecutive positions before the next token (any unthinned cache, and the
    rows transformers keeps on its windowed layers) need none: the window is then the last
    rows, read as a slice without a mask. A thinned cache's rows (SamKV, A3's eviction) are
    not consecutive, so the window applies by position, with a mask, as ``FusedStepper``
    applies it."""

    def __init__(
        self,
        arch: Arch,
        K: Sequence[torch.Tensor],
        V: Sequence[torch.Tensor],
        next_position: int,
        key_positions: dict[int, torch.Tensor],
        spare: int = MIN_SPARE_ROWS,
    ):
        self.arch = arch
        #: The ``DecodeArena`` whose slot holds this cache's rows (None: buffers of its own).
        self.arena: DecodeArena | None = None
        self.pos = int(next_position)
        self.n = [int(k.shape[1]) for k in K]
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._kpos: dict[int, torch.Tensor] = {}
        # Smallest key position per windowed layer (host int): while the next query is within
        # the window of every key, no mask is built (nor read back from the device).
        self._kmin: dict[int, int] = {}
        spare = max(1, int(spare))
        for k, v in zip(K, V):
            kb = k.new_empty((k.shape[0], k.shape[1] + spare, k.shape[2]))
            vb = v.new_empty((v.shape[0], v.shape[1] + spare, v.shape[2]))
            kb[:, : k.shape[1]] = k
            vb[:, : v.shape[1]] = v
            self._k.append(kb)
            self._v.append(vb)
        for layer, p in key_positions.items():
            n = self.n[layer]
            if torch.equal(p, torch.arange(self.pos - n, self.pos, device=p.device).expand_as(p)):
                continue  # consecutive positions: the window is a suffix of the rows (``write``)
            pb = torch.empty((p.shape[0], n + spare), dtype=torch.long, device=self._k[layer].device)
            pb[:, :n] = p
            self._kpos[layer] = pb
            self._kmin[layer] = int(p.min()) if p.numel() else self.pos

    @classmethod
    def from_stepper(cls, arch: Arch, stepper, spare: int = MIN_SPARE_ROWS) -> DecodeCache | None:
        """Take a prefilled request's cache out of its stepper (``KVRag.prefill``/``_fuse``),
        or None when the request must keep its own stepper: a policy that selects rows per
        decode step (``policy.decode_select``: A2ATS' top-k reads) decodes unbatched.

        An ``HFStepper``'s cache holds its rows in position order, up to the next token (the
        layers transformers windows, after a full prefill of a sliding-window model, keep only
        the last of them)."""
        if isinstance(stepper, HFStepper):
            K, V = [], []
            for layer in stepper.cache.layers:
                keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                if keys is None or values is None:  # a layer kind with no K/V rows (linear attention)
                    return None
                K.append(keys[0])
                V.append(values[0])
            return cls(arch, K, V, stepper.pos, {}, spare)
        if isinstance(stepper, FusedStepper) and stepper.policy.decode_select is None and not stepper._bufs:
            return cls(arch, stepper.K, stepper.V, stepper.pos, dict(stepper.kpos), spare)
        return None

    def _reserve(self, layer: int) -> None:
        """At least one spare row at ``layer``: a full buffer is replaced by one a quarter
        larger (the filled rows copied once per growth, not per token as a ``torch.cat``
        would; not doubled, since a served cache's spare rows are memory other requests need)."""
        n = self.n[layer]
        if self._k[layer].shape[1] > n:
            return
        if self.arena is not None:  # growing here would leave the arena's copy behind
            raise RuntimeError("a DecodeArena member steps only with its arena (decode_step(..., arena=))")
        cap = n + max(MIN_SPARE_ROWS, n // 4)

        def grown(old: torch.Tensor) -> torch.Tensor:
            new = old.new_empty((old.shape[0], cap, *old.shape[2:]))
            new[:, :n] = old[:, :n]
            return new

        self._k[layer], self._v[layer] = grown(self._k[layer]), grown(self._v[layer])
        if layer in self._kpos:
            self._kpos[layer] = grown(self._kpos[layer])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write the new token's k/v [Hkv, 1, D] at ``layer`` into the row past the filled
        ones (not yet counted: ``commit`` does) -> (keys, values [Hkv, M+1, D], window mask
        bool [H, 1, M+1] or None)."""
        self._reserve(layer)
        n = self.n[layer]
        self._k[layer][:, n : n + 1] = k
        self._v[layer][:, n : n + 1] = v
        w = self.arch.windows[layer]
        if w is None:
            return self._k[layer][:, : n + 1], self._v[layer][:, : n + 1], None
        if layer not in self._kpos:  # consecutive positions: the window is the last w rows
            lo = max(0, n + 1 - w)
            return self._k[layer][:, lo : n + 1], self._v[layer][:, lo : n + 1], None
        pb = self._kpos[layer]
        pb[:, n] = self.pos
        mask = None
        if self.pos - self._kmin[layer] >= w:  # some key is out of the query's window
            inside = (self.pos - pb[:, : n + 1]) < w  # [Hkv, M+1]
            group = self.arch.n_heads // self.arch.n_kv_heads
            mask = inside.repeat_interleave(group, dim=0).unsqueeze(1)
        return self._k[layer][:, : n + 1], self._v[layer][:, : n + 1], mask

    def commit(self) -> None:
        """Count the rows written by the step that just succeeded, and move to the next position."""
        for layer in range(len(self.n)):
            self.n[layer] += 1
        self.pos += 1


class DecodeArena:
    """The K/V of the requests that decode together, padded into one buffer per layer: K/V
    [S, Hkv, R, D] (``S`` slots, ``R`` rows: at least every member's filled rows + 1).

    Each member ``DecodeCache``'s buffers are views of its slot ([Hkv, R, D]), so its ``write``,
    ``commit`` and a step of it alone work as before; a step over exactly the members, in slot
    order (``members``), attends for all of them in one SDPA call. Unwritten rows are zeros:
    a masked row gets probability 0, and 0 x a non-finite value would be NaN.

    Memory: ``S x R`` rows per layer, ``R`` set by the longest member (grown by a quarter when
    a member needs a row more), ``S`` doubled when a request joins a full arena. A member that
    leaves is replaced by the last one (one copy of its rows); the buffers are freed when the
    last member leaves.

    Only for models without sliding windows or soft-capped attention (``supports``): there a
    step masks per request by position, which stays on the per-request path."""

    def __init__(self, arch: Arch):
        self.arch = arch
        self.members: list[DecodeCache] = []
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    @staticmethod
    def supports(arch: Arch) -> bool:
        return arch.attn_softcap is None and all(w is None for w in arch.windows)

    @property
    def rows(self) -> int:
        return int(self._k[0].shape[2]) if self._k else 0

    @property
    def slots(self) -> int:
        return int(self._k[0].shape[0]) if self._k else 0

    def add(self, cache: DecodeCache) -> bool:
        """Take ``cache`` into a slot (its rows copied once; its buffers become views), or
        False when it cannot join: the model is not supported, or its dtype or device differs
        from the members'. A cache that does not join decodes on the per-request path."""
        if not self.supports(self.arch) or cache._kpos or cache in self.members:
            return False
        k0 = cache._k[0]
        if self._k and (k0.dtype != self._k[0].dtype or k0.device != self._k[0].device):
            return False
        if self._adopt(cache):
            return True
        need = max(int(k.shape[1]) for k in cache._k)
        have = self.slots
        # Slots double when full (1, 2, 4, 8...): a burst of joins copies the members a few
        # times, not once per join.
        slots = have if len(self.members) < have else max(1, 2 * have)
        self._resize(slots, max(self.rows, need), k0)
        slot = len(self.members)
        for layer, n in enumerate(cache.n):
            self._k[layer][slot, :, :n] = cache._k[layer][:, :n]
            self._v[layer][slot, :, :n] = cache._v[layer][:, :n]
        self.members.append(cache)
        self._bind(slot)
        return True

    def _adopt(self, cache: DecodeCache) -> bool:
        """Into an empty arena, a cache whose buffers are alike at every layer becomes slot 0
        as it is: its buffers [Hkv, R, D] are the arena's [1, Hkv, R, D], nothing copied (a
        prompt's whole K/V: ~190 MB at 4k tokens of SmolLM2 in float32, tens of ms before the
        second token of a one-request decode). False where it cannot (members already, or
        buffers of unlike shapes, strides or dtypes): ``add`` then copies."""
        if self.members or cache.arena is not None:
            return False
        first = cache._k[0]
        bufs = cache._k + cache._v
        if any(b.shape != first.shape or b.dtype != first.dtype or not b.is_contiguous() for b in bufs):
            return False
        for layer, n in enumerate(cache.n):
            # The arena's rows past a member's are zeros (a masked row x a non-finite value is NaN).
            cache._k[layer][:, n:].zero_()
            cache._v[layer][:, n:].zero_()
        self._k = [k.unsqueeze(0) for k in cache._k]
        self._v = [v.unsqueeze(0) for v in cache._v]
        self.members.append(cache)
        self._bind(0)
        return True

    def remove(self, cache: DecodeCache) -> None:
        """Drop ``cache`` (no-op if it is not a member); the last member moves into its slot.
        The removed cache's views then show another request's rows: it must not step again."""
        if cache not in self.members:
            return
        slot, last = self.members.index(cache), len(self.members) - 1
        if slot != last:
            moved = self.members[last]
            for layer, n in enumerate(moved.n):
                self._k[layer][slot, :, :n] = self._k[layer][last, :, :n]
                self._v[layer][slot, :, :n] = self._v[layer][last, :, :n]
            self.members[slot] = moved
            self._bind(slot)
        self.members.pop()
        cache._k, cache._v, cache.arena = [], [], None  # its rows are gone: any further step fails loudly
        if not self.members:
            self._k, self._v = [], []

    def reserve(self) -> None:
        """Two free rows past every member's filled ones at every layer: the step writes the
        first, and the second keeps the keys a step reads a strict prefix of the buffer, so
        the compiled step (``kvrag.query.compiled``) never meets the one length at which its
        slice would be the whole buffer (a graph of its own)."""
        if not self.members:
            return
        top = max(n for c in self.members for n in c.n)
        if top + 2 > self.rows:
            self._resize(len(self.members), top + max(MIN_SPARE_ROWS, top // 4), self._k[0][0])

    def _bind(self, slot: int) -> None:
        cache = self.members[slot]
        cache._k = [k[slot] for k in self._k]
        cache._v = [v[slot] for v in self._v]
        cache.arena = self

    def _resize(self, slots: int, rows: int, like: torch.Tensor) -> None:
        """Buffers of at least ``slots`` x ``rows`` (members' filled rows copied over); ``like``
        [Hkv, M, D] gives the head count, head dim, dtype and device."""
        have = self.slots
        if self._k and slots <= have and rows <= self.rows:
            return
        slots, rows = max(slots, have), max(rows, self.rows)
        hkv, d = like.shape[0], like.shape[-1]
        new_k, new_v = [], []
        for layer in range(self.arch.n_layers):
            kb = torch.zeros((slots, hkv, rows, d), dtype=like.dtype, device=like.device)
            vb = torch.zeros_like(kb)
            for slot, c in enumerate(self.members):
                n = c.n[layer]
                kb[slot, :, :n] = self._k[layer][slot, :, :n]
                vb[slot, :, :n] = self._v[layer][slot, :, :n]
            new_k.append(kb)
            new_v.append(vb)
        self._k, self._v = new_k, new_v
        for slot in range(len(self.members)):
            self._bind(slot)

    def step_plan(self) -> list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]]:
        """Per layer, what a step of the members needs: (slot indices long [B], the rows the new
        k/v go to long [B] = each member's filled rows there, keys read ``top``, key-padding mask
        bool [B, 1, 1, top] or None where every member has as many rows). Built on the host from
        the members' counts, once per distinct count (layers alike share one entry)."""
        dev = self._k[0].device
        b = len(self.members)
        slots = torch.arange(b, device=dev)
        memo: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]] = {}
        plan = []
        for lens in zip(*(c.n for c in self.members)):
            if lens not in memo:
                n = torch.tensor(lens, dtype=torch.long, device=dev)
                top = max(lens) + 1
                mask = None
                if min(lens) != max(lens):  # lengths differ: hide each slot's rows past its own
                    mask = (torch.arange(top, device=dev)[None, :] <= n[:, None]).view(b, 1, 1, top)
                memo[lens] = (slots, n, top, mask)
            plan.append(memo[lens])
        return plan

    def step_attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None],
    ) -> torch.Tensor:
        """Write the members' new k/v [Hkv, B, D] where ``plan`` (``step_plan()[layer]``) says
        and attend: q [H, B, D] -> [B, H*D]."""
        slots, n, top, mask = plan
        b = q.shape[1]
        K, V = self._k[layer], self._v[layer]
        K[slots, :, n] = k.transpose(0, 1).to(K.dtype)
        V[slots, :, n] = v.transpose(0, 1).to(V.dtype)
        keys, vals = K[:b, :, :top].to(q.dtype), V[:b, :, :top].to(q.dtype)
        rows = q.transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        # A key-padding mask with grouped heads: CUDA's fused kernels take it only without GQA
        # (``Arch.grouped_mode``). Folded, each request's g query heads of a KV head are g rows
        # of that head, and the mask [B, 1, 1, top] broadcasts over them: no copy.
        mode = self.arch.grouped_mode(q, keys[0]) if mask is not None else "native"
        if mode == "fold":
            rows = rows.reshape(b, keys.shape[1], -1, q.shape[-1])  # [B, Hkv, g, D]
        elif mode == "expand":
            keys, vals = self.arch.per_query_head(keys, 1), self.arch.per_query_head(vals, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            rows, keys, vals, attn_mask=mask, scale=self.arch.scaling, enable_gqa=rows.shape[1] != keys.shape[1]
        )  # [B, H, 1, D] or folded [B, Hkv, g, D]: the same order of heads
        return out.reshape(b, -1)


@torch.no_grad()
def decode_step(
    arch: Arch,
    caches: Sequence[DecodeCache],
    token_ids: Sequence[int],
    arena: DecodeArena | None = None,
    compiled: CompiledStep | None = None,
) -> torch.Tensor:
    """Feed one token per request -> next-token logits [B, V] (float32).

    ``token_ids[i]`` is the token request ``i`` just produced (at ``caches[i].pos``). Token-wise
    work runs on [B, E] rows; attention runs per request over its own cache, windowed by key
    position on sliding-window layers -- or, when ``caches`` are exactly ``arena``'s members in
    slot order, in one call over the arena, through ``compiled`` (the whole step as one graph)
    when it is given and supports the model. The caches advance only when the whole step
    succeeded."""
    if len(caches) != len(token_ids) or not caches:
        raise ValueError(f"decode_step needs one token per cache, got {len(token_ids)} for {len(caches)}")
    pooled = (
        arena is not None and len(caches) == len(arena.members) and all(c is m for c, m in zip(caches, arena.members))
    )
    plan = None
    compiled_step = pooled and compiled is not None and compiled.supports(arch)
    if arena is not None:
        arena.reserve()  # also before a step of some members alone: a member's rows never move out
        if pooled and not compiled_step:
            plan = arena.step_plan()
    dev = arch.device
    toks = torch.tensor(list(token_ids), dtype=torch.long)
    positions = torch.tensor([c.pos for c in caches], dtype=torch.long)
    if compiled_step and arena is not None and compiled is not None:
        rows = [c.n for c in caches]
        top = max(max(n) for n in rows) + 1
        filled = torch.tensor(rows, dtype=torch.long).T.contiguous()  # [L, B]
        logits = compiled(toks.to(dev), positions.to(dev), arena._k, arena._v, filled.to(dev), top)
        for c in caches:
            c.commit()
        return logits
    hidden = arch.embed(toks)  # [B, E]
    if arch.length_dependent_rope and len(caches) > 1:
        # LongRoPE / dynamic NTK pick frequencies from the sequence length, inferred from the
        # largest position of the call: each request's own row, as its lone step would get.
        parts = [arch.cos_sin(positions[i : i + 1]) for i in range(len(caches))]
        cs = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    else:
        cs = arch.cos_sin(positions.to(dev))
    for layer in range(arch.n_layers):
        q, k, v, _ = arch.qkv(layer, hidden, cs)  # q [H, B, D], k/v [Hkv, B, D]
        if plan is not None and arena is not None:
            hidden = arch.finish_layer(layer, hidden, arena.step_attention(layer, q, k, v, plan[layer]))
            continue
        outs = []
        for i, c in enumerate(caches):
            keys, vals, mask = c.write(layer, k[:, i : i + 1], v[:, i : i + 1])
            outs.append(arch.attention(q[:, i : i + 1], keys, vals, mask))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, H*D]
        hidden = arch.finish_layer(layer, hidden, attn)
    logits = arch.logits(hidden)
    for c in caches:
        c.commit()
    return logits


def warm_up(arch: Arch, compiled: CompiledStep) -> float:
    """Build ``compiled``'s graphs (one request, several) now, on dummy arenas of a few rows,
    so no request waits for a compile -> the seconds it took (~0 when they were built)."""
    t0 = time.perf_counter()
    for b in (1, 2):
        arena = DecodeArena(arch)
        shape = (arch.n_kv_heads, 4, arch.head_dim)
        for _ in range(b):
            zeros = [torch.zeros(shape, dtype=arch.dtype, device=arch.device) for _ in range(arch.n_layers)]
            arena.add(DecodeCache(arch, zeros, zeros, 4, {}, spare=4))
        decode_step(arch, list(arena.members), [0] * b, arena, compiled)
    return time.perf_counter() - t0
