"""`kvrag bench --quick` end to end on the real SmolLM2 model."""

import json
import math

import pytest
import torch

QA_ITEMS = [
    {
        "question": "Which instrument does Mara Quill play?",
        "answers": ["the cello", "cello"],
        "ctxs": [
            {
                "title": "Mara Quill",
                "text": "Mara Quill is a musician from the town of Brenholt. "
                "She plays the cello in the Brenholt Quartet.",
            },
            {
                "title": "Brenholt",
                "text": "Brenholt is a river town known for its stone bridges and its autumn market.",
            },
            {"title": "Oren Vale", "text": "Oren Vale is a painter who moved to the coast in 1998."},
        ],
    },
    {
        "question": "In which year was the Lark Tower finished?",
        "answers": ["1887"],
        "ctxs": [
            {"title": "Fenwick", "text": "Fenwick is a small city on the northern plains with a busy rail yard."},
            {
                "title": "Lark Tower",
                "text": "The Lark Tower is a clock tower in Fenwick. Its construction was finished in 1887.",
            },
            {"title": "Pella Stone", "text": "Pella Stone is a grey limestone quarried near the hills of Arnet."},
        ],
    },
]


RECORD_KEYS = {
    "example_id",
    "policy",
    "ttft_s",
    "answer",
    "gold_f1",
    "gold_acc",
    "fidelity_f1",
    "gold_nll",
    "cached_tokens",
    "recomputed_tokens",
    "kept_tokens",
    "prompt_tokens",
}


@pytest.mark.real
def test_quick_bench_end_to_end_on_smollm2(tmp_path, isolated_home):  # only shipped adapters; no codebook
    from kvrag.cli import main
    from kvrag.model import ModelHandle

    data = tmp_path / "qa.json"
    data.write_text(json.dumps(QA_ITEMS), encoding="utf-8")
    out = tmp_path / "out"
    # The policies' own real-model tests run every other one; here the run's shape is the point.
    policies = "naive_reuse,cacheblend,kvlink"
    assert (
        main(
            [
                "bench",
                "--quick",
                "--data",
                str(data),
                "--synthetic",
                "1",
                "--policies",
                policies,
                "--out",
                str(out),
                "--scaling",
                "2x64",
                "--sweep-policies",
                "cacheblend",
                "--no-footprint",
                "--hot-cache",
                "auto",
            ]
        )
        == 0
    )

    records = json.loads((out / "results.json").read_text())
    qa = [r for r in records if r["scenario"] == "qa"]
    assert {r["policy"] for r in qa} == {"full_prefill", *policies.split(",")}
    # The KVLink adapter shipped for SmolLM2 is picked up: trained kvlink runs on the adapted
    # model, with its untrained variant beside it (5 runs per example).
    assert {r["label"] for r in qa} == {"full_prefill", *policies.split(","), "kvlink(mode=untrained)"}
    assert len([r for r in qa if r["dataset"] == "qa"]) == 2 * 5 and not [r for r in qa if r["error"]]
    assert len([r for r in qa if r["dataset"] == "synthetic"]) == 5
    assert json.loads((out / "summary.json").read_text())["meta"]["model"]["kvlink_adapter"]["lora"] is True
    for r in qa:
        assert RECORD_KEYS <= set(r), RECORD_KEYS - set(r)
        assert r["ttft_s"] > 0 and 0.0 <= r["gold_f1"] <= 1.0 and math.isfinite(r["gold_nll"])
        if r["policy"] != "full_prefill":
            assert r["cached_tokens"] > 0  # every passage was served from its precomputed chunk
            # --hot-cache: the example's chunks are loaded once before its timed runs, so every
            # timed run is served from memory.
            assert r["chunks_hot"] == r["chunks_hit"] > 0
    handle = ModelHandle.load()
    for r in [r for r in qa if r["policy"] == "full_prefill"]:
        assert r["fidelity_f1"] == 1.0 and r["fidelity_em"] == 1.0
        # full_prefill's answer is plain transformers greedy generation on the same token ids.
        ids = r["prompt_ids"]
        with torch.no_grad():
            ref = handle.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=len(r["answer_token_ids"]),
                do_sample=False,
            )
        assert ref[0, len(ids) :].tolist() == r["answer_token_ids"]
    assert {r["scenario"] for r in records} == {"qa", "scaling", "sweep"}
    for name in ("summary.csv", "records.csv", "scaling.csv", "sweep.csv", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert list(out.glob("*.png"))
    report = (out / "benchmarks.md").read_text()
    for part in (
        "## How this was run",
        "## Targets",
        "## Results on cpu",
        "### QA: qa",
        "### QA: synthetic",
        "full_prefill",
        "kvrag bench",
        "Check of the generator",
    ):
        assert part in report, part
    check = json.loads((out / "summary.json").read_text())["single_hop_check"]
    # The generator check ran on items of its own seed, and the report states its count.
    assert check["items"] == 2 and check["seed"] == 1 and check["device"] == "cpu"
    assert f"answers **{check['answered']}/2**" in report
