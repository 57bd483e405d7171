"""Chunk entries for the disk-store tests (tests/unit/store/):
random K/V of a given shape, put under their own key, and the blob files diskcache writes."""

from pathlib import Path

import torch

from kvrag.store import ChunkEntry, make_key

FP_A = "fingerprint-model-a"
FP_B = "fingerprint-model-b"


def make_entry(fp=FP_A, text="some chunk text", T=5, L=2, H=2, D=8, dtype=torch.float32, seed=0, extras=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50_000, (T,), generator=g)
    k = torch.randn(L, H, T, D, generator=g).to(dtype)
    v = torch.randn(L, H, T, D, generator=g).to(dtype)
    return ChunkEntry(fingerprint=fp, text=text, token_ids=ids, keys=k, values=v, extras=extras or {})


def put(store, entry):
    key = make_key(entry.fingerprint, entry.token_ids)
    store.put(key, entry)
    return key


def blob_files(directory: Path) -> list[Path]:
    # diskcache writes each value to <directory>/blobs/xx/yy/<random>.val
    return sorted((directory / "blobs").rglob("*.val"))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view: compares NaN payloads and -0.0 exactly."""
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def assert_same(a: ChunkEntry, b: ChunkEntry):
    assert (a.fingerprint, a.text) == (b.fingerprint, b.text)
    for x, y in [(a.token_ids, b.token_ids), (a.keys, b.keys), (a.values, b.values)]:
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(bits(x), bits(y))
    assert a.extras.keys() == b.extras.keys()
    for n in a.extras:
        assert a.extras[n].dtype == b.extras[n].dtype
        assert torch.equal(bits(a.extras[n]), bits(b.extras[n]))
