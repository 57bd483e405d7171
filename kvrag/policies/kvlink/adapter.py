"""KVLink adapters on disk: where they live, loading one, and applying it to a model.

Adapter directory (``$KVRAG_HOME/kvlink/<model key>/`` by default, else the one shipped in
``kvrag/assets/kvlink/<model key>/``)::

    kvlink.json                   what was trained, on what, by which command; the losses
    link_embeddings.safetensors   "links": [max_docs, K, E] float32
    adapter_model.safetensors     LoRA weights (peft format), absent for links-only adapters
    adapter_config.json           peft LoraConfig

A LoRA adapter changes every K/V the model computes, so :func:`apply_adapter` merges it into a
*copy* of the model whose fingerprint differs from the base model's: chunks cached by the base
model are then misses, never wrong hits. Training (``kvrag.policies.kvlink.train``) writes
these directories with :func:`save_adapter`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrag.errors import KVRagError
from kvrag.model import ModelHandle
from kvrag.model.digests import sha256_file
from kvrag.paths import default_home
from kvrag.policies.kvlink.policy import ADAPTER_ATTR

log = logging.getLogger("kvrag.kvlink")

FORMAT_VERSION = 1
META_FILE = "kvlink.json"
LINKS_FILE = "link_embeddings.safetensors"
LORA_FILE = "adapter_model.safetensors"  # peft's file names, so PeftModel.from_pretrained reads them
LORA_CONFIG = "adapter_config.json"
ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets" / "kvlink"


class KVLinkError(KVRagError, ValueError):
    """A KVLink adapter or training input is unusable (missing, wrong model, bad data, bad option)."""


# ---- where adapters live ---------------------------------------------------------------
def adapter_key(handle: ModelHandle) -> str:
    """The model identity an adapter belongs to: sha256 of (architecture, weight digest,
    tokenizer digest).

    Narrower than ``handle.fingerprint`` on purpose: the fingerprint also covers the compute
    dtype and kvrag's cache-format version, neither of which changes what a LoRA delta or a
    link embedding means; keying by it would orphan every adapter (including one shipped in
    the package) on a cache-format bump or when loading in bfloat16."""
    parts = handle.fingerprint_parts
    blob = json.dumps(
        {"arch": parts["arch"], "weights": parts["weights"], "tokenizer": parts["tokenizer"]},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def default_adapter_dirs(handle: ModelHandle) -> list[Path]:
    """Search order for ``adapter="auto"``: ``$KVRAG_HOME/kvlink/<key>/`` (what
    ``kvrag train kvlink`` writes by default), then the package's ``kvrag/assets/kvlink/<key>/``."""
    key = adapter_key(handle)
    return [default_home() / "kvlink" / key, ASSETS_DIR / key]


def find_adapter(handle: ModelHandle) -> Path | None:
    """The first default directory holding an adapter for ``handle``'s model, or None."""
    for d in default_adapter_dirs(handle):
        if (d / META_FILE).is_file():
            return d
    return None


def default_adapter(handle: ModelHandle, allow_lora: bool = False) -> KVLinkAdapter | None:
    """The adapter :func:`find_adapter` finds for ``handle``, or None: none found, one with
    LoRA weights while ``allow_lora`` is False (LoRA changes the model for every policy, so
    only a caller that runs KVLink asks for it), the model already carries one, or it cannot be
    read (logged, not raised: the caller did not name it)."""
    if getattr(handle.model, ADAPTER_ATTR, None) is not None:
        return None
    path = find_adapter(handle)
    if path is None:
        return None
    try:
        ad = load_adapter(path)
    except KVLinkError as e:
        log.warning("ignoring the KVLink adapter in %s: %s", path, e)
        return None
    if (ad.has_lora and not allow_lora) or ad.meta.get("base_key") != adapter_key(handle):
        return None
    if ad.links.shape[2] != handle.model.config.hidden_size:
        log.warning(
            "ignoring the KVLink adapter in %s: link width %d != hidden size %d",
            path,
            ad.links.shape[2],
            handle.model.config.hidden_size,
        )
        return None
    return ad


