"""The KVRags a benchmark measures on: the base model's, and (when the configured KVLink adapter
holds LoRA weights) the adapted model's, on which trained ``kvlink`` runs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvrag.bench.config import BenchConfig, Run

if TYPE_CHECKING:
    from kvrag.engine import KVRag
    from kvrag.model import ModelHandle


def make_rags(cfg: BenchConfig, handle: ModelHandle, cache_dir: Path, runs: list[Run]) -> tuple[KVRag, KVRag | None]:
    """(the base KVRag, the LoRA-adapted one of the trained ``kvlink`` runs or None)."""
    from kvrag.engine import KVRag
    from kvrag.policies.kvlink.adapter import KVLinkAdapter, KVLinkError, default_adapter, find_adapter, load_adapter

    adapter = cfg.kvlink_adapter
    ad: KVLinkAdapter | None = None
    if adapter == "default":
        ad = default_adapter(handle, allow_lora=True)
    elif adapter not in (None, "none", "links"):
        path = find_adapter(handle) if adapter == "auto" else adapter
        if path is None:
            raise KVLinkError(
                "--kvlink-adapter auto: no KVLink adapter for this model; train one with `kvrag train kvlink`"
            )
        ad = load_adapter(path)
    base_adapter: str | KVLinkAdapter | None
    lora: KVLinkAdapter | None
    if ad is None:
        base_adapter, lora = ("links" if adapter == "links" else None), None
    else:
        # A links-only adapter leaves the weights (and full_prefill) alone: it can ride on
        # the base KVRag. LoRA weights would change the reference too.
        base_adapter, lora = (None, ad) if ad.has_lora else (ad, None)

    def kvrag(kvlink_adapter: str | KVLinkAdapter | None, ingest_policies: list[str]) -> KVRag:
        # Every measured call names its policy; naming one here keeps the model's default
        # (which may want an adapter) from choosing which model the KVRag runs.
        return KVRag(
            handle,
            cache_dir=cache_dir,
            policy="full_prefill",
            kvlink_adapter=kvlink_adapter,
            ingest_policies=ingest_policies,
            storage_dtype=cfg.storage_dtype,
            chunk_anchor=cfg.chunk_anchor,
            hot_cache=cfg.hot_cache,
            prefix_cache=cfg.prefix_cache,
        )

    rag = kvrag(base_adapter, [r.policy for r in runs])
    kvlink_rag = None
    if lora is not None and any(r.policy == "kvlink" for r in runs):
        # Same store directory: the adapted model's fingerprint keeps its chunks apart.
        kvlink_rag = kvrag(lora, ["kvlink"])
    return rag, kvlink_rag


def add_untrained_kvlink(rag: KVRag, runs: list[Run]) -> dict | None:
    """With a KVLink adapter loaded on ``rag``'s model, ``kvlink`` runs trained: append its
    untrained variant (on the base model) to ``runs`` so the report shows what the training
    bought. Returns what the report says of the adapter (None: no adapter)."""
    from kvrag.policies.kvlink.policy import ADAPTER_ATTR

    adapter = getattr(rag.handle.model, ADAPTER_ATTR, None)
    if adapter is None:
        return None
    untrained = Run("kvlink", {"mode": "untrained"})
    if any(r.policy == "kvlink" and not r.params for r in runs) and all(r.label != untrained.label for r in runs):
        runs.append(untrained)
    return {
        "path": str(adapter.path),
        "link_tokens": adapter.link_tokens,
        "lora": adapter.has_lora,
        "steps": adapter.meta.get("steps"),
        "command": adapter.meta.get("command"),
    }


def ensure_a2ats_codebooks(rag: KVRag, runs: list[Run], say) -> dict | None:
    """A2ATS needs codebooks fitted offline for the model (``kvrag calibrate a2ats``); on a
    fresh machine fit them once here, untimed, rather than report a2ats as an error. Returns
    {path, seconds} of a calibration it ran, else None."""
    from kvrag.policies.a2ats import calibrate as cal
    from kvrag.policies.a2ats import codebook as books

    if not any(r.policy == "a2ats" and "codebook" not in r.params for r in runs):
        return None
    if books.find_codebooks(rag.arch) is not None:
        return None
    say("fitting A2ATS codebooks for this model (once; untimed; `kvrag calibrate a2ats`) ...")
    t0 = time.perf_counter()
    _, path = cal.calibrate(rag.handle)
    return {"path": str(path), "seconds": time.perf_counter() - t0}
