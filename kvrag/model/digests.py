"""The digests a model fingerprint is made of: weight files (memoized in
``<home>/digests.json``), an in-memory state_dict, the tokenizer's definition and the config
fields that change what the model computes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvrag.errors import ModelLoadError
from kvrag.paths import default_home

log = logging.getLogger("kvrag")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def sha256_file(path: str | os.PathLike, block: int = 8 << 20) -> str:
    """sha256 hex of a file's bytes, read in ``block``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
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
    digest = sha256_file(p)
    # Drop stale entries for the same path (the file changed) so the sidecar stays small.
    table = {k: v for k, v in table.items() if not k.startswith(f"{p}|")}
    table[key] = digest
    try:
        atomic_write_text(sidecar, json.dumps(table, indent=0, sort_keys=True))
    except OSError as e:  # read-only cache dir: still correct, only slower next time
        log.warning("could not record the digest of %s in %s: %s", p, sidecar, e)
    return digest


def dir_weights_digest(directory: str | os.PathLike, cache_dir=None) -> str:
    """Digest over every weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``) at
    the top of an HF model directory: sha256 of (file name, file sha256) pairs, sorted."""
    d = Path(directory)
    files = sorted(f for f in d.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise ModelLoadError(f"no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) in model directory {d}")
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


def cache_format_version() -> Any:
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


def json_default(o):
    if isinstance(o, torch.dtype):
        return str(o)
    return repr(o)
