"""Batched decoding: one decode step for many requests, each over its own cache.

Requests in flight hold caches of different lengths (their prompts differ, and so do the
policies that filled them). A decode step runs the token-wise work of every layer — norms,
q/k/v and output projections, MLP, final norm and LM head, i.e. nearly all the weight reads —
once for the whole batch ([B, E] rows), and only the attention per request, each new query
against its own cache. No cache is padded or copied per step: each ``DecodeCache`` keeps its
K/V in a buffer with spare rows, and the step writes the new token's k/v into the next row.

The step is failure-atomic: rows are written past each cache's filled length and the length
advances only after the whole step succeeded, so a step that raises leaves every cache as it
was and can be retried with fewer requests.

Shapes: ``B`` requests in the step, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim,
``E`` hidden size, ``M`` rows in one request's cache at a layer, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrag.arch import Arch
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
        self.pos = int(next_position)
        self.n = [int(k.shape[1]) for k in K]
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._kpos: dict[int, torch.Tensor] = {}
        # Smallest key position per windowed layer (host int): while the next query is within
        # the window of every key, no mask is built (nor read back from the device).
        self._kmin: dict[int, int] = {}
        spare = max(1, int(spare))
        for layer, (k, v) in enumerate(zip(K, V)):
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


@torch.no_grad()
def decode_step(arch: Arch, caches: Sequence[DecodeCache], token_ids: Sequence[int]) -> torch.Tensor:
    """Feed one token per request -> next-token logits [B, V] (float32).

    ``token_ids[i]`` is the token request ``i`` just produced (at ``caches[i].pos``). Token-wise
    work runs on [B, E] rows; attention runs per request over its own cache, windowed by key
    position on sliding-window layers. The caches advance only when the whole step succeeded."""
    if len(caches) != len(token_ids) or not caches:
        raise ValueError(f"decode_step needs one token per cache, got {len(token_ids)} for {len(caches)}")
    dev = arch.device
    toks = torch.tensor(list(token_ids), dtype=torch.long)
    positions = torch.tensor([c.pos for c in caches], dtype=torch.long)
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
