"""Starting a KVLink training run from an adapter already trained (``TrainConfig.init``): the
adapter checked against the run's model and options, its weights loaded, and what
``kvlink.json`` records of it."""

from __future__ import annotations

from pathlib import Path

import torch

from kvrag.model import ModelHandle
from kvrag.model.digests import sha256_file
from kvrag.policies.kvlink.adapter import (
    LINKS_FILE,
    LORA_FILE,
    KVLinkAdapter,
    KVLinkError,
    check_fits,
    default_adapter_dirs,
    find_adapter,
    load_adapter,
)
from kvrag.policies.kvlink.config import TrainConfig, lora_record


def start_adapter(handle: ModelHandle, cfg: TrainConfig) -> KVLinkAdapter:
    """The adapter ``cfg.init`` names, checked against ``handle`` and ``cfg``: the same model,
    link tokens and LoRA shape (a KVLinkError names what differs)."""
    if cfg.init == "auto":
        path = find_adapter(handle)
        if path is None:
            dirs = ", ".join(str(p) for p in default_adapter_dirs(handle))
            raise KVLinkError(f"init='auto': no KVLink adapter for this model to start from (looked in {dirs})")
    else:
        path = Path(str(cfg.init)).expanduser()
    ad = load_adapter(path)
    check_fits(ad, handle)
    where = f"the adapter to start from ({ad.path})"
    if ad.link_tokens != cfg.link_tokens:
        raise KVLinkError(f"{where} has {ad.link_tokens} link tokens per document; link_tokens is {cfg.link_tokens}")
    if ad.max_docs > cfg.max_docs:
        raise KVLinkError(f"{where} has {ad.max_docs} trained link rows; max_docs must be >= {ad.max_docs}")
    lora, want = ad.meta.get("lora"), lora_record(cfg)
    have = None if lora is None else {k: lora.get(k) for k in ("rank", "alpha", "targets")}
    if have != want:
        raise KVLinkError(f"{where} has LoRA {have}; these options give {want}: pass the same LoRA options")
    return ad


def init_record(ad: KVLinkAdapter) -> dict:
    """What ``kvlink.json`` records of the adapter a run started from: where, its weights'
    digests, and its own training (its ``init`` too, so a chain of runs stays traceable)."""
    assert ad.path is not None
    m = ad.meta
    return {
        "path": str(ad.path),
        "links_sha256": sha256_file(ad.path / LINKS_FILE),
        "lora_digest": ad.lora_digest,
        "steps": m.get("steps"),
        "train_seconds": m.get("train_seconds"),
        "data_sha256": m.get("data_sha256"),
        "command": m.get("command"),
        "init": m.get("init"),
    }


def warm_start(ad: KVLinkAdapter, peft_model, links: torch.nn.Parameter) -> None:
    """Load ``ad``'s LoRA weights into ``peft_model`` and its link rows into ``links``
    [max_docs, K, E]; rows past the adapter's take its last row, the one its inference serves
    there (``KVLinkAdapter.links_for``)."""
    if peft_model is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        assert ad.path is not None
        state = load_file(str(ad.path / LORA_FILE))
        result = set_peft_model_state_dict(peft_model, state)
        # peft returns torch's load result: a LoRA weight the file lacks would stay random.
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        if missing:
            raise KVLinkError(f"the adapter to start from ({ad.path}) lacks LoRA weights: {missing[:3]}")
    with torch.no_grad():
        rows = ad.links.to(links.device, links.dtype)
        links[: rows.shape[0]] = rows
        links[rows.shape[0] :] = rows[-1]
