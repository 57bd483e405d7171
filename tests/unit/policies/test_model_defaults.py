"""The default policy per model: the rule that chooses it from held-out runs, the committed
table that records it, and how KVRag and the framework adapters resolve ``policy="auto"``."""

import json

import pytest
from helpers.scripts import benchmark_script

from kvrag.bench.pareto import Run, Setting, choose, deficit_interval, read_run
from kvrag.policies import model_defaults as MD

pytestmark = pytest.mark.usefixtures("one_thread")


def _setting(label, speedup, lls, policy=None, params=None):
    ll = {f"q{i}": v for i, v in enumerate(lls)}
    return Setting(label, policy or label.split("@")[0], params or {}, len(lls), speedup, 0.0, ll)


def _run(path, dataset, ref, **settings):
    """A run whose gaps are computed from the per-item log-likelihoods, as kvrag bench does."""
    out = {"full_prefill": _setting("full_prefill", 1.0, ref)}
    for label, (speedup, lls) in settings.items():
        mean, mref = sum(lls) / len(lls), sum(ref) / len(ref)
        s = _setting(label, speedup, lls)
        out[label] = Setting(s.label, s.policy, s.params, s.n, speedup, abs(mean - mref) / abs(mref), s.ll)
    return Run(path, dataset, "model-a", out)


REF = [-1.0 - 0.1 * (i % 7) for i in range(40)]


def test_deficit_interval_is_paired_and_detects_a_consistent_loss():
    worse = [x - 0.05 for x in REF]  # every item a little worse: tiny next to the items' spread
    lo, hi = deficit_interval(dict(enumerate(worse)), dict(enumerate(REF)))
    assert 0.049 < lo <= hi < 0.051
    noisy = [x + (0.05 if i % 2 else -0.05) for i, x in enumerate(REF)]  # as often better as worse
    lo, hi = deficit_interval(dict(enumerate(noisy)), dict(enumerate(REF)))
    assert lo <= 0 <= hi


def test_choose_takes_the_fastest_setting_that_keeps_quality_on_every_run():
    a = _run(
        "a",
        "set1",
        REF,
        slow_good=(2.0, [x - 0.01 * (i % 2) for i, x in enumerate(REF)]),
        fast_good=(8.0, [x - 0.02 * (i % 2) + 0.02 * ((i + 1) % 2) for i, x in enumerate(REF)]),
        fastest_bad=(20.0, [x - 0.3 for x in REF]),
    )
    b = _run(
        "b",
        "set2",
        REF,
        slow_good=(3.0, REF),
        fast_good=(6.0, [x + 0.01 * ((-1) ** i) for i, x in enumerate(REF)]),
        fastest_bad=(25.0, [x - 0.2 for x in REF]),
    )
    c = choose([a, b])
    assert c.label == "fast_good" and c.rule == "fastest that keeps quality"
    assert c.speedup == 6.0  # its slowest run
    assert c.lost["fastest_bad"] == ["a", "b"] and not c.lost["fast_good"]


def test_choose_requires_every_dataset_and_falls_back_to_the_smallest_gap():
    a = _run("a", "set1", REF, x=(5.0, [v - 0.2 for v in REF]), y=(9.0, [v - 0.4 for v in REF]))
    b = _run("b", "set2", REF, x=(4.0, [v - 0.3 for v in REF]), only_here=(30.0, REF))
    c = choose([a, b])
    # only_here ran on one dataset: not a candidate, though it is exact and fast; y neither.
    assert set(c.kept) == {"x"}
    assert c.label == "x"  # x is the best of its own runs, so it keeps quality
    worse = _run("c", "set1", REF, x=(5.0, [v - 0.2 for v in REF]), z=(2.0, REF))
    c = choose([worse, _run("d", "set2", REF, x=(4.0, REF), z=(2.0, [v - 0.5 for v in REF]))])
    assert c.rule == "smallest mean gap" and not any(v == [] for v in c.lost.values())
    with pytest.raises(ValueError, match="different models"):
        choose([a, Run("e", "set1", "model-b", a.settings)])


def test_a_run_of_one_setting_is_held_against_its_datasets_best():
    # Run "b" measures only "alone" on set1's items: it is its run's best, but run "a" has a
    # setting closer to full prefill on the same items.
    a = _run("a", "set1", REF, close=(2.0, [v - 0.01 for v in REF]))
    b = _run("b", "set1", REF, alone=(12.0, [v - 0.3 for v in REF]))
    c = choose([a, b])
    assert c.lost["alone"] == ["b"] and c.kept["close"] == ["a"]
    assert c.label == "close"


def _write_run(d, adapter):
    """A two-item ``kvrag bench`` output directory with full_prefill and kvlink, its journal
    header naming ``adapter`` (None: no adapter was found)."""
    d.mkdir()
    recs = [{"label": lab, "policy": lab, "params": {}} for lab in ("full_prefill", "kvlink")]
    head = {"journal": {"dataset": "ds", "model": "m", "kvlink_adapter": adapter}}
    (d / "qa_journal.cpu.ds.jsonl").write_text(json.dumps(head) + "\n" + json.dumps({"records": recs}) + "\n")
    rows = [f"{lab},q{i},,{-1.0 - i}" for lab in ("full_prefill", "kvlink") for i in range(2)]
    (d / "records.csv").write_text("label,example_id,error,gold_ll\n" + "\n".join(rows) + "\n")
    (d / "summary.csv").write_text("label,n,speedup,gold_ll_rel_gap\nfull_prefill,2,1.0,0\nkvlink,2,9.0,0.1\n")
    return d


