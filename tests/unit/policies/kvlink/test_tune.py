"""`kvrag tune`: KVLink training data from many real-text sources, resumable training, and the
evaluation on what was not trained on (tiny random models)."""

import json
import random
import signal
import threading

import pytest
import torch

from kvrag.policies.kvlink import data as D
from kvrag.policies.kvlink.adapter import KVLinkError, load_adapter
from kvrag.policies.kvlink.checkpoints import CHECKPOINT_DIR
from kvrag.policies.kvlink.config import TrainConfig
from kvrag.policies.kvlink.train import train_kvlink
from kvrag.qa.example import QAExample

PROSE = (
    "The river rose for three days before the town council met. Farmers moved their herds to the "
    "hills, and the ferry stopped running at noon. By the fourth morning the water had reached the "
    "steps of the old mill, where the miller kept a record of every flood since his grandfather's time."
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _pool(n=8):
    return [f"Passage {i}. " + PROSE.replace("three", str(i + 3)) for i in range(n)]


# ---- sources ----------------------------------------------------------------------------------
def test_split_is_deterministic_disjoint_and_near_the_asked_fraction():
    keys = [f"question {i}?" for i in range(400)]
    a = [D.split_of(k) for k in keys]
    assert a == [D.split_of(k) for k in keys]
    assert 150 < a.count("eval") < 250
    assert all(D.split_of(k, eval_percent=0) == "train" for k in keys)


def test_qa_items_split_halves_the_musique_file_without_overlap(tmp_path):
    rows = [{"question": f"Q{i}?", "answers": ["x"], "ctxs": [{"title": "t", "text": "x y"}]} for i in range(40)]
    p = tmp_path / "qa.json"
    p.write_text(json.dumps(rows))
    tr, ev = D.qa_items(p, "train"), D.qa_items(p, "eval")
    assert len(tr) + len(ev) == 40 and tr and ev
    assert not {i.question for i in tr} & {i.question for i in ev}
    with pytest.raises(KVLinkError, match="split must be"):
        D.qa_items(p, "dev")


def test_split_passages_keeps_paragraphs_and_sentence_ends_within_the_budget():
    text = "\n\n".join([PROSE] * 5) + "\n\n" + "-- | -- | --\n\n" + " ".join([PROSE] * 4)
    out = D.split_passages(text, 80)
    assert out and all(D.approx_tokens(p) <= 80 for p in out)
    assert all(p.rstrip().endswith((".", "time.")) for p in out)  # cut at sentence ends
    assert not any("| --" in p for p in out)  # not prose: dropped
    with pytest.raises(KVLinkError, match=">= 16"):
        D.split_passages(text, 4)


def test_text_file_and_store_sources(tmp_path):
    from kvrag.store import ChunkEntry, DiskStore, make_key

    (tmp_path / "a.txt").write_text("\n\n".join([PROSE] * 3))
    assert len(D.file_passages([tmp_path / "a.txt"], 60, min_words=5)) >= 4
    assert D.file_passages([tmp_path], 60) == D.file_passages([tmp_path / "a.txt"], 60)
    with pytest.raises(KVLinkError, match="does not exist"):
        D.file_passages([tmp_path / "nope.txt"])
    store = DiskStore(tmp_path / "kv")
    z = torch.zeros(1, 1, 2, 2)
    for t in ("chunk one text", "the second chunk"):
        store.put(make_key("fp", [len(t)]), ChunkEntry("fp", t, torch.tensor([1, 2]), z, z.clone(), {}))
    assert sorted(D.store_passages(store)) == ["chunk one text", "the second chunk"]


def test_machine_sources_read_real_prose_or_say_why_not(caplog, monkeypatch):
    docs = D.pydoc_passages(200)
    assert len(docs) > 100 and all(D.approx_tokens(p) <= 200 for p in docs)
    # Without a man command the source is empty and the reason is logged.
    monkeypatch.setattr(D.shutil, "which", lambda name: None)
    with caplog.at_level("INFO", logger="kvrag.kvlink"):
        assert D.man_passages() == []
    assert "no 'man' command" in caplog.text
    assert D.usr_share_doc_passages(root="/nonexistent") == []


# ---- tasks --------------------------------------------------------------------------------------
def test_mixture_draws_every_source_shuffled_with_and_without_the_answering_passage():
    qa = [
        QAExample(
            f"Who keeps lantern {i}?",
            [f"keeper{i}"],
            [f"keeper{i} keeps lantern {i}."] + [f"filler {j} text" for j in range(6)],
        )
        for i in range(5)
    ]
    mix = D.Mixture({"text": _pool(), "pydoc": _pool(12)[8:]}, {"qa": qa}, min_docs=2, max_docs=5, p_without=0.3)
    rng = random.Random(0)
    tasks = [mix.task(rng) for _ in range(300)]
    assert {t.source for t in tasks} == {"text", "pydoc", "qa"}
    assert {t.kind for t in tasks} == {"continue", "summary", "cloze", "qa"}
    assert all(2 <= len(t.passages) <= (4 if t.source == "pydoc" else 5) for t in tasks)  # pydoc: 4 passages
    assert {t.has_answer for t in tasks if t.kind != "continue"} == {True, False}
    for t in tasks:
        if t.kind == "qa":
            holds = any(t.answers[0] in p for p in t.passages)
            assert holds == t.has_answer and t.target == ("gold" if holds else "teacher")
        elif t.kind == "cloze" and t.has_answer:
            assert any(t.answers[0] in " ".join(p.split()) for p in t.passages)
    orders = {tuple(t.passages) for t in tasks if t.source == "text" and t.kind != "continue"}
    assert len(orders) > 20
    # Same seed, same tasks: the data cursor of a resumed run is the RNG state.
    rng2 = random.Random(0)
    assert [mix.task(rng2).passages for _ in range(300)] == [t.passages for t in tasks]
    desc = mix.describe()
    assert desc["sources"]["text"]["passages"] == 8 and desc["sources"]["qa"]["items"] == 5
    assert len(desc["sources"]["pydoc"]["sha256"]) == 64
    with pytest.raises(KVLinkError, match="every source is empty"):
        D.Mixture({"text": []})
    with pytest.raises(KVLinkError, match="without data"):
        D.Mixture({"text": _pool()}, weights={"man": 1.0})


def test_teacher_targets_are_the_base_models_own_full_prefill_answer(handle, monkeypatch):
    mix = D.Mixture({"text": _pool()}, min_docs=2, max_docs=3)
    sampler = D.TaskSampler(handle, mix, link_tokens=2, max_docs=4, answer_tokens=6)
    task = mix.task(random.Random(3))
    s = sampler.sample(task)
    plain = s.without_links()
    prompt = plain.ids[: plain.answer_start]
    want = handle.model.generate(
        prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=6, do_sample=False, pad_token_id=0
    )[0, prompt.numel() :]
    assert s.ids[s.answer_start :].tolist() == want.tolist()
    assert int(s.segment.max()) == len(task.passages) and bool((s.link_slot >= 0).any())
    # The generation's own logits are the distillation target: those of a plain full forward.
    from kvrag.arch import Arch
    from kvrag.policies.kvlink.forward import answer_logits
    from kvrag.policies.kvlink.samples import Sample

    full = Sample(plain.ids, plain.link_slot, torch.zeros_like(plain.segment), plain.answer_start)
    with torch.no_grad():
        ref = answer_logits(Arch(handle.model), full, None)
    assert s.teacher_logits is not None and s.teacher_logits.shape == ref.shape == (6, ref.shape[-1])
    torch.testing.assert_close(s.teacher_logits, ref, rtol=1e-4, atol=1e-4)
    # A prompt over the training length limit costs no teacher generation (training skips it).
    from kvrag.policies.kvlink.samples import prompt_pieces, rag_prompt

    pieces = prompt_pieces(handle, rag_prompt(handle, task.passages, task.question), task.passages)
    assert sampler._prompt_tokens(pieces) == s.answer_start
    short = D.TaskSampler(handle, mix, link_tokens=2, max_docs=4, answer_tokens=6, max_tokens=s.answer_start)
    monkeypatch.setattr(handle.model, "generate", lambda *a, **k: pytest.fail("teacher ran"))
    assert short.sample(task).n > s.answer_start


def test_teacher_answers_generated_together_equal_each_generated_alone():
    """``TaskSampler.samples`` generates the teacher answers of several prompts of different
    lengths in one left-padded generation: each sample equals its task's ``sample`` alone
    (float64: the same answer tokens, logits to rounding), and ``draw`` takes the tasks the
    calls one at a time would take, from the same RNG state."""
    from kvrag.testing import tiny_llama

    h64 = tiny_llama(seed=0)
    h64.model.double()  # a handle of this test's own: kvrag loads models in float32/16 only
    mix = D.Mixture({"text": _pool()}, min_docs=1, max_docs=3)
    sampler = D.TaskSampler(h64, mix, link_tokens=2, max_docs=4, answer_tokens=6)
    rng = random.Random(5)
    tasks = [mix.task(rng) for _ in range(4)]
    together = sampler.samples(tasks)
    alone = [sampler.sample(t) for t in tasks]
    assert len({s.answer_start for s in alone}) > 1  # prompts of different lengths: padding ran
    for a, b in zip(together, alone):
        assert a.ids.tolist() == b.ids.tolist() and a.answer_start == b.answer_start
        assert a.teacher_logits is not None and a.teacher_logits.dtype == torch.float32
        torch.testing.assert_close(a.teacher_logits, b.teacher_logits, rtol=1e-5, atol=1e-5)
    drawn = sampler.draw(random.Random(5), 4)
    assert [s.ids.tolist() for s, _ in drawn] == [s.ids.tolist() for s in alone]
    assert [src for _, src in drawn] == [t.source for t in tasks]


def test_a_packed_step_draws_its_samples_together_and_trains_as_one_at_a_time(handle, tmp_path, monkeypatch):
    """With batch > 1 the trainer asks a sampler that can (``draw``) for the samples a step
    still needs, in rounds: the same samples, skips and sources as drawing one at a time."""
    sampler, mix = _sampler(handle)
    rounds = []  # samples asked for per round; a lone one is a call
    many, one = sampler.draw, D.TaskSampler.__call__
    monkeypatch.setattr(sampler, "draw", lambda rng, n: rounds.append(n) or many(rng, n))
    monkeypatch.setattr(D.TaskSampler, "__call__", lambda self, rng: rounds.append(1) or one(self, rng))
    cfg = dict(CFG, steps=3, batch=3, max_tokens=200)  # about a third of these samples are longer
    packed = train_kvlink(handle, TrainConfig(**cfg), tmp_path / "a", sampler=sampler, data_meta=mix.describe())
    # Rounds of what is still missing: a skipped sample is drawn again in a smaller round.
    assert rounds[0] == 3 and max(rounds) == 3 and sum(rounds) > 9
    monkeypatch.setattr(D.TaskSampler, "__call__", one)
    calls = []

    def one_at_a_time(rng):
        calls.append(1)
        return sampler(rng)

    single = train_kvlink(handle, TrainConfig(**cfg), tmp_path / "b", sampler=one_at_a_time, data_meta=mix.describe())
    assert len(calls) == sum(rounds)  # the same draws, skips included
    assert packed.meta["samples_by_source"] == single.meta["samples_by_source"]
    assert sum(packed.meta["samples_by_source"].values()) == 9
    assert packed.losses == pytest.approx(single.losses, rel=1e-4)


# ---- resumable training -------------------------------------------------------------------------
CFG = dict(
    data="mixture",
    lora_rank=2,
    link_tokens=2,
    max_docs=4,
    docs=3,
    lr=3e-2,
    link_lr=3e-2,
    warmup=2,
    log_every=100,
    objective="distill",
    seed=7,
)


def _sampler(handle):
    qa = [QAExample("Which river rose?", ["the river"], [PROSE, "Unrelated words about a hill."])]
    mix = D.Mixture({"text": _pool()}, {"qa": qa}, min_docs=2, max_docs=3)
    return D.TaskSampler(handle, mix, link_tokens=2, max_docs=4, answer_tokens=4, max_passage_chars=200), mix


def test_resumed_run_equals_the_uninterrupted_one(handle, tmp_path):
    sampler, mix = _sampler(handle)
    straight = train_kvlink(
        handle, TrainConfig(steps=6, **CFG), tmp_path / "a", sampler=sampler, data_meta=mix.describe()
    )
    first = train_kvlink(
        handle, TrainConfig(steps=6, **CFG), tmp_path / "b", sampler=sampler, stop_at_step=3, data_meta=mix.describe()
    )
    assert len(first.losses) == 3 and not first.meta["complete"]
    assert (tmp_path / "b" / CHECKPOINT_DIR / "state.pt").is_file()
    with pytest.raises(KVLinkError, match="already holds"):  # a fresh run must not overwrite it silently
        train_kvlink(handle, TrainConfig(steps=6, **CFG), tmp_path / "b", sampler=sampler)
    with pytest.raises(KVLinkError, match="other options or data: lr="):
        train_kvlink(
            handle,
            TrainConfig(steps=6, **{**CFG, "lr": 1e-3}),
            tmp_path / "b",
            sampler=sampler,
            data_meta=mix.describe(),
            resume=True,
        )
    other = D.Mixture({"text": _pool(9)}).describe()
    with pytest.raises(KVLinkError, match="other options or data: data="):
        train_kvlink(handle, TrainConfig(steps=6, **CFG), tmp_path / "b", sampler=sampler, data_meta=other, resume=True)
    resumed = train_kvlink(
        handle, TrainConfig(steps=6, **CFG), tmp_path / "b", sampler=sampler, data_meta=mix.describe(), resume=True
    )
    assert resumed.losses == straight.losses and resumed.meta["complete"]
    assert resumed.meta["samples_by_source"] == straight.meta["samples_by_source"]
    assert sum(straight.meta["samples_by_source"].values()) == 6
    a, b = load_adapter(straight.out), load_adapter(resumed.out)
    torch.testing.assert_close(a.links, b.links, rtol=0, atol=0)
    assert a.lora_digest == b.lora_digest
    meta = json.loads((straight.out / "kvlink.json").read_text())
    assert meta["data"]["sources"]["text"]["passages"] == 8 and meta["train_examples"] is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_and_saves_a_resumable_adapter(handle, tmp_path, sig):
    # SIGTERM (`timeout`) or Ctrl-C during step 2 of 5: the step finishes, then the run saves
    # what the time budget's stop saves and returns; resuming computes the uninterrupted run.
    sampler, mix = _sampler(handle)
    cfg = TrainConfig(steps=5, **CFG)
    straight = train_kvlink(handle, cfg, tmp_path / "a", sampler=sampler, data_meta=mix.describe())
    reached = []  # signals that got past the trainer to the handler it replaced

    def mine(signum, frame):
        reached.append(signum)

    previous = signal.signal(sig, mine)
    try:
        draws = 0

        def interrupting(rng):
            nonlocal draws
            draws += 1
            if draws == 2:  # in step 2; the second signal acts as without the trainer
                signal.raise_signal(sig)
                signal.raise_signal(sig)
            return sampler(rng)

        said = []
        stopped = train_kvlink(
            handle, cfg, tmp_path / "b", sampler=interrupting, data_meta=mix.describe(), progress=said.append
        )
        assert reached == [sig] and signal.getsignal(sig) is mine
        with pytest.raises(RuntimeError, match="sampler broke"):  # the handlers come back on an error too

            def broken(rng):
                raise RuntimeError("sampler broke")

            train_kvlink(handle, cfg, tmp_path / "c", sampler=broken, data_meta=mix.describe())
        assert signal.getsignal(sig) is mine
    finally:
        signal.signal(sig, previous)
    assert stopped.losses == straight.losses[:2]
    assert any(f"{sig.name} received: stopping after 2 steps" in m for m in said), said
    meta = json.loads((tmp_path / "b" / "kvlink.json").read_text())
    assert meta["steps"] == 2 and meta["complete"] is False
    assert load_adapter(tmp_path / "b").links.shape[1:] == (2, handle.model.config.hidden_size)
    resumed = train_kvlink(handle, cfg, tmp_path / "b", sampler=sampler, data_meta=mix.describe(), resume=True)
    assert resumed.losses == straight.losses and resumed.meta["complete"]
    assert resumed.meta["samples_by_source"] == straight.meta["samples_by_source"]
    torch.testing.assert_close(load_adapter(tmp_path / "b").links, straight.adapter.links, rtol=0, atol=0)


def test_signals_are_left_alone_outside_the_main_thread():
    from kvrag.policies.kvlink.train import _SignalStop

    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def enter():
        with _SignalStop():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert seen == [before]


def test_resume_without_checkpoint_is_named(handle, tmp_path):
    sampler, _ = _sampler(handle)
    with pytest.raises(KVLinkError, match="nothing to resume"):
        train_kvlink(handle, TrainConfig(steps=2, **CFG), tmp_path, sampler=sampler, resume=True)


# ---- the command ---------------------------------------------------------------------------------
def _qa_file(tmp_path, n=16):
    rows = [
        {
            "question": f"What does keeper {i} keep?",
            "answers": [f"lamp{i}"],
            "ctxs": [
                {"title": "Keepers", "text": f"Keeper {i} keeps lamp{i} in the tower."},
                {"title": "Weather", "text": PROSE},
            ],
        }
        for i in range(n)
    ]
    p = tmp_path / "qa.json"
    p.write_text(json.dumps(rows))
    return p


def test_cli_tune_trains_resumes_is_found_by_default_and_evaluates_held_out(handle, tmp_path, monkeypatch, capsys):
    from kvrag.cli import main
    from kvrag.model import ModelHandle
    from kvrag.policies.kvlink.adapter import default_adapter_dirs, find_adapter

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(ModelHandle, "load", lambda *a, **k: handle)
    (tmp_path / "notes.txt").write_text("\n\n".join(PROSE.replace("three", str(i)) for i in range(40)))
    qa = _qa_file(tmp_path)
    argv = [
        "tune",
        "--text",
        str(tmp_path / "notes.txt"),
        "--musique",
        str(qa),
        "--sources",
        "none",
        "--steps",
        "3",
        "--lora-rank",
        "2",
        "--link-tokens",
        "1",
        "--max-docs",
        "3",
        "--docs",
        "3",
        "--answer-tokens",
        "3",
        "--passage-tokens",
        "60",
        "--threads",
        "1",
        "--checkpoint-every",
        "0",
    ]
    # A sitting that ends at its time budget: 1 step, a checkpoint, a partial adapter.
    monkeypatch.setattr("sys.argv", ["kvrag", *argv])  # what kvlink.json records as the command
    assert main([*argv, "--max-minutes", "0.00001"]) == 0
    out = default_adapter_dirs(handle)[0]
    meta = json.loads((out / "kvlink.json").read_text())
    assert meta["steps"] == 1 and not meta["complete"]
    assert "--resume" in capsys.readouterr().out
    assert main(argv) == 2  # neither --resume nor --force: refuses to start over
    assert "--resume" in capsys.readouterr().err
    assert main([*argv, "--resume", "--eval", "--eval-limit", "2", "--eval-max-new-tokens", "2"]) == 0
    printed = capsys.readouterr().out
    meta = json.loads((out / "kvlink.json").read_text())
    assert meta["steps"] == 3 and meta["complete"] and meta["command"][:2] == ["kvrag", "tune"]
    assert [(s["from_step"], s["to_step"]) for s in meta["sittings"]] == [(0, 1), (1, 3)]
    assert meta["train_seconds"] == pytest.approx(sum(s["seconds"] for s in meta["sittings"]), abs=0.11)
    assert set(meta["data"]["sources"]) == {"text", "musique"} and str(qa) in meta["data"]["files"]
    assert sum(meta["samples_by_source"].values()) == 3
    assert find_adapter(handle) == out  # applied by default for this model
    # Trained on the 'train' half; evaluated on the other half and on held-out text passages.
    train_q = {i.question for i in D.qa_items(qa, "train")}
    held = json.loads((out / "eval" / "musique_eval.json").read_text())
    assert held and not {r["question"] for r in held} & train_q
    report = json.loads((out / "eval.json").read_text())
    assert report["trained_on"]["sources"]["musique"]["items"] == len(train_q)
    sets = {s["name"]: s for s in report["sets"]}
    assert "musique" in sets and "text_cloze" in sets
    labels = {r["label"] for r in sets["musique"]["rows"]}
    assert {"full_prefill", "naive_reuse", "cacheblend", "kvlink"} <= labels
    assert all(r["kl"] is not None for r in sets["musique"]["rows"] if r["label"] != "full_prefill")
    assert "trained on: " in printed and "musique" in (out / "eval" / "musique" / "benchmarks.md").read_text()[:400]


def test_cli_tune_checks_before_loading_the_model(tmp_path, monkeypatch, capsys):
    from kvrag.cli import main
    from kvrag.model import ModelHandle

    monkeypatch.setattr(ModelHandle, "load", lambda *a, **k: pytest.fail("model loaded"))
    for extra, msg in (
        (["--qa", str(tmp_path / "none.json")], "does not exist"),
        (["--sources", "pydoc,wiki"], "unknown ['wiki']"),
        (["--weights", "text:2"], "source=number"),
        (["--resume", "--force"], "pass one"),
        (["--steps", "0"], "--steps must be an integer >= 1"),
        (["--store", str(tmp_path)], "not a kvrag chunk store"),
        (["--eval-policies", "kvlink,magic"], "unknown ['magic']"),
    ):
        assert main(["tune", "--out", str(tmp_path / "o"), *extra]) == 2, extra
        assert msg in capsys.readouterr().err, extra


def test_cli_train_kvlink_resumes_too(handle, tmp_path, monkeypatch, capsys):
    from kvrag.cli import main
    from kvrag.model import ModelHandle

    monkeypatch.setattr(ModelHandle, "load", lambda *a, **k: handle)
    out = tmp_path / "ad"
    argv = [
        "train",
        "kvlink",
        "--data",
        str(_qa_file(tmp_path)),
        "--steps",
        "3",
        "--lora-rank",
        "2",
        "--link-tokens",
        "1",
        "--docs",
        "2",
        "--out",
        str(out),
        "--threads",
        "1",
    ]
    assert main([*argv, "--max-minutes", "0.00001"]) == 0
    assert json.loads((out / "kvlink.json").read_text())["steps"] == 1
    assert main(argv) == 2 and "--resume" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    meta = json.loads((out / "kvlink.json").read_text())
    assert meta["steps"] == 3 and meta["complete"] and len(meta["sittings"]) == 2


def test_cli_tune_reads_an_ingested_store(handle, tmp_path, monkeypatch):
    from kvrag.cli import main
    from kvrag.engine import KVRag
    from kvrag.model import ModelHandle

    monkeypatch.setattr(ModelHandle, "load", lambda *a, **k: handle)
    KVRag(handle, cache_dir=tmp_path / "kv", kvlink_adapter=None).precompute(_pool(6))
    out = tmp_path / "ad"
    assert (
        main(
            [
                "tune",
                "--store",
                str(tmp_path / "kv"),
                "--sources",
                "none",
                "--steps",
                "1",
                "--lora-rank",
                "0",
                "--link-tokens",
                "1",
                "--max-docs",
                "2",
                "--docs",
                "2",
                "--answer-tokens",
                "2",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    meta = json.loads((out / "kvlink.json").read_text())
    held = sum(D.split_of(p, D.POOL_EVAL_PERCENT) == "eval" for p in _pool(6))
    assert meta["data"]["sources"] == {"store": {**meta["data"]["sources"]["store"], "passages": 6 - held}}
    assert meta["samples_by_source"] == {"store": 1}
