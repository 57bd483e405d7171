"""The footprint measurement: what stored K/V takes on disk, against its bound."""

from __future__ import annotations

import tempfile

from kvrag.bench.measure import Measure
from kvrag.bench.memory import dir_bytes


def measure_footprint(m: Measure, rag, texts: list[str]) -> None:
    """Disk bytes per 1k tokens of stored K/V in fp32 and fp16, against 2*L*Hkv*D*bytes,
    into ``m.footprint``."""
    from kvrag.engine import KVRag

    cfg = rag.handle.model.config
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tokens = sum(len(rag.chunk_ids(t)) for t in texts)
    out: dict = {"tokens": tokens, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    for dt, nbytes in (("float32", 4), ("float16", 2)):
        with tempfile.TemporaryDirectory(prefix="kvrag-footprint-") as d:
            r = KVRag(rag.handle, cache_dir=d, policy="full_prefill", storage_dtype=dt, chunk_anchor=rag.anchor)
            empty = dir_bytes(d)
            r.precompute(texts)
            used = dir_bytes(d) - empty
            blob = r.store.stats()["bytes"]
        bound = 2 * layers * kv_heads * head_dim * nbytes * 1000
        out[dt] = {
            "bytes_per_1k": used / tokens * 1000,
            "blob_bytes_per_1k": blob / tokens * 1000,
            "bound_per_1k": bound,
            "ratio": used / tokens * 1000 / bound,
        }
    m.footprint = out