def test_read_run_names_kvlink_without_an_adapter_untrained(tmp_path):
    # The same model's later run with its adapter measures another setting under "kvlink".
    bare = read_run(_write_run(tmp_path / "bare", None))
    assert set(bare.settings) == {"full_prefill", "kvlink(mode=untrained)"}
    assert bare.settings["kvlink(mode=untrained)"].params == {"mode": "untrained"} and not bare.trained_kvlink
    adapted = read_run(_write_run(tmp_path / "adapted", {"path": "a", "lora": True}))
    assert set(adapted.settings) == {"full_prefill", "kvlink"} and adapted.trained_kvlink
    assert adapted.settings["kvlink"].speedup == 9.0 and adapted.settings["kvlink"].ll == {"q0": -1.0, "q1": -2.0}


def test_the_committed_table_is_what_the_committed_runs_choose():
    """Editing the table by hand, or a run without rerunning benchmarks/choose_defaults.py,
    fails here (the weight digests are checked against the packaged models in integration)."""
    mod = benchmark_script("choose_defaults")
    table, _ = mod.build(digests=False)
    shipped = json.loads(MD.TABLE_PATH.read_text(encoding="utf-8"))
    for e in shipped["models"]:
        e["weights"] = None
    assert shipped == json.loads(json.dumps(table))
    assert {e["model"] for e in shipped["models"]} == set(mod.EVIDENCE)


def _table(weights, policy="epic", params=None, needs_adapter=False):
    fb = {"policy": "cacheblend", "params": {}, "why": "no evidence"}
    entry = {
        "name": "Tiny",
        "weights": weights,
        "policy": policy,
        "params": params or {},
        "needs_adapter": needs_adapter,
        "why": "measured",
    }
    return {"format": MD.TABLE_FORMAT, "fallback": fb, "models": [entry]}


def test_default_for_weights_matches_the_digest_and_needs_the_adapter_it_was_measured_with():
    t = _table("w1", "kvlink", needs_adapter=True)
    assert MD.default_for_weights("w2", adapter_applied=True, table=t) == MD.fallback(t)
    assert MD.default_for_weights("w1", adapter_applied=True, table=t).policy == "kvlink"
    fb = MD.default_for_weights("w1", adapter_applied=False, table=t)
    assert fb.policy == "cacheblend" and fb.model is None and "not applied" in fb.why
    assert MD.defaults_by_policy(t) == {"kvlink": ["Tiny (kvlink)"], "cacheblend": ["any other model (cacheblend)"]}


def test_kvrag_without_a_policy_runs_the_models_default(handle, tmp_path, monkeypatch):
    from kvrag.engine import KVRag

    rag = KVRag(handle, cache_dir=tmp_path / "a")
    assert rag.policy.name == "cacheblend"  # a random tiny model: no evidence, the fallback
    assert rag.policy_default is not None and rag.policy_default.model is None
    w = handle.fingerprint_parts["weights"]
    monkeypatch.setattr(MD, "load_table", lambda: _table(w, "cacheblend", {"recompute_ratio": 0.3}))
    rag = KVRag(handle, cache_dir=tmp_path / "b")
    assert (rag.policy.name, rag.policy.params.recompute_ratio) == ("cacheblend", 0.3)
    assert rag.policy_default.model == "Tiny" and rag.policy_default.label == "cacheblend(recompute_ratio=0.3)"
    # A per-call "auto" or no policy is the KVRag's own; a named policy is that policy.
    prompt = "Paris is the capital of France. What is the capital of France?"
    rag.precompute(["Paris is the capital of France."])
    own = rag.generate(prompt, max_new_tokens=4)
    assert rag.generate(prompt, policy="auto", max_new_tokens=4).token_ids == own.token_ids
    assert own.stats.policy == "cacheblend"
    named = KVRag(handle, cache_dir=tmp_path / "c", policy="epic")
    assert named.policy_default is None and named.policy.name == "epic"


def test_policy_parameters_without_a_policy_are_an_error_before_the_model_load(tmp_path):
    from kvrag.engine import KVRag
    from kvrag.frameworks import resolve_policy

    with pytest.raises(ValueError, match="need a named policy"):
        KVRag("/nonexistent/model", cache_dir=tmp_path, recompute_ratio=0.2)
    with pytest.raises(ValueError, match="without a policy"):
        resolve_policy(None, {"recompute_ratio": 0.2}, {}, None, "Wrapper")
    assert resolve_policy(None, None, {}, None, "Wrapper") == ("auto", {})


def test_wrappers_built_without_a_policy_hold_the_models_default(model_dir, tmp_path):
    import logging

    from kvrag.frameworks.options import call_options
    from langchain_kvrag import ChatKVRag
    from llama_index.llms.kvrag import KVRagLLM

    llm = KVRagLLM(model=model_dir, cache_dir=str(tmp_path / "a"), set_tokenizer=False)
    chat = ChatKVRag(model=model_dir, cache_dir=str(tmp_path / "b"))
    for w in (llm, chat):
        # The tiny model has no evidence: the fallback, with the parameters its KVRag runs.
        assert w.policy == w.rag.policy.name == "cacheblend"
        assert w.policy_params["recompute_ratio"] == w.rag.policy.params.recompute_ratio
    with pytest.raises(ValueError, match="without a policy"):
        KVRagLLM(model=model_dir, cache_dir=str(tmp_path / "c"), recompute_ratio=0.3)
    # A call asking for "auto" runs the wrapper's own policy and keeps its parameters.
    defaults = {"policy": "epic", "max_new_tokens": 8, "stop": []}
    out = call_options(defaults, {"k_head": 4}, {"policy": "auto"}, "W", logging.getLogger("test"))
    assert (out["policy"], out["k_head"]) == ("epic", 4)
