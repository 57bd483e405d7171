"""GGUF -> safetensors, once: transformers dequantizes a GGUF at every load (~15-20 s on a small
CPU), so the converted model and tokenizer are saved under ``<home>/models/``, keyed by the
file's content digest, and later loads read that in well under a second."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import torch

from kvrag.errors import ModelLoadError

log = logging.getLogger("kvrag")

# Bump when the layout of a converted-model directory changes, so stale conversions are
# ignored instead of half-read.
CONVERSION_VERSION = 1
CONVERSION_MARKER = "kvrag_conversion.json"


def conversion_dir(root: Path, gguf_sha: str) -> Path:
    # Keyed by the file's *content* digest: a moved or copied GGUF reuses its conversion,
    # and a changed file never matches a stale one.
    return root / "models" / f"gguf-{gguf_sha[:40]}-v{CONVERSION_VERSION}"


def is_complete_conversion(d: Path) -> bool:
    return (d / CONVERSION_MARKER).is_file() and (d / "config.json").is_file()


#: GGUF ``general.architecture`` names that differ from the transformers model type they load as.
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}


def gguf_architecture(gguf: Path) -> str | None:
    """``general.architecture`` from the GGUF header (None if it cannot be read: transformers
    then reports the file)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(gguf)).fields.get("general.architecture")
        return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception:  # noqa: BLE001 - a damaged or fake file: the real reader names the problem
        return None


def convert_gguf(gguf: Path, target: Path, gguf_sha: str) -> None:
    """Dequantize ``gguf`` into an HF safetensors directory at ``target``, atomically.

    The conversion is written into a temporary sibling directory and renamed into place
    only once complete (with a marker file), so a crash or a concurrent process never
    leaves a half-written model that a later load would trust."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # An unusable cache dir (a file, read-only) fails now, before seconds of GGUF reading.
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "directory not writable", str(target.parent))
    except OSError as e:
        raise ModelLoadError(
            f"cannot store the conversion of {gguf} under {target.parent}: {e.strerror or e}; kvrag's cache dir "
            "($KVRAG_HOME, or --cache-dir / cache_dir=) must be a writable directory"
        ) from None
    from kvrag.arch import SUPPORTED_MODEL_TYPES

    # GGUF architecture names are the model types (a Mistral GGUF says "llama").
    arch = gguf_architecture(gguf)
    if arch is not None and GGUF_ARCHITECTURES.get(arch, arch) not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"GGUF file {gguf} holds a {arch!r} model, which kvrag does not support "
            f"(decoder families: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    # A process killed mid-conversion leaves a ~0.5 GB temp dir behind; one older than an
    # hour cannot belong to a live conversion (it takes seconds), so reclaim it.
    for stale in target.parent.glob(f".tmp-{target.name}-*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log.info("converting %s to safetensors in %s (once)", gguf, target)
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
            # dequantize=True: a plain dense model (float32 holds the dequantized Q4 values
            # exactly), which save_pretrained accepts; a packed GGUF model cannot be saved.
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent),
                gguf_file=gguf.name,
                local_files_only=True,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
        except Exception as e:
            raise ModelLoadError(f"could not read GGUF file {gguf}: {e}") from e
        # Any leftover quantizer state would make save_pretrained refuse the model.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / CONVERSION_MARKER).write_text(
            json.dumps({"source": str(gguf), "sha256": gguf_sha, "version": CONVERSION_VERSION}, indent=1)
        )
        del model
        try:
            os.rename(tmp, target)
        except OSError:
            if is_complete_conversion(target):  # another process won the race: use theirs
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert_or_explain(gguf: Path, target: Path, gguf_sha: str, root: Path) -> None:
    """``convert_gguf`` with a failure to write the conversion (disk full, read-only or
    vanished cache dir) turned into a ModelLoadError naming the cache dir."""
    try:
        convert_gguf(gguf, target, gguf_sha)
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise ModelLoadError(
            f"cannot store the conversion of {gguf} in kvrag's cache dir {root}: {e.strerror or e}{where}; "
            "point $KVRAG_HOME (or --cache-dir / cache_dir=) at a writable directory"
        ) from e
