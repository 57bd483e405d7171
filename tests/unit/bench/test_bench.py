"""kvrag.bench: metrics, the synthetic QA generator (kvrag.qa.synthetic), report files, and ``kvrag bench --quick``
end to end on the real SmolLM2 (marked ``real``)."""

import json
import math
import re

import pytest
import torch

from kvrag.bench import metrics as M
from kvrag.bench.examples import examples_from_items, load_examples
from kvrag.bench.summary import summarize
from kvrag.qa import synthetic as S


# ---- metrics -------------------------------------------------------------------------------
def test_normalize_answer_squad_rules():
    assert M.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert M.normalize_answer("An apple, a pear and THE plum.") == "apple pear and plum"
    # Articles go only as whole words.
    assert M.normalize_answer("Theatre anthem") == "theatre anthem"
    with pytest.raises(TypeError):
        M.normalize_answer(None)


def test_token_f1_and_em():
    assert M.token_f1("Paris", "paris.") == 1.0
    assert M.exact_match("the Paris", "Paris") == 1.0
    # pred 3 tokens, gold 2, overlap 1: P=1/3, R=1/2, F1=0.4
    assert M.token_f1("new york city", "york state") == pytest.approx(0.4)
    assert M.token_f1("london", "paris") == 0.0
    assert M.exact_match("new york city", "new york") == 0.0
    assert M.token_f1("", "paris") == 0.0
    assert M.token_f1("the", "a") == 1.0  # both normalise to nothing: they agree
    # Bag of words: repeated tokens count at most as often as they occur in the other side.
    assert M.token_f1("paris paris", "paris") == pytest.approx(2 * 0.5 * 1 / 1.5)


def test_best_over_answers():
    golds = ["Leonardo da Vinci", "da Vinci"]
    assert M.best_f1("da Vinci", golds) == 1.0
    assert M.best_em("Leonardo", golds) == 0.0
    assert M.best_f1("Leonardo", golds) == pytest.approx(0.5)
    assert M.best_f1("x", "x") == 1.0
    with pytest.raises(ValueError, match="no reference answers"):
        M.best_f1("x", [])


def test_answer_contained_as_whole_words():
    assert M.contains_answer("Maria Hale was born in the city of Brynmouth.", "Brynmouth") == 1.0
    assert M.contains_answer("She was born in 1793.", "1793") == 1.0
    assert M.contains_answer("Born in Brynmouthford.", "Brynmouth") == 0.0  # a different name
    assert M.contains_answer("It was The Ironworks", "the ironworks") == 1.0  # normalised
    assert M.contains_answer("anything", "the") == 0.0  # a gold that normalises to nothing
    assert M.best_acc("da Vinci painted it", ["Leonardo da Vinci", "da Vinci"]) == 1.0
    assert M.best_acc("Leonardo", ["Leonardo da Vinci"]) == 0.0


