"""Family support in the architecture adapter (kvrag/arch.py) beyond what the per-family
invariant tests (test_fusion, test_engine, the policy tests over helpers.fusion.CONFIGS)
show: the per-layer-type RoPE tables of Gemma 3, and the refusal of what the adapter does not
know -- an unknown family, an unknown module in a layer --, and Phi-4-mini's partial rotary."""

import pytest
import torch
import transformers
from helpers.fusion import tiny

from kvrag.arch import Arch
from kvrag.errors import ModelLoadError
from kvrag.model import ModelHandle
from kvrag.testing import smollm2_tokenizer


def test_gemma3_local_and_global_layers_rotate_with_their_own_base():
    arch = Arch(tiny("gemma3"))
    assert arch.rope_kinds == ["full_attention", "sliding_attention"]
    assert arch.rope_index == [1, 0, 1, 0]
    assert arch.windows == [8, None, 8, None]
    cos, sin = arch.cos_sin(torch.arange(5, 9))
    assert cos.shape == (4, 2, 16)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    local, glob = arch.rotate(x, None, (cos, sin), layer=0), arch.rotate(x, None, (cos, sin), layer=1)
    # Base 10k vs 1M: the lowest frequencies differ, the highest (theta^0 = 1) agree.
    assert not torch.allclose(local, glob, atol=1e-3)
    torch.testing.assert_close(local[..., 0], glob[..., 0])
    with pytest.raises(ValueError, match="one RoPE table per layer type; pass layer="):
        arch.rotate(x, torch.arange(5, 9))


def test_a_model_family_kvrag_does_not_know_is_refused_by_name():
    # OLMo (1): a close relative of OLMo 2 with another norm (a non-RMS LayerNorm).
    cfg = transformers.OlmoConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="model_type 'olmo' is not supported"):
        Arch(model)
    with pytest.raises(ModelLoadError, match="model_type 'olmo'.* is not supported"):
        ModelHandle.from_objects(model, smollm2_tokenizer())


def test_a_layer_with_a_module_the_step_does_not_know_is_refused():
    model = tiny("llama")
    model.model.layers[2].self_attn.gate = torch.nn.Linear(4, 4)  # e.g. a gated-attention variant
    with pytest.raises(ValueError, match=r"layer 2 has modules .*\(gate\)"):
        Arch(model)


def test_partial_rotary_passes_the_other_dims_through():
    # Phi-4-mini: 12 of 16 dims rotate (with LongRoPE's attention factor); 4 pass through.
    arch = Arch(tiny("phi4mini"))
    assert (arch.rot_dim, arch.head_dim) == (12, 16) and arch.rope_gain > 1.05
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(3, 7)
    y = arch.rotate(x, pos, layer=0)
    torch.testing.assert_close(y[..., 12:], x[..., 12:])
    assert not torch.allclose(y[..., :12], x[..., :12])
    torch.testing.assert_close(arch.unrotate(y, pos, 0), x, atol=1e-5, rtol=1e-5)
    into = torch.empty_like(x)
    torch.testing.assert_close(arch.rotate(x, pos, out=into, layer=0), y)


def test_bidirectional_gemma3_is_refused():
    model = tiny("gemma3")
    model.config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Arch(model)


def test_gemma_link_token_is_the_mean_input_embedding():
    # KVLink's untrained link token stands for an average input: on Gemma an input embedding is
    # the matrix row times sqrt(hidden) (Granite: times embedding_multiplier).
    from kvrag.policies.kvlink.policy import mean_embedding

    for name, scale in (("gemma3", 64**0.5), ("granite", 3.0), ("llama", 1.0)):
        arch = Arch(tiny(name))
        assert arch.input_scale() == pytest.approx(scale, rel=1e-6)
        every = arch.embed(torch.arange(512)).float().mean(0)
        torch.testing.assert_close(mean_embedding(arch), every, atol=1e-5, rtol=1e-5)
