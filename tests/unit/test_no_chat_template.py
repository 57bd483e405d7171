"""A model whose tokenizer has no chat template (a base model such as Mistral-7B-v0.1): the
RAG prompt falls back to plain text everywhere kvrag builds one itself (demo, bench, KVLink
training) and in the LangChain chat model, and its chunks are still served from the cache."""

import json

import pytest

from kvrag.cli import main
from kvrag.engine import KVRag
from kvrag.layout.prompt import DEFAULT_INSTRUCTION, plain_chat_prompt, rag_messages, rag_prompt
from kvrag.testing import smollm2_tokenizer, tiny_llama

DOCS = [
    "The red fox lives in the northern forest and hunts small rodents at dawn.",
    "Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres.",
]


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    tok = smollm2_tokenizer()
    tok.chat_template = None
    handle = tiny_llama(seed=0, tokenizer=tok)
    d = tmp_path_factory.mktemp("base-model")
    handle.model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_rag_prompt_is_plain_text_without_a_chat_template(base_model_dir, tmp_path):
    rag = KVRag(str(base_model_dir), cache_dir=tmp_path / "kv")
    assert not getattr(rag.tokenizer, "chat_template", None)
    prompt = rag_prompt(rag.tokenizer, DOCS, "Where does the fox live?")
    assert isinstance(prompt, str) and prompt.startswith(DEFAULT_INSTRUCTION) and prompt.endswith("Answer:")
    with pytest.raises(ValueError, match="no chat template"):
        rag.render(rag_messages(DOCS, "Where does the fox live?"))
    rag.precompute(DOCS)
    out = rag.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=4)
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=4)
    assert out.stats.chunks_hit == 2 and out.token_ids == full.token_ids
    # A tokenizer with a template still gets chat messages.
    assert rag_prompt(smollm2_tokenizer(), DOCS, "q") == rag_messages(DOCS, "q")


def test_langchain_chat_model_renders_plain_text(base_model_dir, tmp_path):
    from langchain_core.messages import HumanMessage, SystemMessage

    from langchain_kvrag import ChatKVRag

    llm = ChatKVRag(model=str(base_model_dir), cache_dir=str(tmp_path / "kv"), max_new_tokens=3)
    llm.rag.precompute(DOCS)
    msgs = [SystemMessage(content="Answer briefly."), HumanMessage(content="\n\n".join(DOCS) + "\n\nWhere?")]
    llm.invoke(msgs)
    assert llm.last_stats.chunks_hit == 2
    expect = plain_chat_prompt(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": msgs[1].content}]
    )
    assert llm.last_generation.prompt_ids == llm.rag.tokenizer(expect, add_special_tokens=False)["input_ids"]
    assert llm.get_num_tokens_from_messages(msgs) == llm.last_stats.prompt_tokens


def test_demo_bench_and_training_run_on_a_base_model(base_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    assert (
        main(["demo", "--model", str(base_model_dir), "--policies", "full_prefill,cacheblend", "--max-new-tokens", "2"])
        == 0
    )
    assert "no chat template" not in capsys.readouterr().out
    out = tmp_path / "bench"
    assert (
        main(
            [
                "bench",
                "--quick",
                "--model",
                str(base_model_dir),
                "--synthetic",
                "1",
                "--policies",
                "cacheblend",
                "--scaling",
                "2x64",
                "--sweep-limit",
                "0",
                "--check-items",
                "0",
                "--no-footprint",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    records = json.loads((out / "results.json").read_text())
    assert records and not [r for r in records if r["error"]]
    assert all(r["cached_tokens"] > 0 for r in records if r["policy"] == "cacheblend")
    data = tmp_path / "train.json"
    data.write_text(
        json.dumps(
            [
                {
                    "question": "Where does the fox live?",
                    "answers": ["forest"],
                    "ctxs": [{"title": f"doc {i}", "text": d} for i, d in enumerate(DOCS)],
                }
            ]
        )
    )
    assert (
        main(
            [
                "train",
                "kvlink",
                "--data",
                str(data),
                "--model",
                str(base_model_dir),
                "--steps",
                "1",
                "--docs",
                "2",
                "--out",
                str(tmp_path / "adapter"),
            ]
        )
        == 0
    )
    assert "(1 step)" in capsys.readouterr().out  # no "first 10 -> last 10" over one step


def test_bench_exits_non_zero_when_every_run_failed(base_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))

    def refuse(self, *a, **k):
        raise ValueError("refused")

    monkeypatch.setattr(KVRag, "generate", refuse)
    assert (
        main(
            [
                "bench",
                "--quick",
                "--model",
                str(base_model_dir),
                "--synthetic",
                "1",
                "--policies",
                "cacheblend",
                "--scaling",
                "2x64",
                "--sweep-limit",
                "0",
                "--check-items",
                "0",
                "--no-footprint",
                "--no-warmup",
                "--out",
                str(tmp_path / "bench"),
            ]
        )
        == 1
    )
