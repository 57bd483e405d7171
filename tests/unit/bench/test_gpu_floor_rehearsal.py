"""benchmarks/gpu_floor.py, the prepared GPU run, rehearsed on the CPU with the tiny shape: what a
device lease runs must work the first time."""

import csv
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_floor.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_floor", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_floor_writes_a_record_per_tier_and_policy_as_it_measures(tmp_path, monkeypatch):
    """One record per (tier, policy) with its floor, op counts on the point's first tier only,
    the table rewritten from them, and the profile of the first point; a shape that fails is
    reported and the next one still runs; a passed deadline skips the rest."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    gpu_floor = _script()
    out = tmp_path / "out"
    args = ["--points", "2x64", "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--tiers", "device,host"]
    gpu_floor.main([str(out), "--shapes", "nosuch,tiny", "--policies", "naive_reuse,cacheblend@0.15", *args])
    rows = list(csv.DictReader(open(out / "floor.csv")))
    labels = ["full_prefill", "naive_reuse", "cacheblend@0.15"]
    assert [(r["shape"], r["tier"], r["label"]) for r in rows] == [
        ("tiny", t, label) for t in ("device", "host") for label in labels
    ]
    assert not any(r["error"] for r in rows)
    reuse = [r for r in rows if r["label"] != "full_prefill"]
    assert all(float(r["floor_s"]) > 0 and int(r["chunks"]) == 2 for r in reuse)
    assert [bool(r["ops_prefill"]) for r in reuse] == [True, True, False, False]
    assert rows[2]["params"] == "{'recompute_ratio': 0.15}"
    assert (out / "floor.md").read_text().count("| 2x64 |") == 2
    assert "## cacheblend@0.15" in (out / "profile_tiny.txt").read_text()
    # A second run into the same folder reads the records there; a deadline of 0 adds none.
    gpu_floor.main([str(out), "--shapes", "tiny", "--deadline-s", "0", *args])
    assert len(list(csv.DictReader(open(out / "floor.csv")))) == len(rows)


def test_gpu_floor_sets_how_masked_attention_meets_grouped_heads(tmp_path, monkeypatch):
    """--gqa-masked reaches the engine's Arch (the A/B gpu_check.sh runs), and the run measures;
    full_prefill named in --policies is the reference, run once."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    gpu_floor = _script()
    built = []
    build = gpu_floor.build
    monkeypatch.setattr(gpu_floor, "build", lambda *a: built.append(build(*a)) or built[-1])
    out = tmp_path / "out"
    args = ["--points", "2x64", "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--tiers", "device"]
    policies = ["--policies", "full_prefill,naive_reuse"]
    gpu_floor.main([str(out), "--shapes", "tiny", *policies, "--gqa-masked", "fold", *args])
    assert [h.arch.gqa_masked for h in built] == ["fold"]
    rows = list(csv.DictReader(open(out / "floor.csv")))
    assert [r["label"] for r in rows] == ["full_prefill", "naive_reuse"] and not any(r["error"] for r in rows)