# ---- the adapter ---------------------------------------------------------------------
@dataclass
class KVLinkAdapter:
    """A loaded adapter: link embeddings ``links`` [max_docs, K, E] (float32), its metadata,
    and the digest of its LoRA weights (None for a links-only adapter)."""

    links: torch.Tensor
    meta: dict
    path: Path | None = None
    lora_digest: str | None = None

    @property
    def link_tokens(self) -> int:
        return int(self.links.shape[1])

    @property
    def max_docs(self) -> int:
        return int(self.links.shape[0])

    @property
    def has_lora(self) -> bool:
        return self.lora_digest is not None

    def links_for(self, doc_index: int) -> torch.Tensor:
        """[K, E] link embeddings after the ``doc_index``-th (0-based) cached document; indices
        past the table reuse its last row (they were never trained on their own)."""
        return self.links[min(int(doc_index), self.max_docs - 1)]


def load_adapter(path: str | os.PathLike) -> KVLinkAdapter:
    """Read an adapter directory (see the module docstring); raises KVLinkError if incomplete."""
    from safetensors.torch import load_file

    d = Path(path).expanduser()
    meta_path = d / META_FILE
    if not meta_path.is_file():
        raise KVLinkError(
            f"{d} is not a KVLink adapter directory (no {META_FILE}); create one with `kvrag train kvlink`"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise KVLinkError(f"{meta_path} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise KVLinkError(
            f"{meta_path}: unsupported KVLink adapter format "
            f"{meta.get('format') if isinstance(meta, dict) else meta!r} "
            f"(this kvrag reads format {FORMAT_VERSION})"
        )
    if not (d / LINKS_FILE).is_file():
        raise KVLinkError(f"KVLink adapter {d} lacks {LINKS_FILE}")
    links = load_file(str(d / LINKS_FILE)).get("links")
    if links is None or links.dim() != 3 or links.shape[0] < 1:
        raise KVLinkError(
            f"{d / LINKS_FILE} must hold 'links' of shape [max_docs >= 1, K, E], got "
            f"{None if links is None else tuple(links.shape)}"
        )
    lora_digest = None
    if meta.get("lora") is not None:
        for name in (LORA_FILE, LORA_CONFIG):
            if not (d / name).is_file():
                raise KVLinkError(f"KVLink adapter {d} declares LoRA weights but lacks {name}")
        # The digest names the merged weights in the adapted model's fingerprint.
        lora_digest = hashlib.sha256((sha256_file(d / LORA_FILE) + sha256_file(d / LORA_CONFIG)).encode()).hexdigest()
    # Rows past those training reached are their initial value (the mean embedding), which the
    # fine-tuned model never saw after a document: serve the last trained row there instead
    # (``links_for``). Adapters from before ``trained_rows`` was recorded trained at most
    # ``config.docs`` documents per sample.
    trained = meta.get("trained_rows")
    if trained is None:
        trained = (meta.get("config") or {}).get("docs")
    if isinstance(trained, int) and not isinstance(trained, bool) and 1 <= trained < links.shape[0]:
        links = links[:trained]
    return KVLinkAdapter(links=links.float(), meta=meta, path=d, lora_digest=lora_digest)


def apply_adapter(handle: ModelHandle, adapter: str | os.PathLike | KVLinkAdapter = "auto") -> ModelHandle:
    """A ``ModelHandle`` whose model carries the KVLink ``adapter`` (``"auto"``: look it up in
    :func:`default_adapter_dirs`).

    LoRA adapters are merged into a deep copy of the model (``handle`` is left untouched) and
    the copy's fingerprint covers the LoRA digest, so its chunk caches are its own. A
    links-only adapter shares the base weights (shallow copy) and keeps the base fingerprint:
    its chunks are the base model's chunks."""
    if isinstance(adapter, KVLinkAdapter):
        ad = adapter
    elif isinstance(adapter, str) and adapter == "auto":
        path = find_adapter(handle)
        if path is None:
            dirs = ", ".join(str(p) for p in default_adapter_dirs(handle))
            raise KVLinkError(
                f"no KVLink adapter for this model (looked in {dirs}); train one with `kvrag train kvlink`"
            )
        ad = load_adapter(path)
    else:
        ad = load_adapter(adapter)
    if getattr(handle.model, ADAPTER_ATTR, None) is not None:
        raise KVLinkError("this model already carries a KVLink adapter; apply adapters to the base model")
    check_fits(ad, handle)
    base_weights = handle.fingerprint_parts["weights"]
    if ad.has_lora:
        from peft import PeftModel

        model = copy.deepcopy(handle.model)
        with warnings.catch_warnings():
            # peft calls a transformers API deprecated in v5 (is_gradient_checkpointing): not
            # the user's concern, and printed at every adapted model load.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = PeftModel.from_pretrained(model, str(ad.path), is_trainable=False).merge_and_unload()
        weights = hashlib.sha256(f"{base_weights}|kvlink-lora|{ad.lora_digest}".encode()).hexdigest()
    else:
        # A shallow copy shares every parameter and submodule but has its own attribute
        # dict, so the adapter attribute below does not leak into the caller's model.
        model = copy.copy(handle.model)
        weights = base_weights
    setattr(model, ADAPTER_ATTR, ad)
    return ModelHandle(
        model,
        handle.tokenizer,
        weight_digest=weights,
        source=handle.source,
        load_info={**handle.load_info, "kvlink_adapter": str(ad.path), "base_weights": base_weights},
    )


def check_fits(ad: KVLinkAdapter, handle: ModelHandle) -> None:
    """Raise KVLinkError unless ``ad`` was trained for ``handle``'s model: its key (weights,
    architecture, tokenizer) and hidden size."""
    key = adapter_key(handle)
    if ad.meta.get("base_key") != key:
        raise KVLinkError(
            f"KVLink adapter {ad.path} was trained for model key {str(ad.meta.get('base_key'))[:16]}…, "
            f"not this model ({key[:16]}…)"
        )
    e = handle.model.config.hidden_size
    if ad.links.shape[2] != e:
        raise KVLinkError(f"adapter link embeddings have width {ad.links.shape[2]}, the model's hidden size is {e}")


def save_adapter(out_dir: Path, links: torch.Tensor, peft_model, meta: dict) -> None:
    """Write the adapter files; ``kvlink.json`` last, so a directory without it (a crash
    mid-save) is never taken for a complete adapter."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META_FILE).unlink(missing_ok=True)
    save_file({"links": links.float().cpu().contiguous()}, str(out_dir / LINKS_FILE))
    if peft_model is not None:
        from peft import get_peft_model_state_dict

        state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}
        save_file(state, str(out_dir / LORA_FILE))
        peft_model.peft_config["default"].save_pretrained(str(out_dir))
    else:
        for name in (LORA_FILE, LORA_CONFIG):
            (out_dir / name).unlink(missing_ok=True)
    tmp = out_dir / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, out_dir / META_FILE)


def adapt_model(
    handle: ModelHandle, kvlink_adapter: str | os.PathLike | KVLinkAdapter, policy_name: str
) -> ModelHandle:
    """``KVRag(kvlink_adapter=...)`` -> the model a KVRag runs. ``"default"``: the adapter found
    for this model (``find_adapter``) when it applies without surprise -- a links-only adapter
    always (it changes no weight, fingerprint or other policy), one with LoRA weights only for
    a KVRag whose policy is ``"kvlink"``; ``"links"``: links-only adapters only; ``"auto"``, a
    directory or a loaded ``KVLinkAdapter``: that adapter, whatever it holds. A LoRA adapter may
    change every K/V: the adapted model is a copy with its own fingerprint."""
    carried = getattr(handle.model, ADAPTER_ATTR, None)
    if carried is not None and carried.has_lora and policy_name != "kvlink":
        # Another KVRag's ``handle`` is the model it adapted: the LoRA is merged in.
        log.warning(
            "this model carries a KVLink adapter with LoRA weights (another KVRag's handle?): "
            "policy %s runs on the adapted weights; build the KVRag on the base model "
            "(ModelHandle.load) to run it on the model's own",
            policy_name,
        )
    if isinstance(kvlink_adapter, str) and kvlink_adapter in ("default", "links"):
        found = default_adapter(handle, allow_lora=kvlink_adapter == "default" and policy_name == "kvlink")
        return handle if found is None else apply_adapter(handle, found)
    return apply_adapter(handle, kvlink_adapter)
