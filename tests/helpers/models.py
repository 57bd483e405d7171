"""Helpers of the ModelHandle tests (unit and real-model): a handle's logits, what changed its fingerprint."""

import torch

from kvrag.model import ModelHandle


def model_logits(handle: ModelHandle, ids: list[int]) -> torch.Tensor:
    """The model's logits [len(ids), V] for one sequence of token ids."""
    with torch.no_grad():
        return handle.model(torch.tensor([ids], device=handle.device)).logits[0]


def differing_parts(a: ModelHandle, b: ModelHandle) -> set:
    """The names of the fingerprint parts (weights, tokenizer, dtype, ...) in which a and b differ."""
    return {k for k in a.fingerprint_parts if a.fingerprint_parts[k] != b.fingerprint_parts[k]}


def longrope(original_max: int) -> dict:
    """A tiny llama's config overrides for LongRoPE: rotary frequencies that depend on the
    sequence length (short factors up to ``original_max`` positions, long factors past them)."""
    return {
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": original_max,
            "short_factor": [1.0] * 8,
            "long_factor": [1.0 + 0.5 * i for i in range(8)],
        },
    }


#: The batching tests' LongRoPE: long factors past 64 positions.
LONGROPE = longrope(64)
