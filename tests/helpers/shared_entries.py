"""Chunk entries for the shared-tier tests (tests/integration/test_shared_store.py,
test_redis_faults.py): seeded random K/V in float16 with a policy extra, and their equality."""

from __future__ import annotations

import torch

from kvrag.store import ChunkEntry, make_key

FP = "fp-shared-test"


def entry(seed: int, t: int = 7, fp: str = FP, text: str | None = None) -> tuple[str, ChunkEntry]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (t,), generator=g)
    k = torch.randn(2, 2, t, 8, generator=g).half()
    e = ChunkEntry(
        fp,
        text or f"chunk {seed}",
        ids,
        k,
        torch.randn(2, 2, t, 8, generator=g).half(),
        {"x.codes": torch.arange(t, dtype=torch.int16).view(1, 1, t).expand(2, 2, t).contiguous()},
    )
    return make_key(fp, ids), e


def same(a: ChunkEntry, b: ChunkEntry) -> bool:
    return (
        a.text == b.text
        and a.fingerprint == b.fingerprint
        and torch.equal(a.token_ids, b.token_ids)
        and torch.equal(a.keys, b.keys)
        and torch.equal(a.values, b.values)
        and a.extras.keys() == b.extras.keys()
        and all(torch.equal(a.extras[n], b.extras[n]) for n in a.extras)
    )
