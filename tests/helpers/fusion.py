"""Shared helpers for engine-level tests: tiny random-weight models and cached pieces."""

import torch
import transformers

from helpers.models import longrope
from kvrag.chunk import compute_chunk_kv
from kvrag.layout.state import CACHED, PLAIN, Piece
from kvrag.store.base import ChunkEntry
from kvrag.testing import FAMILY_DEFAULTS, _config_class, attn_implementation

# name -> (model_type, extra config): every family (config classes from kvrag.testing), plus
# the per-layer attention variants the engine must honour like the model's own forward does:
# a sliding window on every layer (Mistral-7B-v0.1), on the upper layers only (Qwen2's max_window_layers), and SmolLM3's
# NoPE layers (every 4th layer without RoPE; with 4 layers, layer 3).
CONFIGS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "smollm3": ("smollm3", {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    # YaRN scales cos/sin by an attention factor (~1.14 here): undoing a rotation must divide it out.
    "llama-yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "rope_theta": 10000.0,
            }
        },
    ),
    # LongRoPE switches every position to its long factors once the sequence outgrows 16 tokens:
    # tables depend on the sequence length, not only on the position.
    "llama-longrope": ("llama", longrope(16)),
    # Gemma 3: local (sliding, RoPE base 10k) and global (base 1M) layers, q/k norms, sandwich
    # norms, scaled embeddings; "-global-first" puts a global layer at layer 0, where the
    # re-rotation test reads its keys.
    "gemma3": ("gemma3_text", FAMILY_DEFAULTS["gemma3_text"]),
    "gemma3-global-first": (
        "gemma3_text",
        {
            **FAMILY_DEFAULTS["gemma3_text"],
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        },
    ),
    "gemma2": ("gemma2", FAMILY_DEFAULTS["gemma2"]),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", FAMILY_DEFAULTS["granite"]),
    "phi3": ("phi3", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Phi-4-mini: RoPE over 3/4 of each head (12 of 16 dims), LongRoPE's attention factor
    # (~1.08 here) on the rotated dims only; prompts stay under 256 tokens (short factors).
    "phi4mini": (
        "phi3",
        {
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "original_max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 256,
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [2.0] * 6,
            },
        },
    ),
}


def tiny(model_type="llama", seed=0):
    torch.manual_seed(seed)
    family, extra = CONFIGS[model_type]
    cfg = _config_class(family)(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        head_dim=16,
        **extra,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation(family)).eval()
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def pieces_for(arch, segs, anchor=()):
    """segs: list of (ids, cached?) -> Pieces with chunk K/V from the engine's chunk prefill
    (each chunk read behind ``anchor``)."""
    out = []
    for ids, cached in segs:
        t = torch.tensor(ids)
        if cached:
            k, v = compute_chunk_kv(arch, [ids], anchor)[0]
            out.append(Piece(t, CACHED, entry=ChunkEntry("test", "", t, k, v)))
        else:
            out.append(Piece(t, PLAIN))
    return out


def rand_ids(n, g):
    return torch.randint(3, 512, (n,), generator=g).tolist()


def assert_matches_hf_cache(K, V, cache, atol=1e-4, rtol=1e-4):
    """Fused K/V (per layer [Hkv, N, D]) equal the model's own cache at every layer; a
    sliding-window layer's HF cache holds only its last rows, compared with the fused tail."""
    for layer, (k, v) in enumerate(zip(K, V)):
        kept = cache.layers[layer].keys.shape[2]
        torch.testing.assert_close(k[:, -kept:], cache.layers[layer].keys[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(v[:, -kept:], cache.layers[layer].values[0], atol=atol, rtol=rtol)
