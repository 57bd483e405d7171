"""The QA scenario's resume journal: where it lives and how its header records the configuration."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("kvrag.bench")

log = logging.getLogger("kvrag.bench")

#: The QA scenario's journal: one JSON line per finished example, after a header naming the
#: configuration, so an interrupted run (hours on a CPU) continues with ``resume`` instead of
#: starting over. Options that only say where results go, or how many examples, may differ.
JOURNAL_FORMAT = 1
NOT_IN_JOURNAL_IDENTITY = ("out", "report", "command", "limit", "cache_dir", "resume")


def journal_path(out: str | os.PathLike, device: str, dataset: str) -> Path:
    """Where the QA journal of ``dataset`` on ``device`` lives in the output directory."""
    return Path(out) / re.sub(r"[^\w.-]", "_", f"qa_journal.{device}.{dataset}.jsonl")


def jsonable(x):
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x
