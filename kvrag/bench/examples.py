"""The benchmark's examples: QA items (a file or the synthetic set) as question, passages, gold
answers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrag import qa_data

log = logging.getLogger("kvrag.bench")

log = logging.getLogger("kvrag.bench")


@dataclass
class Example:
    """One QA example: passages in prompt order (each precomputed as one chunk)."""

    id: str
    question: str
    answers: list[str]
    passages: list[str]
    qtype: str = ""


def examples_from_items(
    items: Sequence[Any],
    *,
    source: str,
    limit: int | None = None,
    passages: int | None = None,
    passage_words: int | None = None,
) -> list[Example]:
    """Validate QA examples (any format :mod:`kvrag.qa_data` reads) and turn them into
    ``Example`` s: each passage is ``title\ntext`` (or the text alone), empty passages dropped."""
    if not isinstance(items, list):
        raise ValueError(f"{source}: expected a JSON list of examples, got {type(items).__name__}")
    out = []
    for i, rec in enumerate(qa_data.parse_items(items[: limit if limit is not None else None], source)):
        texts = [
            f"{title.strip()}\n{text.strip()}" if title.strip() else text.strip()
            for title, text in rec.passages[: passages if passages else None]
        ]
        if passage_words:
            texts = [" ".join(t.split(" ")[:passage_words]) for t in texts]
        texts = [t for t in texts if t.strip()]
        if not texts:
            raise ValueError(f"{source}: example {i}: every passage is empty")
        out.append(Example(rec.id, rec.question, rec.answers, texts, rec.type))
    return out


def load_examples(path: str, **kw) -> list[Example]:
    """Examples from a QA file (``musique_dev.json``'s format, or another :mod:`kvrag.qa_data` reads)."""
    return examples_from_items(qa_data.read_items(path), source=str(path), **kw)
