"""QA data files (kvrag/qa/files.py): the released formats of the public QA sets, as users
bring them to ``kvrag bench --data`` and ``kvrag train kvlink --data``."""

from __future__ import annotations

import json

import pytest

from kvrag.bench.examples import load_examples
from kvrag.policies.kvlink.adapter import KVLinkError
from kvrag.policies.kvlink.data import load_qa
from kvrag.qa import files

NATIVE = {
    "question": "Where was Ada born?",
    "answers": ["Lyon"],
    "ctxs": [{"title": "Ada", "text": "Ada was born in Lyon."}, {"title": "", "text": "Bo lives in Riga."}],
}
MUSIQUE = {
    "id": "2hop__1",
    "question": "Where was Ada born?",
    "answer": "Lyon",
    "answer_aliases": ["Lyons"],
    "answerable": True,
    "paragraphs": [
        {"idx": 0, "title": "Ada", "paragraph_text": "Ada was born in Lyon.", "is_supporting": True},
        {"idx": 1, "title": "Bo", "paragraph_text": "Bo lives in Riga.", "is_supporting": False},
    ],
}
HOTPOT = {
    "_id": "5a8b",
    "question": "Where was Ada born?",
    "answer": "Lyon",
    "type": "bridge",
    "context": [["Ada", ["Ada was born in Lyon.", " She moved to Paris."]], ["Bo", ["Bo lives in Riga.", "He sails."]]],
}  # 2Wiki: no leading spaces
HOTPOT_HF = {
    "id": "5a8c",
    "question": "Where was Ada born?",
    "answer": "Lyon",
    "context": {"title": ["Ada", "Bo"], "sentences": [["Ada was born in Lyon."], ["Bo lives in Riga."]]},
}
LONGBENCH = {
    "_id": "lb1",
    "input": "Where was Ada born?",
    "answers": ["Lyon"],
    "length": 12,
    "context": "Passage 1:\nAda\nAda was born in Lyon.\nPassage 2:\nBo\nBo lives in Riga.\n",
}
SQUAD = {
    "version": "v2.0",
    "data": [
        {
            "title": "Ada",
            "paragraphs": [
                {
                    "context": "Ada was born in Lyon in 1815.",
                    "qas": [
                        {
                            "id": "s1",
                            "question": "Where was Ada born?",
                            "answers": [{"text": "Lyon", "answer_start": 16}],
                        },
                        {"id": "s2", "question": "When did Ada fly?", "answers": [], "is_impossible": True},
                        {
                            "id": "s3",
                            "question": "When was Ada born?",
                            "answers": [{"text": "1815", "answer_start": 24}],
                        },
                    ],
                }
            ],
        }
    ],
}


def _write(tmp_path, obj, name="d.json", lines=False):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(o) for o in obj) if lines else json.dumps(obj), encoding="utf-8")
    return p


@pytest.mark.parametrize(
    "item, answers, passages",
    [
        (NATIVE, ["Lyon"], [("Ada", "Ada was born in Lyon."), ("", "Bo lives in Riga.")]),
        (MUSIQUE, ["Lyon", "Lyons"], [("Ada", "Ada was born in Lyon."), ("Bo", "Bo lives in Riga.")]),
        (
            HOTPOT,
            ["Lyon"],
            [("Ada", "Ada was born in Lyon. She moved to Paris."), ("Bo", "Bo lives in Riga. He sails.")],
        ),
        (HOTPOT_HF, ["Lyon"], [("Ada", "Ada was born in Lyon."), ("Bo", "Bo lives in Riga.")]),
        (LONGBENCH, ["Lyon"], [("", "Ada\nAda was born in Lyon."), ("", "Bo\nBo lives in Riga.")]),
    ],
)
def test_each_released_format_reads_into_one_record(tmp_path, item, answers, passages):
    for lines in (False, True):  # a JSON list, and JSON lines (here: of one example)
        (rec,) = files.read_examples(_write(tmp_path, [item], lines=lines))
        assert rec.question == "Where was Ada born?"
        assert rec.answers == answers and rec.passages == passages


def test_containers_and_squad_nesting(tmp_path):
    recs = files.read_examples(_write(tmp_path, SQUAD))
    # One example per answerable question; SQuAD 2.0's unanswerable one is left out.
    assert [(r.id, r.answers, r.passages) for r in recs] == [
        ("s1", ["Lyon"], [("Ada", "Ada was born in Lyon in 1815.")]),
        ("s3", ["1815"], [("Ada", "Ada was born in Lyon in 1815.")]),
    ]
    mixed = [NATIVE, HOTPOT, LONGBENCH]
    by_list = files.read_examples(_write(tmp_path, mixed))
    assert files.read_examples(_write(tmp_path, {"data": mixed})) == by_list
    assert files.read_examples(_write(tmp_path, mixed, lines=True)) == by_list
    assert [r.id for r in by_list] == ["d-0", "5a8b", "lb1"] and by_list[1].type == "bridge"
    assert len(files.read_examples(_write(tmp_path, mixed), limit=2)) == 2
    # Numbers and {text} objects are answers too; duplicates are dropped.
    (rec,) = files.parse_items([{**NATIVE, "answers": [1815, {"text": "Lyon"}, "Lyon"]}], "x")
    assert rec.answers == ["1815", "Lyon"]
    # A context without LongBench's markers is one passage.
    (rec,) = files.parse_items([{**LONGBENCH, "context": "Ada was born in Lyon."}], "x")
    assert rec.passages == [("", "Ada was born in Lyon.")]


