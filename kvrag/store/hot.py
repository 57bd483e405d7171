"""The hot tier: chunk entries already on the compute device, in the compute dtype.

A disk hit still costs a read, a checksum, a deserialization, a dtype conversion and (on a
GPU) a host-to-device copy. That is ~1-2 ms per MB: small next to a CPU prefill, but on a GPU
it is slower than recomputing the prompt (measured on an H100, 1B Llama, 16k tokens: 0.65 s
to load the cached KV vs 0.15 s for the full prefill). RAG traffic reuses the same popular
chunks, so a least-recently-used set of them is kept ready in memory (LMCache's CPU/GPU tier
over its disk backend does the same).

A store key names its content (model fingerprint + token ids, ``make_key``), so a
copy here never goes stale: another process evicting or clearing the disk entry does not
change what the key holds, and serving the copy gives the same answer as reading the disk.
"""

from __future__ import annotations

import os
from collections.abc import Hashable

import torch

from kvrag.checks import check_int
from kvrag.store.base import ChunkEntry
from kvrag.store.lru import ByteLRU

# "auto": a fifth of the GPU's memory (the model and the prefill's activations need the
# rest), or 1 GiB of RAM on the CPU (~40 SmolLM2 chunks of 512 tokens at float32). A host
# tier beside a GPU holds what the GPU cannot: a tenth of the machine's RAM, at least 1 GiB.
AUTO_GPU_SHARE = 0.2
AUTO_CPU_BYTES = 1 << 30
AUTO_HOST_SHARE = 0.1

#: Where the hot tier keeps its entries (``KVRag(hot_tier=...)``): on the compute device, or
#: in host RAM (page-locked beside a CUDA device) and copied to the device at each query.
HOT_TIERS = ("device", "host")


def _host_ram() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not a POSIX system that reports it
        return None


def resolve_budget(budget: int | str, device: torch.device, beside_gpu: bool = False) -> int:
    """``hot_cache`` -> bytes: an int >= 0 as is, ``"auto"`` per device (see above; ``device``
    is where the entries are kept, ``beside_gpu``: host RAM serving a GPU)."""
    if budget == "auto":
        if device.type == "cuda":
            return int(AUTO_GPU_SHARE * torch.cuda.get_device_properties(device).total_memory)
        ram = _host_ram() if beside_gpu else None
        return max(AUTO_CPU_BYTES, int(AUTO_HOST_SHARE * ram)) if ram else AUTO_CPU_BYTES
    return check_int("hot_cache (bytes, or 'auto')", budget, 0)


def hot_device(tier: str, compute: torch.device) -> tuple[torch.device, bool]:
    """(where a ``tier`` hot cache keeps its entries, whether they are page-locked) for a
    model computing on ``compute``. Page-locked host memory is what lets the copy to a GPU
    run asynchronously at full bus speed; on a CPU the two tiers are the same memory."""
    if tier not in HOT_TIERS:
        raise ValueError(f"hot_tier must be one of {', '.join(HOT_TIERS)}, got {tier!r}")
    if tier == "host" and compute.type != "cpu":
        return torch.device("cpu"), compute.type == "cuda"
    return compute, False


class HotCache(ByteLRU[ChunkEntry]):
    """Thread-safe LRU of ``ChunkEntry`` by store key, at most ``budget`` bytes of K/V.

    Entries are converted once on the way in: keys/values [L, Hkv, T, D] to ``device`` and
    ``dtype`` (what the fusion engine computes in; ``pin``: in page-locked host memory, for a
    host tier beside a GPU); token ids and extras stay as stored. A packed entry
    (``kvrag.store.kv_format``) is kept packed -- its codes and scales moved here as they are,
    a fraction of the float bytes -- and expanded as it is served (``ChunkEntry.expanded``)."""

    def __init__(self, budget: int, device: torch.device, dtype: torch.dtype, pin: bool = False):
        super().__init__(budget, self._size)
        self.device = device
        self.dtype = dtype
        self.pin = pin

    def _size(self, entry: ChunkEntry) -> int:
        """Bytes of ``entry``'s K and V once held here (in ``dtype``; a packed entry's codes and scales)."""
        if entry.packed:
            return sum(t.numel() * t.element_size() for t in (entry.keys, entry.values, *entry.scales.values()))
        return entry.keys.numel() * self.dtype.itemsize * 2

    def put(self, key: Hashable, entry: ChunkEntry) -> ChunkEntry:
        """Keep ``entry`` (converted); returns the converted entry, or ``entry`` itself when it
        alone is over the budget (then nothing is kept, e.g. with budget 0)."""
        if not self.fits(entry):
            return entry
        # copy=True: a disk read's tensors are views of the blob's file mapping (or pinned
        # buffer); a kept view would hold a file descriptor and, once the blob is evicted, its
        # disk space, for as long as it stays here. non_blocking: from a pinned read the copy
        # to the GPU runs asynchronously, ordered before the kernels that use it.
        packed = entry.packed
        keys, values = (self._own_copy(t, packed) for t in (entry.keys, entry.values))
        hot = ChunkEntry(
            entry.fingerprint,
            entry.text,
            entry.token_ids.clone(),
            keys,
            values,
            {k: v.clone() for k, v in entry.extras.items()},
            entry.kv_format,
            {k: self._own_copy(v, packed) for k, v in entry.scales.items()},
        )
        super().put(key, hot)  # evicts least recently used entries down to the budget
        return hot

    def _own_copy(self, t: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """``t`` in this tier's memory and dtype (``packed``: its own dtype), in storage of its
        own (see ``put``)."""
        dtype = t.dtype if packed else self.dtype
        if self.pin:
            # Into a fresh page-locked buffer: ``pin_memory()`` of a tensor already pinned (a
            # pinned disk read) would return the read buffer itself.
            return torch.empty(t.shape, dtype=dtype, pin_memory=True).copy_(t)
        return t.to(device=self.device, dtype=dtype, non_blocking=True, copy=True)
