"""A model's config without its weights: enough to size its KV cache (``kvrag cache plan``).

``load_config`` reads what ``ModelHandle.load`` would read the config from, and nothing more:
an HF directory's ``config.json``; a GGUF's converted copy when kvrag has converted it, else the
GGUF's own metadata (transformers reads the header, not the tensors); a Hugging Face repo id's
``config.json`` alone (from the HF cache, or downloaded unless ``HF_HUB_OFFLINE`` is set), not
its weights. ``kv_shape`` takes the K/V shape from the same fields a ``ModelHandle``'s
``n_layers``/``n_kv_heads``/``head_dim`` are (``digests.arch_summary``), so a plan and a
loaded model never disagree on what a token costs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvrag.errors import ModelLoadError
from kvrag.model.digests import arch_summary, file_digest
from kvrag.model.gguf import conversion_dir, is_complete_conversion
from kvrag.model.hub import RepoRef, parse_repo_ref
from kvrag.model.packaged import MODEL_NAMES, resolve_model_path
from kvrag.paths import default_home


def load_config(path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> tuple[Any, str]:
    """(transformers config, where it was read from) of the model ``ModelHandle.load(path)``
    would load (``path``: an HF dir, a ``.gguf``, a name of ``MODEL_NAMES``, a repo id, or None:
    the default SmolLM2), without loading its weights. ``cache_dir``: the kvrag home (GGUF
    conversions, digests). A model type kvrag does not run is a ``ModelLoadError``, as a load's."""
    from kvrag.model.handle import check_config

    root = Path(cache_dir).expanduser() if cache_dir is not None else default_home()
    p = resolve_model_path(path, root)
    ref = parse_repo_ref(path) if isinstance(path, str) and not p.exists() else None
    if ref is not None:
        config, source = _read(_hub_config_dir(ref)), str(ref)
    elif not p.exists():
        raise ModelLoadError(
            f"model path {str(p)!r} does not exist (expected a local HF model directory, a .gguf file, "
            f"a model name ({', '.join(MODEL_NAMES)}) or a Hugging Face repo id such as 'org/name')"
        )
    elif p.is_dir():
        config, source = _read(p), str(p)
    elif p.suffix.lower() == ".gguf":
        converted = conversion_dir(root, file_digest(p, root))
        # The converted copy's config.json is read in milliseconds; the GGUF's header takes seconds.
        config = _read(converted) if is_complete_conversion(converted) else _read(p.parent, gguf_file=p.name)
        source = str(p)
    else:
        raise ModelLoadError(f"model file {str(p)!r} is not a .gguf file; pass a .gguf file or an HF model directory")
    check_config(config, where=f" of {source}")
    return config, source


def kv_shape(config) -> tuple[int, int, int]:
    """(layers L, KV heads Hkv, head dim D) of ``config``: a stored token holds keys and values
    [L, Hkv, D] (``kvrag.store.kv_format.bytes_per_token`` prices them per format)."""
    a = arch_summary(config)
    return a["num_hidden_layers"], a["num_key_value_heads"], a["head_dim"]


def _read(directory: Path, **kw):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True, **kw)
    except Exception as e:  # noqa: BLE001 - any unreadable config is the user's file to fix, said as such
        where = directory / kw["gguf_file"] if "gguf_file" in kw else directory
        raise ModelLoadError(f"could not read the model config of {where}: {e}") from e


def _hub_config_dir(ref: RepoRef) -> Path:
    """The snapshot directory holding ``ref``'s ``config.json`` (the only file fetched): from
    the Hugging Face cache, else downloaded unless ``HF_HUB_OFFLINE`` is set."""
    from huggingface_hub import constants, snapshot_download

    def snapshot(local_only: bool) -> Path | None:
        d = Path(
            snapshot_download(
                ref.repo_id, revision=ref.revision, allow_patterns=["config.json"], local_files_only=local_only
            )
        )
        return d if (d / "config.json").is_file() else None

    try:
        found = snapshot(local_only=True)
    except Exception:  # noqa: BLE001 - not in the cache: fetched below
        found = None
    if found is not None:
        return found
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(
            f"the config of Hugging Face model {str(ref)!r} is not in the Hugging Face cache, and HF_HUB_OFFLINE "
            "is set so kvrag may not download it"
        )
    try:
        found = snapshot(local_only=False)
    except Exception as e:  # noqa: BLE001 - unknown repo, gated, no network: the hub's own words
        raise ModelLoadError(f"could not fetch the config of Hugging Face model {str(ref)!r}: {e}") from e
    if found is None:
        raise ModelLoadError(f"Hugging Face model {str(ref)!r} has no config.json")
    return found
