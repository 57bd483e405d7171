"""QA data files: the common open-domain QA formats, read into ``QAExample`` s.

``kvrag bench --data`` and ``kvrag train kvlink --data`` both read a file of questions, gold
answers and the passages to put in the prompt. Users bring the file their own pipeline
evaluates on, so the usual shapes of the public QA sets are read as they are, detected per
example by its keys:

* kvrag / CacheBlend / DPR (``../shared/data/musique_dev.json``):
  ``{question, answers, ctxs: [{title, text}]}`` (``answer`` for ``answers``; a ctx may be a
  plain string);
* MuSiQue as released: ``{question, answer, answer_aliases, paragraphs: [{title, paragraph_text}]}``;
* HotpotQA / 2WikiMultihopQA: ``{question, answer, context: [[title, [sentence, ...]], ...]}``,
  or the Hugging Face ``datasets`` export ``context: {title: [...], sentences: [[...], ...]}``;
* LongBench: ``{input, answers, context}`` with the passages in one string, each introduced by
  a ``Passage N:`` line;
* SQuAD: ``{data: [{title, paragraphs: [{context, qas: [{question, answers: [{text}]}]}]}]}``
  (one example per answerable question, its paragraph as the only passage).

The container is a JSON list, a JSON object whose ``data`` holds that list, or JSON lines.
Answers may be strings, numbers or ``{text}`` objects. Anything else is a ``ValueError`` that
names the file, the example and the field.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from kvrag.qa.example import Passage, QAExample

# LongBench's multi-document sets (hotpotqa, 2wikimqa, musique) number their passages so.
_LONGBENCH_PASSAGE = re.compile(r"^Passage \d+:[ \t]*\n", re.MULTILINE)


def read_items(path: str | os.PathLike) -> list[Any]:
    """The raw examples of a QA file (JSON list, ``{"data": [...]}`` or JSON lines), SQuAD's
    nesting flattened. FileNotFoundError if there is no such file; ValueError otherwise."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        try:
            data = [json.loads(ln) for ln in lines] if len(lines) > 1 else None
        except json.JSONDecodeError:
            data = None
        if data is None:
            raise ValueError(f"{path}: not valid JSON (nor JSON lines): {e}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    elif isinstance(data, dict) and ("question" in data or "input" in data):
        data = [data]  # a file of one example (one line of JSON lines)
    if not isinstance(data, list):
        raise ValueError(
            f'{path}: expected a JSON list of QA examples (or {{"data": [...]}}, or JSON lines), '
            f"got a JSON {type(data).__name__}"
        )
    return _flatten_squad(data)


def _flatten_squad(items: list[Any]) -> list[Any]:
    """SQuAD's articles -> one kvrag-format example per answerable question."""
    if not items or not all(
        isinstance(a, dict)
        and isinstance(a.get("paragraphs"), list)
        and all(isinstance(p, dict) and "qas" in p for p in a["paragraphs"])
        for a in items
    ):
        return items
    out = []
    for art in items:
        for para in art["paragraphs"]:
            for qa in para.get("qas") or []:
                if not isinstance(qa, dict) or not qa.get("answers"):
                    continue  # SQuAD 2.0's unanswerable questions have no gold answer to score
                out.append(
                    {
                        "id": qa.get("id"),
                        "question": qa.get("question"),
                        "answers": qa["answers"],
                        "ctxs": [{"title": art.get("title") or "", "text": para.get("context")}],
                    }
                )
    return out


def parse_items(items: list[Any], source: str) -> list[QAExample[Passage]]:
    """Examples (as :func:`read_items` returns them) -> ``QAExample`` s, their passages as the
    file gives them; ValueError naming the example and field on anything malformed."""
    if not isinstance(items, list) or not items:
        raise ValueError(f"{source}: no QA examples (expected a non-empty list)")
    return [_example(it, f"{source}: example {i}", f"{Path(source).stem}-{i}") for i, it in enumerate(items)]


def read_examples(path: str | os.PathLike, limit: int | None = None) -> list[QAExample[Passage]]:
    """The first ``limit`` (all if None) examples of a QA file, parsed."""
    items = read_items(path)
    return parse_items(items[:limit] if limit is not None else items, str(path))


# ---- one example ----------------------------------------------------------------------------
def _example(it: Any, where: str, default_id: str) -> QAExample[Passage]:
    if not isinstance(it, dict):
        raise ValueError(f"{where}: expected an object, got {type(it).__name__}")
    q = it.get("question", it.get("input"))
    if not isinstance(q, str) or not q.strip():
        raise ValueError(f"{where}: no 'question' string (LongBench: 'input')")
    return QAExample(
        question=q.strip(),
        answers=_answers(it, where),
        passages=_passages(it, where),
        id=str(it.get("id", it.get("_id", default_id))),
        type=str(it.get("type", "")),
    )


def _answers(it: dict, where: str) -> list[str]:
    raw = it.get("answers", it.get("answer"))
    raw = [raw] if isinstance(raw, (str, int, float, dict)) else raw
    if not isinstance(raw, list):
        raw = []
    raw = raw + [a for a in it.get("answer_aliases") or [] if isinstance(a, str)]  # MuSiQue
    out: list[Any] = []
    for a in raw:
        if isinstance(a, dict):  # SQuAD: {"text": ..., "answer_start": ...}
            a = a.get("text")
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            a = str(a)
        if not isinstance(a, str) or not a.strip():
            out = []
            break
        if a.strip() not in out:
            out.append(a.strip())
    if not out:
        raise ValueError(f"{where}: needs 'answers' (or 'answer'), a non-empty list of non-empty strings")
    return out


def _passages(it: dict, where: str) -> list[Passage]:
    if "ctxs" in it:
        ctxs, key = it["ctxs"], "text"
    elif "paragraphs" in it:  # MuSiQue as released
        ctxs, key = it["paragraphs"], "paragraph_text"
    elif isinstance(it.get("context"), str):  # LongBench
        return _longbench_passages(it["context"])
    elif "context" in it:  # HotpotQA / 2WikiMultihopQA
        return _hotpot_passages(it["context"], where)
    else:
        raise ValueError(
            f"{where}: no passages: expected 'ctxs' [{{title, text}}] (or MuSiQue's 'paragraphs', HotpotQA's 'context')"
        )
    if not isinstance(ctxs, list) or not ctxs:
        raise ValueError(f"{where}: 'ctxs' must be a non-empty list of {{title, text}} objects")
    out = []
    for j, c in enumerate(ctxs):
        if isinstance(c, str):
            c = {key: c}
        if not isinstance(c, dict) or not isinstance(c.get(key), str):
            raise ValueError(f"{where}: ctx {j} has no {key!r} string")
        title = c.get("title") or ""
        if not isinstance(title, str):
            raise ValueError(f"{where}: ctx {j}: 'title' must be a string")
        out.append(Passage(title, c[key]))
    return out


def _join_sentences(sentences: list[str]) -> str:
    """HotpotQA keeps each sentence's leading space (``" It was ..."``), 2Wiki does not: add a
    space only where neither side has one."""
    text = ""
    for s in sentences:
        text += s if not text or text[-1].isspace() or s[:1].isspace() else " " + s
    return text.strip()


def _hotpot_passages(context: Any, where: str) -> list[Passage]:
    if isinstance(context, dict):  # datasets export: {"title": [...], "sentences": [[...], ...]}
        titles, sents = context.get("title"), context.get("sentences")
        if not isinstance(titles, list) or not isinstance(sents, list) or len(titles) != len(sents):
            raise ValueError(f"{where}: 'context' must hold equally long 'title' and 'sentences' lists")
        context = [list(pair) for pair in zip(titles, sents)]
    if not isinstance(context, list) or not context:
        raise ValueError(f"{where}: 'context' must be a non-empty list of [title, [sentence, ...]]")
    out = []
    for j, pair in enumerate(context):
        ok = (
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], list)
            and all(isinstance(s, str) for s in pair[1])
        )
        if not ok:
            raise ValueError(f"{where}: context {j} must be [title, [sentence, ...]]")
        out.append(Passage(pair[0], _join_sentences(pair[1])))
    return out


def _longbench_passages(context: str) -> list[Passage]:
    """LongBench's ``Passage N:`` sections, each as it reads (its first line is the title);
    a context without such markers is one passage."""
    parts = [p.strip() for p in _LONGBENCH_PASSAGE.split(context)]
    parts = [p for p in parts if p] if len(parts) > 1 else [context.strip()]
    return [Passage("", p) for p in parts]
