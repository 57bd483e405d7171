"""The resume journal of the QA and sweep scenarios: where it lives and how its header
records the configuration."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from kvrag.bench.config import BenchConfig, Run
from kvrag.qa.example import QAExample

#: A scenario's journal (QA, sweep): one JSON line per finished example, after a header naming the
#: configuration, so an interrupted run (hours on a CPU) continues with ``resume`` instead of
#: starting over. Options that only say where results go, or how many examples, may differ.
JOURNAL_FORMAT = 1
NOT_IN_JOURNAL_IDENTITY = ("out", "report", "command", "limit", "cache_dir", "resume")


def journal_path(out: str | os.PathLike, device: str, dataset: str, scenario: str = "qa") -> Path:
    """Where the ``scenario``'s journal of ``dataset`` on ``device`` lives in the output directory."""
    return Path(out) / re.sub(r"[^\w.-]", "_", f"{scenario}_journal.{device}.{dataset}.jsonl")


def jsonable(x):
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def journal_identity(cfg: BenchConfig, device: str, dataset: str, model_info: dict, runs: list[Run]) -> dict:
    """The journal's header: what a resumed run must share with the one that wrote it."""
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_JOURNAL_IDENTITY}
    ident = {
        "format": JOURNAL_FORMAT,
        "device": device,
        "dataset": dataset,
        "model": model_info.get("fingerprint"),
        "kvlink_adapter": model_info.get("kvlink_adapter"),
        "runs": [r.label for r in runs],
        "config": jsonable(config),
    }
    return json.loads(json.dumps(ident, default=str))  # as it reads back: tuples are lists


def journal_key(i: int, ex: QAExample[str]) -> str:
    """The journal's key of the ``i``-th example ``ex`` of a dataset."""
    return f"{i}:{ex.id}"


def open_journal(path: Path, ident: dict, resume: bool) -> dict[str, list[dict]]:
    """{example key: its records} already finished in the journal at ``path``, which is then
    (re)written with the header ``ident`` and those examples' lines. Without ``resume`` the
    journal starts anew; with it, a journal of another configuration is an error and a line
    torn by the interruption is dropped."""
    done: dict[str, list[dict]] = {}
    kept: list[str] = []
    if resume and path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        try:
            head = json.loads(lines[0])["journal"] if lines else None
        except (json.JSONDecodeError, KeyError, TypeError):
            head = None
        if head != ident:
            differ = sorted(
                k
                for k in ident["config"]
                if not isinstance(head, dict) or (head.get("config") or {}).get(k) != ident["config"][k]
            )
            differ += [k for k in ident if k != "config" and (not isinstance(head, dict) or head.get(k) != ident[k])]
            raise ValueError(
                f"--resume: {path} was written by another run configuration (differs in: "
                f"{', '.join(differ) or 'its header'}); use another --out, or run without --resume"
            )
        for line in lines[1:]:
            try:
                row = json.loads(line)
                done[str(row["key"])] = list(row["records"])
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # the line the interrupted run was writing, and nothing after it
            kept.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([json.dumps({"journal": ident})] + kept) + "\n", encoding="utf-8")
    return done


def append_to_journal(path: Path, key: str, records: list[dict]) -> None:
    """One finished example's line, on disk (fsync) before the next example starts."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"key": key, "records": records}, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
