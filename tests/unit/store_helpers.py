"""Chunk entries for the disk-store tests (tests/unit/test_store.py, test_store_hostile.py):
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