def test_mean_logprob_matches_manual():
    torch.manual_seed(0)
    logits = torch.randn(4, 10)  # [1 + T, V] with T = 3
    ids = [2, 7, 1]
    expect = sum(torch.log_softmax(logits[t], -1)[i].item() for t, i in enumerate(ids)) / 3
    assert M.mean_logprob(logits, ids) == pytest.approx(expect, abs=1e-6)
    with pytest.raises(ValueError, match="need 5 logit rows"):
        M.mean_logprob(logits, [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="empty"):
        M.mean_logprob(logits, [])


def test_next_token_agreement():
    torch.manual_seed(1)
    ref = torch.randn(5, 20)
    top1, kl = M.next_token_agreement(ref, ref.clone())
    assert top1 == 1.0 and kl == pytest.approx(0.0, abs=1e-9)
    other = ref.clone()
    other[0] = -ref[0]  # flips the argmax of position 0 only
    top1, kl = M.next_token_agreement(ref, other)
    assert top1 == pytest.approx(0.8)
    p, q = torch.softmax(ref[0].double(), -1), torch.softmax(other[0].double(), -1)
    assert kl == pytest.approx(float((p * (p / q).log()).sum()) / 5, rel=1e-6)
    # Only the first `positions` rows count.
    assert M.next_token_agreement(ref, other, positions=1)[0] == 0.0
    with pytest.raises(ValueError, match="vocabulary"):
        M.next_token_agreement(ref, torch.randn(5, 21))


def test_relative_gap():
    assert M.relative_gap(-1.05, -1.0) == pytest.approx(0.05)
    assert M.relative_gap(0.0, 0.0) == 0.0
    assert math.isinf(M.relative_gap(1.0, 0.0))


# ---- synthetic -----------------------------------------------------------------------------
def test_synthetic_is_deterministic_and_seeded():
    a = S.generate(6, seed=3)
    assert a == S.generate(6, seed=3)
    assert a != S.generate(6, seed=4)
    assert [it["type"] for it in a] == list(S.QUESTION_TYPES) * 2
    # The first k items do not depend on how many are asked for.
    assert S.generate(2, seed=3) == a[:2]


def test_synthetic_items_are_answerable_and_well_formed():
    items = S.generate(30, seed=0, n_passages=5, passage_tokens=120)
    exs = examples_from_items(items, source="synthetic")  # the musique_dev.json format
    assert len(exs) == 30
    for it in items:
        texts = [c["text"] for c in it["ctxs"]]
        assert len(texts) == 5
        ans = it["answers"][0]
        holders = [i for i, t in enumerate(texts) if re.search(rf"\b{re.escape(ans)}\b", t)]
        # The answer appears in an evidence passage.
        assert set(holders) & set(it["evidence"]), it
        if not ans.isdigit():
            # Cities, companies and professions appear only in the evidence passages (filler
            # names no people); a year may also date a distractor event.
            assert set(holders) <= set(it["evidence"]), it
        subj = [i for i, t in enumerate(texts) if it["subject"] in t]
        assert it["subject"] in it["question"]
        if it["type"] == "cross_passage":
            named, answer_passage = it["evidence"]
            assert answer_passage == named + 1  # the pronoun passage follows its subject's
            assert subj == [named]  # subject named only in the earlier passage
            assert ans in texts[answer_passage] and ans not in texts[named]
            assert re.match(r"(She|He) was born in ", texts[answer_passage])
        elif it["type"] == "two_hop":
            i, j = it["evidence"]
            assert abs(i - j) > 1 and subj == [i] and ans in texts[j] and ans not in texts[i]
        else:
            assert subj == it["evidence"]
            assert texts[subj[0]].startswith(it["subject"])  # the fact opens its passage


def test_bench_synthetic_types_option():
    """--synthetic-types picks the question types of the synthetic set, is validated before any
    model load, and is part of the rerunnable command line the report prints."""
    import argparse

    from kvrag.cli import bench as cli
    from kvrag.cli.bench import BenchError

    p = argparse.ArgumentParser()
    cli.register(p.add_subparsers())
    args = p.parse_args(["bench", "--synthetic", "4", "--synthetic-types", "single_hop", "--out", "x"])
    cfg = cli.config_from_args(args)
    assert cfg.synthetic_types == ["single_hop"]
    assert "--synthetic-types single_hop" in cfg.command
    bare = cli.config_from_args(p.parse_args(["bench", "--synthetic", "--out", "x"]))
    assert bare.synthetic_types == list(S.QUESTION_TYPES)
    assert bare.synthetic == 12 and "--synthetic 12" in bare.command  # bare = the default N, recorded
    assert cli.config_from_args(p.parse_args(["bench", "--synthetic", "--quick", "--out", "x"])).synthetic == 3
    with pytest.raises(BenchError, match="synthetic types.*three_hop"):
        cli.config_from_args(p.parse_args(["bench", "--synthetic", "--synthetic-types", "three_hop", "--out", "x"]))
    from types import SimpleNamespace

    from kvrag.bench.runner import Bench

    words = SimpleNamespace(handle=SimpleNamespace(encode=lambda s: s.split()))
    ((name, examples),) = Bench(cfg).datasets(words)
    assert name == "synthetic" and len(examples) == 4
    assert {ex.type for ex in examples} == {"single_hop"}


def _bench_args(*argv):
    import argparse

    from kvrag.cli import bench as cli

    p = argparse.ArgumentParser()
    cli.register(p.add_subparsers())
    return p.parse_args(["bench", *argv])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--limit", "0"], "--limit must be >= 1"),
        (["--limit", "-1"], "--limit must be >= 1"),
        (["--passages", "0"], "--passages must be >= 1"),
        (["--passages", "-2"], "--passages must be >= 1"),
        (["--sweep-limit", "-1"], "--sweep-limit must be >= 0"),
        (["--synthetic-passages", "2"], "--synthetic-passages must be >= 3"),
        (["--synthetic-passage-tokens", "29"], "--synthetic-passage-tokens must be >= 30"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--synthetic", "-3"], "--synthetic must be >= 0"),
        (["--synthetic", "-1"], "--synthetic must be >= 0"),  # not taken for a bare --synthetic
    ],
)
def test_bench_rejects_bad_counts_before_loading(tmp_path, argv, needle):
    """Negative counts would slice from the end (items[:-1]), 0 would run nothing; the
    synthetic generator's own limits are checked in the config, not after the model load."""
    from kvrag.cli.bench import BenchError, config_from_args

    with pytest.raises(BenchError) as e:
        config_from_args(_bench_args("--synthetic", "2", "--out", str(tmp_path / "o"), *argv))
    assert needle in str(e.value)
    assert not (tmp_path / "o").exists()


