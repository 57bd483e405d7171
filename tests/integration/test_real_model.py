"""ModelHandle on the real packaged models: the default SmolLM2 (GGUF conversion, its cache) and the
Gemma 3 270M wheel assembly."""

import importlib.util
import os

import pytest
import torch
from helpers.models import differing_parts, model_logits

import kvrag.model.digests as kd
import kvrag.model.gguf as kg
import kvrag.model.packaged as kp
from kvrag.model import ModelHandle


@pytest.fixture(scope="module")
def fresh_default(tmp_path_factory):
    """The default SmolLM2 loaded into an empty cache dir, so this load is the conversion."""
    cache = tmp_path_factory.mktemp("kvrag-home")
    return cache, ModelHandle.load(cache_dir=cache)


@pytest.mark.real
def test_default_model_converts_once_then_loads_from_cache(fresh_default, monkeypatch):
    cache, first = fresh_default
    assert first.load_info["converted"] is True
    weights_dir = first.load_info["weights_dir"]
    assert os.path.isfile(os.path.join(weights_dir, "model.safetensors"))
    assert first.source.endswith(kp.DEFAULT_GGUF_FILE)

    # A second load must neither convert the GGUF again nor re-hash it (digest sidecar).
    def boom(*a, **k):
        raise AssertionError("second load redid work that should have been cached")

    monkeypatch.setattr(kg, "convert_gguf", boom)
    monkeypatch.setattr(kd, "sha256_file", boom)
    second = ModelHandle.load(cache_dir=cache)
    assert second.load_info == {"weights_dir": weights_dir, "converted": False}
    assert second.fingerprint == first.fingerprint
    assert len(first.fingerprint) == 64

    ids = first.encode("The capital of France is")
    a, b = model_logits(first, ids), model_logits(second, ids)
    assert torch.equal(a, b)
    # The dequantized weights are a working model, not just loadable tensors.
    assert first.tokenizer.decode(a[-1].argmax()).strip() == "Paris"

    m = first.model
    assert not m.training
    assert not any(p.requires_grad for p in m.parameters())
    assert m.config._attn_implementation == "sdpa"
    assert first.dtype == torch.float32 and first.device == torch.device("cpu")
    assert first.max_context == m.config.max_position_embeddings == 8192
    assert (first.n_layers, first.n_kv_heads, first.head_dim) == (30, 3, 64)
    assert first.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 4
    assert first.prefix_ids() == []  # SmolLM2's tokenizer adds no BOS by itself


@pytest.mark.real
def test_fingerprint_changes_with_dtype(fresh_default):
    cache, fp32 = fresh_default
    bf16 = ModelHandle.load(cache_dir=cache, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert bf16.fingerprint != fp32.fingerprint
    assert differing_parts(bf16, fp32) == {"dtype"}


@pytest.mark.real  # needs the gemma3-270m wheels; writes its 240 MB GGUF twice
def test_gemma3_270m_is_assembled_once_and_a_damaged_copy_rebuilt(tmp_path):
    pkg = importlib.import_module(kp.GEMMA3_270M_PACKAGE)
    home = tmp_path / "home"
    p = kp.gemma3_270m_path(home)
    assert p == home / "models" / pkg.MODEL_NAME and kd.file_digest(p, home) == pkg.EXPECTED_SHA256
    mtime = p.stat().st_mtime_ns
    assert kp.gemma3_270m_path(home) == p and p.stat().st_mtime_ns == mtime  # not rewritten
    with open(p, "r+b") as f:  # a damaged copy (changed bytes, new mtime) is rebuilt
        f.seek(1000)
        f.write(b"\0" * 8)
    kp.gemma3_270m_path(home)
    assert kd.file_digest(p, home) == pkg.EXPECTED_SHA256
    assert not list(p.parent.glob(".tmp-*"))