@pytest.mark.parametrize(
    "item, needle",
    [
        ({**NATIVE, "question": " "}, "no 'question'"),
        ({**NATIVE, "answers": []}, "needs 'answers'"),
        ({**NATIVE, "answers": ["Lyon", ""]}, "needs 'answers'"),
        ({**NATIVE, "answers": [None]}, "needs 'answers'"),
        ({"question": "q", "answers": ["a"]}, "no passages"),
        ({**NATIVE, "ctxs": []}, "'ctxs' must be a non-empty list"),
        ({**NATIVE, "ctxs": [{"title": "x"}]}, "ctx 0 has no 'text'"),
        ({**NATIVE, "ctxs": [{"title": 3, "text": "t"}]}, "'title' must be a string"),
        ({**MUSIQUE, "paragraphs": [{"title": "x", "text": "t"}]}, "ctx 0 has no 'paragraph_text'"),
        ({**HOTPOT, "context": [["Ada", "not a list"]]}, r"context 0 must be \[title, \[sentence"),
        ({**HOTPOT_HF, "context": {"title": ["a"], "sentences": []}}, "equally long"),
        ("just a string", "expected an object"),
    ],
)
def test_malformed_examples_are_named(item, needle):
    with pytest.raises(ValueError, match=needle):
        files.parse_items([NATIVE, item], "f.json")
    with pytest.raises(ValueError, match="f.json: example 1"):
        files.parse_items([NATIVE, item], "f.json")


def test_malformed_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        files.read_items(tmp_path / "missing.json")
    for text, needle in [
        ("{not json", "not valid JSON"),
        ('{"a": 1}\n{not json', "not valid JSON"),
        ('{"version": 1}', "expected a JSON list"),
        ("[]", "no QA examples"),
    ]:
        p = tmp_path / "bad.json"
        p.write_text(text)
        with pytest.raises(ValueError, match=needle):
            files.read_examples(p)
    p.write_bytes(b"\xff\xfe[]")
    with pytest.raises(ValueError, match="not UTF-8"):
        files.read_items(p)


def test_bench_and_trainer_read_the_same_file_each_their_way(tmp_path):
    p = _write(tmp_path, [HOTPOT, MUSIQUE], lines=True)
    ex = load_examples(str(p))
    assert [e.id for e in ex] == ["5a8b", "2hop__1"]
    assert ex[0].passages == ["Ada\nAda was born in Lyon. She moved to Paris.", "Bo\nBo lives in Riga. He sails."]
    assert ex[1].answers == ["Lyon", "Lyons"]
    items = load_qa(p)
    assert items[0].passages == ["Ada: Ada was born in Lyon. She moved to Paris.", "Bo: Bo lives in Riga. He sails."]
    assert items[1].answers == ["Lyon", "Lyons"]
    # The trainer needs text in every passage; the bench drops empty ones (and refuses all-empty).
    empty = _write(tmp_path, [{**NATIVE, "ctxs": [{"title": "", "text": "  "}, NATIVE["ctxs"][0]]}], name="e.json")
    with pytest.raises(KVLinkError, match="ctx 0 has no 'text'"):
        load_qa(empty)
    assert load_examples(str(empty))[0].passages == ["Ada\nAda was born in Lyon."]
    with pytest.raises(KVLinkError, match="does not exist"):
        load_qa(tmp_path / "missing.json")


def test_longbench_passages_are_served_as_chunks(tmp_path):
    """End to end: every passage read from a released-format file is precomputed as a chunk
    and found in the bench's prompt."""
    from kvrag.bench.config import BenchConfig
    from kvrag.bench.runner import Bench
    from kvrag.engine import KVRag
    from kvrag.testing import tiny_llama

    item = {
        **LONGBENCH,
        "context": "".join(
            f"Passage {i}:\nTitle {i}\n" + " ".join(f"w{i}x{j}" for j in range(40)) + "\n" for i in range(1, 4)
        ),
    }
    (ex,) = load_examples(str(_write(tmp_path, [item])))
    assert len(ex.passages) == 3
    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv", policy="naive_reuse")
    bench = Bench(BenchConfig(out=tmp_path / "out", policies=["naive_reuse"]))
    rag.precompute(ex.passages)
    out = rag.generate(bench.messages(ex, rag), max_new_tokens=2)
    assert out.stats.chunks_hit == 3 and out.stats.cached_tokens >= 3 * 40