def test_bench_hot_cache_option(tmp_path):
    from kvrag.cli.bench import BenchError, command_line, config_from_args

    out = ("--synthetic", "--out", str(tmp_path / "o"))
    assert config_from_args(_bench_args(*out)).hot_cache == 0  # default: the cold path
    assert config_from_args(_bench_args(*out, "--hot-cache", "auto")).hot_cache == "auto"
    args = _bench_args(*out, "--hot-cache", "1048576")
    assert config_from_args(args).hot_cache == 1048576 and "--hot-cache 1048576" in command_line(args)
    for bad in ("-1", "1.5", "lots"):
        with pytest.raises(BenchError, match="--hot-cache"):
            config_from_args(_bench_args(*out, "--hot-cache", bad))


def test_bench_prefix_cache_option(tmp_path):
    from kvrag.cli.bench import BenchError, command_line, config_from_args
    from kvrag.defaults import DEFAULT_PREFIX_CACHE

    out = ("--synthetic", "--out", str(tmp_path / "o"))
    args = _bench_args(*out)
    assert config_from_args(args).prefix_cache == DEFAULT_PREFIX_CACHE and "--prefix-cache" not in command_line(args)
    args = _bench_args(*out, "--prefix-cache", "0")
    assert config_from_args(args).prefix_cache == 0 and "--prefix-cache 0" in command_line(args)
    with pytest.raises(BenchError, match="--prefix-cache"):
        config_from_args(_bench_args(*out, "--prefix-cache", "-1"))


def test_bench_zero_sweep_limit_means_no_sweep(tmp_path):
    from kvrag.cli.bench import config_from_args

    cfg = config_from_args(_bench_args("--synthetic", "--out", str(tmp_path / "o"), "--sweep-limit", "0"))
    assert cfg.sweep_limit == 0 and cfg.limit is None and cfg.passages is None  # None: all


