"""`kvrag model info` on the real default model."""

import json

import pytest

from kvrag.cli import main
from kvrag.model import ModelHandle


@pytest.mark.real
def test_model_info_on_default_model(capsys, tmp_path):
    from kvrag.engine import KVRag

    handle = ModelHandle.load()
    cfg = handle.model.config
    rag = KVRag(handle, cache_dir=tmp_path / "kv")

    assert main(["model", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # The fingerprint the store keys entries by (the model's + the chunk anchor), and the bytes
    # a token takes there (float16), not the model's own fingerprint and fp32 compute bytes.
    assert info["default_cache_fingerprint"] == rag.fingerprint != handle.fingerprint
    assert info["default_policy"] == rag.policy_default.label
    base = KVRag(handle, cache_dir=tmp_path / "kv", policy="full_prefill")
    assert info["cache_fingerprint"] == base.fingerprint != handle.fingerprint
    assert info["model_fingerprint"] == handle.fingerprint
    assert info["source"] == handle.source
    assert (info["layers"], info["heads"], info["kv_heads"]) == (
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )
    assert info["kv_bytes_per_token"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    assert info["compute_kv_bytes_per_token"] == 2 * info["kv_bytes_per_token"]

    assert main(["model", "info"]) == 0
    lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines())
    assert lines["cache fingerprint"].split()[0] == base.fingerprint
    assert lines["default policy"].split()[0] == rag.policy_default.label
    if rag.fingerprint != base.fingerprint:
        assert lines["default's entries"].split()[0] == rag.fingerprint
    assert lines["model"].strip() == handle.source
    assert lines["layers"].strip() == "30"
    assert lines["KV bytes/token"].split()[0] == "23040"  # 2 x 30 x 3 x 64 x 2 bytes (SmolLM2, stored fp16)
    assert lines["attention"].strip() == "RoPE default, full attention on every layer"
