"""The benchmark's examples: QA items (a file or the synthetic set) as ``QAExample`` s whose
passages are what the prompt shows, each precomputed as one chunk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvrag.qa import files
from kvrag.qa.example import QAExample, rendered


def examples_from_items(
    items: Sequence[Any],
    *,
    source: str,
    limit: int | None = None,
    passages: int | None = None,
    passage_words: int | None = None,
) -> list[QAExample[str]]:
    """Validate QA examples (any format :mod:`kvrag.qa.files` reads) and turn them into the
    benchmark's: the first ``passages`` of each (all if None) as the prompt shows them
    (:func:`kvrag.qa.example.passage_text`: ``title\\ntext``, or the text alone), each cut to
    its first ``passage_words`` words if given, empty passages dropped."""
    if not isinstance(items, list):
        raise ValueError(f"{source}: expected a JSON list of examples, got {type(items).__name__}")
    out = []
    for i, read in enumerate(files.parse_items(items[: limit if limit is not None else None], source)):
        ex = rendered(read)
        texts = ex.passages[: passages if passages else None]
        if passage_words:
            texts = [" ".join(t.split(" ")[:passage_words]) for t in texts]
        texts = [t for t in texts if t.strip()]
        if not texts:
            raise ValueError(f"{source}: example {i}: every passage is empty")
        out.append(replace(ex, passages=texts))
    return out


def load_examples(path: str, **kw) -> list[QAExample[str]]:
    """Examples from a QA file (``musique_dev.json``'s format, or another :mod:`kvrag.qa.files` reads)."""
    return examples_from_items(files.read_items(path), source=str(path), **kw)