def test_bench_checks_output_paths_before_loading(tmp_path, capsys, monkeypatch):
    """--out / --report / --cache-dir that cannot be written fail at once, not after the run."""
    from kvrag.cli import main
    from kvrag.cli.bench import BenchError, config_from_args
    from kvrag.model import ModelHandle

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    out = str(tmp_path / "o")
    for argv, needle in [
        (["--out", str(a_file)], "--out"),
        (["--out", str(a_file / "sub")], f"{a_file} is not a directory"),
        (["--out", out, "--report", str(tmp_path)], "--report"),
        (["--out", out, "--report", str(a_file / "r.md")], f"{a_file} is not a directory"),
        (["--out", out, "--cache-dir", str(a_file)], "--cache-dir"),
    ]:
        with pytest.raises(BenchError, match="directory") as e:
            config_from_args(_bench_args("--synthetic", *argv))
        assert needle in str(e.value)
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "bench").write_text("a file where the plots go")
    with pytest.raises(BenchError, match="plots"):
        config_from_args(_bench_args("--synthetic", "--out", out, "--report", str(tmp_path / "rep" / "r.md")))
    # Through the command: exit code 2, one line, no model load.
    monkeypatch.setattr(ModelHandle, "load", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["bench", "--synthetic", "1", "--out", str(a_file / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrag: error: --out") and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_synthetic_bad_arguments():
    with pytest.raises(ValueError, match="question type"):
        S.generate(2, types=["three_hop"])
    with pytest.raises(ValueError, match="n_passages"):
        S.generate(2, n_passages=2)


def test_exact_length_item_token_counts():
    from kvrag.testing import smollm2_tokenizer

    tok = smollm2_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    item = S.exact_length_item(3, 64, enc, tok.decode, seed=1)
    texts = [c["text"] for c in item["ctxs"]]
    assert [len(enc(t)) for t in texts] == [64, 64, 64]
    assert item["answers"][0] in texts[item["evidence"][0]]
    assert item == S.exact_length_item(3, 64, enc, tok.decode, seed=1)


# ---- data loading and summary ---------------------------------------------------------------
def test_load_examples_validates(tmp_path):
    good = [
        {"question": "Q?", "answers": ["a"], "ctxs": [{"title": "T", "text": "body one"}, {"title": "", "text": "two"}]}
    ]
    p = tmp_path / "d.json"
    p.write_text(json.dumps(good))
    (ex,) = load_examples(str(p))
    assert ex.passages == ["T\nbody one", "two"] and ex.answers == ["a"]
    for bad, msg in [
        ({"question": "", "answers": ["a"], "ctxs": good[0]["ctxs"]}, "question"),
        ({"question": "Q", "answers": [], "ctxs": good[0]["ctxs"]}, "answers"),
        ({"question": "Q", "answers": ["a"], "ctxs": [{"title": "x"}]}, "text"),
    ]:
        p.write_text(json.dumps([bad]))
        with pytest.raises(ValueError, match=msg):
            load_examples(str(p))
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_examples(str(p))
    with pytest.raises(FileNotFoundError):
        load_examples(str(tmp_path / "missing.json"))


def test_summary_speedup_is_median_of_per_example_ratios():
    def rec(ex, label, ttft, speedup, gold_ll):
        return {
            "device": "cpu",
            "scenario": "qa",
            "dataset": "d",
            "example_id": ex,
            "label": label,
            "policy": label,
            "ttft_s": ttft,
            "ttft_min": ttft,
            "ttft_max": ttft,
            "speedup": speedup,
            "gold_ll": gold_ll,
            "error": None,
        }

    recs = [
        rec("a", "full_prefill", 10.0, 1.0, -2.0),
        rec("a", "naive_reuse", 1.0, 10.0, -3.0),
        rec("b", "full_prefill", 4.0, 1.0, -2.0),
        rec("b", "naive_reuse", 2.0, 2.0, -3.0),
        rec("c", "full_prefill", 6.0, 1.0, -2.0),
        rec("c", "naive_reuse", 1.0, 6.0, -3.0),
        {**rec("d", "naive_reuse", None, None, None), "error": "RuntimeError: boom"},
    ]
    rows = {r["label"]: r for r in summarize(recs)}
    assert rows["naive_reuse"]["speedup"] == 6.0 and rows["naive_reuse"]["errors"] == 1
    assert rows["naive_reuse"]["n"] == 4 and rows["naive_reuse"]["ttft_s"] == 1.0
    assert rows["naive_reuse"]["gold_ll_rel_gap"] == pytest.approx(0.5)
    assert rows["full_prefill"]["gold_ll_rel_gap"] == 0.0


def test_qa_score_targets_show_the_answer_counts_they_rest_on():
    from kvrag.bench.targets import evaluate_targets

    def rec(ex, label, acc):
        return {
            "device": "cpu",
            "scenario": "qa",
            "dataset": "synthetic",
            "example_id": ex,
            "label": label,
            "policy": label,
            "ttft_s": 1.0,
            "ttft_min": 1.0,
            "ttft_max": 1.0,
            "speedup": 1.0,
            "gold_acc": acc,
            "error": None,
        }

    accs = {"full_prefill": [1, 1, 0], "a3": [1, 0, 0], "cacheblend": [0, 0, 0], "samkv": [1, 1, 0]}
    recs = [rec(f"e{i}", label, a) for label, xs in accs.items() for i, a in enumerate(xs)]
    summary = summarize(recs)
    rows = {r["label"]: r for r in summary}
    assert rows["a3"]["gold_acc_hits"] == 1 and rows["full_prefill"]["gold_acc_hits"] == 2
    assert rows["a3"]["gold_acc_ratio"] == pytest.approx(0.5)
    targets = evaluate_targets({"summary": summary, "meta": {"config": {"devices": ["cpu"]}}})
    by = {(t["policy"], t["metric"]): t for t in targets if t["where"].startswith("QA")}
    a3 = by[("a3", "gold accuracy relative to full_prefill's")]
    assert a3["status"] == "FAIL" and a3["detail"] == "1/3 answered vs 2/3 by full_prefill"
    assert by[("cacheblend", "gold accuracy relative to full_prefill's")]["detail"].startswith("0/3 answered")
    assert by[("samkv", "gold accuracy loss vs full_prefill (points)")]["status"] == "PASS"
    assert by[("samkv", "share of prompt KV kept")]["detail"] is None


@pytest.mark.parametrize("tokens", [1300, 4100])
def test_speed_targets_are_judged_on_the_qa_prompts_when_they_are_4k_long(tokens):
    """The QA and speed targets are one statement at ~4k tokens: a QA set that long gets
    a3/cacheblend speed-up rows on its own prompts; a shorter one does not (its speed-ups
    would be judged at a length the target does not name)."""
    from kvrag.bench.targets import evaluate_targets

    def rec(ex, label, ttft):
        return {
            "device": "cpu",
            "scenario": "qa",
            "dataset": "synthetic",
            "example_id": ex,
            "label": label,
            "policy": label,
            "ttft_s": ttft,
            "ttft_min": ttft,
            "ttft_max": ttft,
            "speedup": 8.0 / ttft,
            "gold_acc": 1,
            "prompt_tokens": tokens,
            "error": None,
        }

    ttfts = {"full_prefill": 8.0, "a3": 2.5, "cacheblend": 1.6}
    summary = summarize([rec(f"e{i}", label, t) for label, t in ttfts.items() for i in range(3)])
    targets = evaluate_targets({"summary": summary, "meta": {"config": {"devices": ["cpu"]}}})
    speed = {t["policy"]: t for t in targets if t["where"].startswith("QA") and t["metric"].startswith("TTFT")}
    if tokens < 3500:
        assert speed == {}
        return
    assert set(speed) == {"a3", "cacheblend"}
    assert speed["a3"]["measured"] == pytest.approx(3.2) and speed["a3"]["status"] == "FAIL"
    assert speed["cacheblend"]["measured"] == pytest.approx(5.0) and speed["cacheblend"]["status"] == "PASS"
    assert speed["a3"]["prompt_tokens"] == tokens


# ---- `kvrag bench --quick` end to end on the real model -------------------------------------


@pytest.mark.parametrize("hot_cache", [0, "auto"])
def test_cold_path_times_a_chunks_first_query(tmp_path, monkeypatch, hot_cache):
    """With no hot tier every timed run starts with nothing of an earlier run in memory, the
    policies' per-chunk query-time memos (SamKV's) included: each timed samkv run computes its
    documents' local rows again. With a hot tier (the warm path) the memo is kept."""
    from kvrag.bench.config import BenchConfig, Run
    from kvrag.bench.runner import Bench
    from kvrag.engine import KVRag
    from kvrag.policies.samkv.policy import SamKV
    from kvrag.qa.example import QAExample
    from kvrag.testing import tiny_llama

    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv")
    ex = QAExample(
        "Who keeps the lantern?",
        ["Ada"],
        [f"Passage {i}: " + " ".join(f"word{i}x{j}" for j in range(60)) for i in range(3)],
        id="e0",
    )
    bench = Bench(BenchConfig(out=tmp_path / "out", policies=["samkv"], hot_cache=hot_cache))
    bench.device = "cpu"  # what Bench.run sets per device
    bench.precompute(rag, ex.passages, "qa")
    forgets = []
    real = SamKV.forget.__func__
    monkeypatch.setattr(SamKV, "forget", classmethod(lambda cls: (forgets.append(cls.name), real(cls))))
    recs = bench.time_policies(rag, "qa", "d", ex, [Run("full_prefill"), Run("samkv")], 0, 3, 1)
    assert not recs["samkv"]["error"] and len(recs["samkv"]["ttft_runs"]) == 3
    # (SamKV.forget itself empties the memo: tests/unit/policies/test_samkv.py.)
    assert forgets.count("samkv") == (3 if hot_cache == 0 else 0)


def test_bench_floor_option(tmp_path):
    """--floor alone is a run (the floor scenario, no scaling unless asked); bare = 12x630."""
    from kvrag.cli.bench import BenchError, command_line, config_from_args

    args = _bench_args("--floor", "--out", str(tmp_path / "o"))
    cfg = config_from_args(args)
    assert cfg.floor == [(12, 630)] and cfg.scaling == [] and "--floor 12x630" in command_line(args)
    cfg = config_from_args(_bench_args("--floor", "2x64,4x64", "--scaling", "2x64", "--out", str(tmp_path / "o")))
    assert cfg.floor == [(2, 64), (4, 64)] and cfg.scaling == [(2, 64)]
    with pytest.raises(BenchError, match="nothing to run"):
        config_from_args(_bench_args("--out", str(tmp_path / "o")))
    with pytest.raises(BenchError, match="--floor"):
        config_from_args(_bench_args("--floor", "2by64", "--out", str(tmp_path / "o")))


def test_measure_floor_calls_before_run_ahead_of_every_timed_read_and_run(tmp_path):
    """before_run (dropping the page cache, say) runs before each timed read of the floor's
    parts and each run of each policy, warm-up round included; count_ops=False leaves the op
    columns out and keeps the floor."""
    from kvrag.bench.config import Run
    from kvrag.bench.floor import measure_floor
    from kvrag.engine import KVRag
    from kvrag.qa import synthetic
    from kvrag.testing import tiny_llama

    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv", hot_cache=0)
    item = synthetic.exact_length_item(2, 64, rag.handle.encode, rag.tokenizer.decode)
    passages = [c["text"] for c in item["ctxs"]]
    rag.precompute(passages)
    prompt = "\n\n".join(passages) + "\n\n" + item["question"]
    runs = [Run("full_prefill"), Run("naive_reuse"), Run("cacheblend", {"recompute_ratio": 0.15})]
    calls = []
    recs = measure_floor(
        lambda run: rag, prompt, runs, 2, "2x64", "cpu", before_run=lambda: calls.append(1), count_ops=False
    )
    assert len(calls) == 2 + 3 * len(runs)  # two reads, then (warm-up + 2 rounds) x 3 policies
    nr = recs[1]
    assert nr["label"] == "naive_reuse" and nr["floor_s"] > 0 and nr["chunks"] == 2 and not nr["error"]
    assert "ops_prefill" not in nr and "syncs_decode" not in nr
    assert recs[2]["label"] == "cacheblend@0.15" and recs[2]["recompute_s"] > 0


def test_floor_scenario_measures_ttft_floor_and_ops(tmp_path):
    """Each reuse policy gets its floor (reads + move + plain forward [+ recompute]) and op
    counts beside the plain forward's; full_prefill is the throughput reference; floor.csv and
    the report's section are written."""
    from kvrag.bench.config import BenchConfig
    from kvrag.bench.outputs import write_outputs
    from kvrag.bench.report import render_markdown
    from kvrag.bench.runner import Bench
    from kvrag.engine import KVRag
    from kvrag.testing import tiny_llama

    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv", hot_cache=0)
    bench = Bench(BenchConfig(out=tmp_path / "out", policies=["naive_reuse", "cacheblend"], floor=[(3, 64)], repeats=1))
    bench.device = "cpu"
    bench.run_floor(rag)
    recs = {r["label"]: r for r in bench.floor_records}
    assert set(recs) == {"full_prefill", "naive_reuse", "cacheblend"}
    assert not any(r["error"] for r in recs.values())
    assert recs["full_prefill"]["ttft_s"] > 0 and "floor_s" not in recs["full_prefill"]
    nr, cb = recs["naive_reuse"], recs["cacheblend"]
    for r in (nr, cb):
        assert r["chunks"] == 3 and 3 * 60 <= r["cached_tokens"] <= 3 * 64  # edges may tokenize otherwise
        parts = r["read_s"] + r["move_s"] + r["forward_s"] + r["recompute_s"]
        assert r["floor_s"] == pytest.approx(parts) and r["floor_s"] > 0
        assert r["ttft_over_floor"] == pytest.approx(r["ttft_s"] / r["floor_s"])
        assert r["ops_prefill"] > 0 and r["ops_plain"] > 0 and r["ops_decode"] > 0
        assert r["syncs_prefill"] >= 0 and r["syncs_decode"] >= 0
    assert nr["recompute_s"] == 0.0 and cb["recompute_s"] > 0  # cacheblend recomputes layers 0-1 + 15%
    assert cb["recompute_s"] == pytest.approx(
        cb["recompute_fraction"] * cb["cached_tokens"] * cb["full_prefill_s"] / cb["prompt_tokens"]
    )

    result = {
        "records": [],
        "floor": bench.floor_records,
        "summary": [],
        "precompute": [],
        "footprint": {},
        "throughput": {},
        "single_hop_check": {},
        "meta": {
            "config": {"devices": ["cpu"], "max_new_tokens": 1, "repeats": 1, "kl_positions": 1},
            "machine": {
                "cpu": "x",
                "cores": 2,
                "torch_threads": 2,
                "platform": "p",
                "python": "3",
                "torch": "t",
                "transformers": "t",
            },
            "command": "kvrag bench --floor",
            "started": "now",
            "wall_s": 1.0,
        },
    }
    files = write_outputs(result, tmp_path / "out")
    assert files["floor_csv"].read_text().splitlines()[0].startswith("device,dataset,label")
    md = render_markdown(result, files, tmp_path / "out" / "benchmarks.md", tmp_path / "out")
    assert "### TTFT vs its floor" in md and "`cacheblend`" in md


def _journal_examples():
    """Three small examples of two passages each, for the resume journals' tests."""
    from kvrag.qa.example import QAExample

    return [
        QAExample(
            f"Who keeps lantern {i}?",
            ["Ada"],
            [f"Passage {i}.{k}: " + " ".join(f"w{i}x{k}x{j}" for j in range(20)) for k in range(2)],
            id=f"e{i}",
        )
        for i in range(3)
    ]


def test_qa_journal_resumes_an_interrupted_run(tmp_path, monkeypatch):
    """Each finished QA example is journaled; --resume keeps those (a torn last line dropped)
    and runs only the rest; a journal of another configuration is refused, not mixed in."""
    from kvrag.bench.config import BenchConfig
    from kvrag.bench.journal import journal_path
    from kvrag.bench.runner import Bench
    from kvrag.engine import KVRag
    from kvrag.testing import tiny_llama

    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv")
    exs = _journal_examples()

    def bench(**kw):
        b = Bench(BenchConfig(out=tmp_path / "out", policies=["naive_reuse"], repeats=1, max_new_tokens=2, **kw))
        b.device, b.model_info = "cpu", {"fingerprint": "f" * 16}
        return b

    first = bench()
    first.run_qa(rag, "d", exs[:2])  # "interrupted" after two examples
    path = journal_path(tmp_path / "out", "cpu", "d")
    with path.open("a", encoding="utf-8") as f:
        f.write('{"key": "2:e2", "records": [')  # torn by the interruption
    timed = []
    again = bench(resume=True)
    real = again.time_policies
    monkeypatch.setattr(
        again, "time_policies", lambda r, sc, ds, ex, *a: (timed.append(ex.id), real(r, sc, ds, ex, *a))[1]
    )
    again.run_qa(rag, "d", exs)
    assert timed == ["e2"]
    assert [(r["example_id"], r["label"]) for r in again.records] == [
        (f"e{i}", p) for i in range(3) for p in ("full_prefill", "naive_reuse")
    ]
    assert again.records[:4] == first.records  # kept as measured
    assert len(path.read_text(encoding="utf-8").splitlines()) == 1 + 3
    # Without --resume the journal starts anew.
    fresh = bench()
    fresh.run_qa(rag, "d", exs[:1])
    assert len(path.read_text(encoding="utf-8").splitlines()) == 1 + 1
    with pytest.raises(ValueError, match=r"another run configuration \(differs in: max_new_tokens\)"):
        b = bench(resume=True)
        b.cfg.max_new_tokens = 3
        b.run_qa(rag, "d", exs)


def test_sweep_journal_resumes_an_interrupted_sweep(tmp_path, monkeypatch):
    """The sweep journals each finished example in its own file beside the QA journal;
    --resume keeps those and runs only the rest (its runs are the swept ratios)."""
    from kvrag.bench.config import BenchConfig
    from kvrag.bench.journal import journal_path
    from kvrag.bench.runner import Bench
    from kvrag.engine import KVRag
    from kvrag.testing import tiny_llama

    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv")
    exs = _journal_examples()

    def bench(**kw):
        cfg = BenchConfig(
            out=tmp_path / "out",
            policies=["full_prefill"],
            sweep_policies=["cacheblend"],
            sweep_ratios=[0.0, 0.5],
            sweep_limit=3,
            sweep_data="data",
            repeats=1,
            max_new_tokens=2,
            **kw,
        )
        b = Bench(cfg)
        b.device, b.model_info = "cpu", {"fingerprint": "f" * 16}
        return b

    first = bench()
    first.run_sweep(rag, {"d": exs[:2]})  # "interrupted" after two examples
    path = journal_path(tmp_path / "out", "cpu", "d", "sweep")
    assert path.name == "sweep_journal.cpu.d.jsonl" and path.is_file()
    timed = []
    again = bench(resume=True)
    real = again.time_policies
    monkeypatch.setattr(
        again, "time_policies", lambda r, sc, ds, ex, *a: (timed.append(ex.id), real(r, sc, ds, ex, *a))[1]
    )
    again.run_sweep(rag, {"d": exs})
    assert timed == ["e2"]
    labels = ("full_prefill", "cacheblend@0", "cacheblend@0.5")
    assert [(r["example_id"], r["label"]) for r in again.records] == [(f"e{i}", p) for i in range(3) for p in labels]
    assert all(r["scenario"] == "sweep" for r in again.records)
    assert again.records[:6] == first.records  # kept as measured
    assert len(path.read_text(encoding="utf-8").splitlines()) == 1 + 3
    with pytest.raises(ValueError, match=r"another run configuration \(differs in: sweep_ratios, runs\)"):
        b = bench(resume=True)
        b.cfg.sweep_ratios = [0.0, 0.25]
        b.run_sweep(rag, {"d": exs})


def test_a_store_too_small_for_the_chunks_just_precomputed_is_an_error(tmp_path):
    """A KV store whose size limit evicts what was just precomputed would make every reuse run
    a silent full prefill: the bench says so instead of measuring it."""
    from kvrag.bench.config import BenchConfig
    from kvrag.bench.runner import Bench
    from kvrag.engine import KVRag
    from kvrag.testing import tiny_llama

    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv", size_limit=300_000)  # ~1 of 3 entries
    bench = Bench(BenchConfig(out=tmp_path / "out", policies=["naive_reuse"], repeats=1))
    bench.device = "cpu"
    with pytest.raises(RuntimeError, match=r"chunks just precomputed are not in the KV store any more: its size limit"):
        bench.precompute(rag, [f"Passage {i}: " + " ".join(f"w{i}x{j}" for j in range(80)) for i in range(3)], "qa")
