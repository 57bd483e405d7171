"""The per-model default policy on the packaged models (marked ``real``): the committed table
names their weights, and ``KVRag()`` runs the default measured for SmolLM2 as it was measured."""

import pytest

from kvrag.engine import KVRag
from kvrag.model.digests import file_digest
from kvrag.model.packaged import MODEL_NAMES, resolve_model_path
from kvrag.policies import model_defaults as MD

pytestmark = pytest.mark.real


def test_the_table_names_the_packaged_models_weights():
    table = MD.load_table()
    by_model = {e["model"]: e for e in table["models"]}
    assert set(by_model) == set(MODEL_NAMES)
    for name, e in by_model.items():
        assert e["weights"] == file_digest(resolve_model_path(name)), name
        assert MD.default_for_weights(e["weights"], adapter_applied=True).policy == e["policy"]


def test_kvrag_runs_smollm2s_measured_default_and_says_why(tmp_path, caplog):
    entry = next(e for e in MD.load_table()["models"] if e["model"] == "smollm2")
    rag = KVRag(cache_dir=tmp_path / "kv")
    assert rag.policy.name == entry["policy"]
    assert rag.policy_default.model == entry["name"] and rag.policy_default.why == entry["why"]
    if entry["needs_adapter"]:
        # Measured with the shipped KVLink adapter: it runs with it, and without it the fallback.
        assert "kvlink_adapter" in rag.handle.load_info
        bare = KVRag(rag.handle.source, cache_dir=tmp_path / "kv2", kvlink_adapter=None)
        assert bare.policy_default.model is None and "not applied" in bare.policy_default.why
        assert bare.policy.name == MD.fallback().policy
        # Built on that KVRag's handle (the adapted model), a KVRag runs what it runs ...
        again = KVRag(rag.handle, cache_dir=tmp_path / "kv3")
        assert again.handle is rag.handle and again.fingerprint == rag.fingerprint
        assert again.policy.name == entry["policy"] and again.policy_default.why == entry["why"]
        # ... and another policy on the adapted weights says so.
        with caplog.at_level("WARNING", logger="kvrag"):
            KVRag(rag.handle, cache_dir=tmp_path / "kv4", policy="epic")
        assert "runs on the adapted weights" in caplog.text
    rag.precompute(["Aldport is the harbour town where the ferry to the islands leaves."])
    out = rag.generate("Aldport is the harbour town where the ferry to the islands leaves. Where?", max_new_tokens=4)
    assert out.stats.policy == entry["policy"] and out.stats.chunks_hit == 1
