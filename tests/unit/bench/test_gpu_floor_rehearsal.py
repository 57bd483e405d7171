"""benchmarks/gpu_floor.py, the prepared GPU run, rehearsed on the CPU with the tiny shape: what a
device lease runs must work the first time."""

import csv
import importlib.util
from pathlib import Path

from kvrag.cli.cache import open_existing_store
from kvrag.store.kv_format import formats_held

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_floor.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_floor", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cpu_point(tiers: str) -> list[str]:
    """The options of a rehearsal: one small point on the CPU in float32, one timed round."""
    return ["--points", "2x64", "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--tiers", tiers]


def _tiny_run(tmp_path, monkeypatch, tiers: str, *options: str) -> list[dict]:
    """gpu_floor.py's records of naive_reuse (after full_prefill) on the tiny shape, one CPU
    point over ``tiers``, with ``options``, written to tmp_path/out."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    _script().main([str(out), "--shapes", "tiny", "--policies", "naive_reuse", *options, *_cpu_point(tiers)])
    return list(csv.DictReader(open(out / "floor.csv")))


def test_gpu_floor_writes_a_record_per_tier_and_policy_as_it_measures(tmp_path, monkeypatch):
    """One record per (tier, policy) with its floor, op counts on the point's first tier only,
    the table rewritten from them, and the profile of the first point; a shape that fails is
    reported and the next one still runs; a passed deadline skips the rest."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    gpu_floor = _script()
    out = tmp_path / "out"
    args = _cpu_point("device,host")
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
    args = _cpu_point("device")
    policies = ["--policies", "full_prefill,naive_reuse"]
    gpu_floor.main([str(out), "--shapes", "tiny", *policies, "--gqa-masked", "fold", *args])
    assert [h.arch.gqa_masked for h in built] == ["fold"]
    rows = list(csv.DictReader(open(out / "floor.csv")))
    assert [r["label"] for r in rows] == ["full_prefill", "naive_reuse"] and not any(r["error"] for r in rows)


def test_gpu_decode_writes_a_record_per_batch_and_path_as_it_measures(tmp_path, monkeypatch):
    """benchmarks/gpu_decode.py rehearsed with the tiny shape, eagerly (the compiled step's
    equality to eager is tests/unit/query/test_compiled.py's): a record per batch with its step
    time and floor, a shape that cannot be built recorded and the next one run, a passed
    deadline measuring nothing more."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    spec = importlib.util.spec_from_file_location("gpu_decode", SCRIPT.parent / "gpu_decode.py")
    gpu_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_decode)
    out = tmp_path / "out"
    args = ["--device", "cpu", "--dtype", "float32", "--context", "48", "--steps", "2", "--compile", "off"]
    gpu_decode.main([str(out), "--shapes", "nosuch,tiny", "--batches", "1,3", *args])
    rows = list(csv.DictReader(open(out / "decode.csv")))
    assert [(r["shape"], r["batch"], r["path"]) for r in rows] == [
        ("nosuch", "", "build"),
        ("tiny", "1", "eager"),
        ("tiny", "3", "eager"),
    ]
    assert "KeyError" in rows[0]["error"] and not rows[1]["error"] and not rows[2]["error"]
    for r, b in zip(rows[1:], (1, 3)):
        step_s, floor_ms = float(r["step_ms"]) / 1e3, float(r["floor_ms"])
        assert floor_ms > 0 and abs(float(r["tokens_per_s"]) - b / step_s) <= 0.1 + 0.01 * b / step_s
    # The floor grows with the batch: each request's K/V is read once more.
    assert float(rows[2]["floor_ms"]) > float(rows[1]["floor_ms"])
    assert (out / "decode.md").read_text().count("| tiny |") == 2
    gpu_decode.main([str(out), "--shapes", "tiny", "--batches", "1", "--deadline-s", "0", *args])
    assert len(list(csv.DictReader(open(out / "decode.csv")))) == len(rows)


def test_gpu_floor_stores_the_chunks_in_a_packed_format_when_asked(tmp_path, monkeypatch):
    """--storage-dtype (gpu_check.sh's formats step): the chunks are stored packed and served
    from every tier, each record says the format, and the table is headed by it."""
    out = tmp_path / "out"
    rows = _tiny_run(tmp_path, monkeypatch, "device,disk", "--storage-dtype", "int4")
    assert [(r["storage"], r["tier"], r["label"]) for r in rows] == [
        ("int4", t, label) for t in ("device", "disk") for label in ("full_prefill", "naive_reuse")
    ]
    assert not any(r["error"] for r in rows)
    assert all(int(r["chunks"]) == 2 for r in rows if r["label"] == "naive_reuse")
    assert "### tiny, chunks stored as int4" in (out / "floor.md").read_text()
    with open_existing_store(str(out / "kv_tiny")) as store:
        assert formats_held([fp for _, fp in store.listed().values()]).keys() == {"int4"}


def test_gpu_floor_measures_the_compiled_rows_when_asked(tmp_path, monkeypatch):
    """--compile on (what compile auto is on a GPU): the fused prefill's rows run compiled,
    built in the untimed first round, and each record says so."""
    rows = _tiny_run(tmp_path, monkeypatch, "device", "--compile", "on")
    assert [(r["label"], r["compile"]) for r in rows] == [("full_prefill", "on"), ("naive_reuse", "on")]
    assert not any(r["error"] for r in rows)
