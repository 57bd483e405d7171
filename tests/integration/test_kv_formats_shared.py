"""Packed K/V formats (kvrag.store.kv_format) on the shared tier: a real Redis holds the same
packed blob the disk does, serves it back bit for bit, refuses it under the float fingerprint,
and the tiered store promotes it to the local disk still packed."""

from __future__ import annotations

import pytest
import torch

from kvrag.store import ChunkEntry, DiskStore, make_key
from kvrag.store.kv_format import PACKED_FORMATS, encode, format_fingerprint
from kvrag.store.redis_store import RedisStore
from kvrag.store.tiered import TieredStore

FP = "fp-shared-formats"


def packed(name: str, seed: int = 0, t: int = 80) -> tuple[str, ChunkEntry, int]:
    """(key, a packed entry of ``name``, the bytes its K/V take in float16)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 2, t, 64, generator=g), torch.randn(2, 2, t, 64, generator=g)
    (kc, ks), (vc, vs) = encode(k, name, "keys"), encode(v, name, "values")
    scales = {**{f"keys.{n}": x for n, x in ks.items()}, **{f"values.{n}": x for n, x in vs.items()}}
    ids = torch.randint(0, 1000, (t,), generator=g)
    fp = format_fingerprint(FP, name)
    return make_key(fp, ids), ChunkEntry(fp, f"chunk {seed}", ids, kc, vc, {}, name, scales), 2 * k.numel() * 2


def same_packed(a: ChunkEntry, b: ChunkEntry) -> bool:
    return (
        a.kv_format == b.kv_format
        and torch.equal(a.keys.view(torch.uint8), b.keys.view(torch.uint8))
        and torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8))
        and a.scales.keys() == b.scales.keys()
        and all(torch.equal(a.scales[n], b.scales[n]) for n in a.scales)
    )


@pytest.mark.parametrize("name", list(PACKED_FORMATS))
def test_redis_holds_and_serves_the_packed_blob(redis_url, prefix, tmp_path, name):
    key, e, float16_bytes = packed(name)
    far = RedisStore(redis_url, prefix=prefix)
    tiered = TieredStore(DiskStore(tmp_path / "near"), far)
    try:
        far.put(key, e)
        got = far.get(key, e.fingerprint)
        assert got is not None and same_packed(got, e)
        assert far.get(key, FP) is None  # never under the float fingerprint
        client = far.client
        stored = sum(int(client.strlen(k)) for k in client.scan_iter(match=prefix + "*") if client.type(k) == b"string")
        assert 0 < stored < 0.6 * float16_bytes  # Redis holds the codes, not floats
        assert same_packed(tiered.get(key, e.fingerprint), e)  # a far hit, promoted
        tiered.flush()
        assert same_packed(tiered.near.get(key, e.fingerprint), e)
    finally:
        tiered.close()
