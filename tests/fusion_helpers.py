"""Shared helpers for engine-level tests: tiny random-weight models and cached pieces."""
from types import SimpleNamespace

import torch
import transformers

from kvrag.chunk import compute_chunk_kv
from kvrag.fusion import CACHED, PLAIN, Piece

CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def tiny(model_type="llama", seed=0):
    torch.manual_seed(seed)
    cfg = CONFIGS[model_type](
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.2, tie_word_embeddings=False, head_dim=16,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
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
            out.append(Piece(t, CACHED, entry=SimpleNamespace(keys=k, values=v, token_ids=t)))
        else:
            out.append(Piece(t, PLAIN))
    return out


def rand_ids(n, g):
    return torch.randint(3, 512, (n,), generator=g).tolist()
