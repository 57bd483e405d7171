"""One QA example, and the one rule for how a passage reads in a prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar


class Passage(NamedTuple):
    """A passage as a QA file gives it: its title (``""`` when the format has none) and its text
    (as in the file, possibly empty: the consumer decides what an empty passage means)."""

    title: str
    text: str


#: What separates a passage's title from its text in the prompts ``kvrag bench`` and the
#: yardsticks build, and so in every measured result: the title on a line of its own.
TITLE_LINE = "\n"


def passage_text(title: str, text: str, sep: str = TITLE_LINE) -> str:
    """How a passage reads in a prompt (where it is one chunk): its title, ``sep`` and its text,
    each stripped; the text alone when the title is blank.

    ``sep`` is :data:`TITLE_LINE` wherever a prompt is measured; KVLink training from a QA file
    passes its own (``kvrag.policies.kvlink.data.TRAIN_TITLE_SEP``, which says why)."""
    title, text = title.strip(), text.strip()
    return f"{title}{sep}{text}" if title else text


P = TypeVar("P", Passage, str)


@dataclass
class QAExample(Generic[P]):
    """One QA example: the ``question``, its gold ``answers`` (non-empty stripped strings) and
    its ``passages`` in order -- as the file gives them (``QAExample[Passage]``, what
    :mod:`kvrag.qa.files` reads) or as the prompt shows them (``QAExample[str]``, each passage
    one chunk: :func:`rendered`); its ``id`` and question ``type`` (``""`` where unknown)."""

    question: str
    answers: list[str]
    passages: list[P]
    id: str = ""
    type: str = ""


def rendered(ex: QAExample[Passage], sep: str = TITLE_LINE) -> QAExample[str]:
    """``ex`` with each passage as the prompt shows it (:func:`passage_text` with ``sep``)."""
    return QAExample(ex.question, ex.answers, [passage_text(t, x, sep) for t, x in ex.passages], ex.id, ex.type)
