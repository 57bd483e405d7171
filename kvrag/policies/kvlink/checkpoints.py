"""Checkpoints of a KVLink training run, so a run cut short resumes where it stopped and computes
what an uninterrupted one does.

A checkpoint (:data:`CHECKPOINT_DIR` in the adapter's directory) holds the LoRA and link weights,
the optimizer and scheduler, both RNGs (the Python one is the data cursor), the step and the
:class:`Progress` so far, next to what a resume must match: the options that change a step and
the data's digests (``identity``).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvrag.policies.kvlink.adapter import KVLinkError
from kvrag.policies.kvlink.config import TrainConfig

CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_FILE = "state.pt"
_CKPT_CONFIG = "config.json"
# Options a resumed sitting may change: they decide when a sitting stops, what it prints or
# how a step is run (``batched``: the same step, up to float rounding), not what it computes.
_PER_SITTING = ("max_seconds", "log_every", "batched")


@dataclass
class Progress:
    """What a run has done so far (checkpointed, and recorded in ``kvlink.json``): the loss of
    each step, the samples skipped as too long, the link-table rows some sample used (the rest
    keep their initial value), the samples drawn per source, and each sitting of a resumed run
    (its command and the steps it ran). ``start``: the step the current sitting began at."""

    losses: list[float] = field(default_factory=list)
    skipped: int = 0
    trained_rows: int = 0
    source_counts: dict[str, int] = field(default_factory=dict)
    sittings: list[dict] = field(default_factory=list)
    start: int = 0


def resumable_config(cfg: TrainConfig) -> dict:
    """The options a resumed run must share with its checkpoint's."""
    return {k: v for k, v in cfg.as_record().items() if k not in _PER_SITTING}


def has_checkpoint(out_dir: Path) -> bool:
    return (out_dir / CHECKPOINT_DIR / CHECKPOINT_FILE).is_file()


def _lora_state(peft_model) -> dict:
    if peft_model is None:
        return {}
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(peft_model).items()}


def _rng_state(state) -> tuple:
    """``random.Random.getstate()`` as saved (its tuples may come back as lists)."""
    version, internal, gauss = state
    return (int(version), tuple(int(x) for x in internal), gauss)


def training_state(
    step: int, progress: Progress, peft_model, links: torch.Tensor, opt, sched, rng: random.Random
) -> dict[str, Any]:
    """Everything a resume restores after ``step`` steps (``links`` [max_docs, K, E])."""
    return {
        "lora": _lora_state(peft_model),
        "links": links.detach().cpu(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "py_rng": rng.getstate(),
        "step": step,
        "losses": torch.tensor(progress.losses, dtype=torch.float64),
        "skipped": progress.skipped,
        "trained_rows": progress.trained_rows,
        "source_counts": json.dumps(progress.source_counts),
        "sittings": json.dumps(progress.sittings),
    }


def restore(ckpt: dict, peft_model, links: torch.nn.Parameter, opt, sched, rng: random.Random) -> Progress:
    """Put a loaded checkpoint's weights, optimizer, scheduler and RNGs back; its progress."""
    if peft_model is not None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(peft_model, ckpt["lora"])
    with torch.no_grad():
        links.copy_(ckpt["links"].to(links.device))
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    torch.set_rng_state(ckpt["torch_rng"])
    rng.setstate(_rng_state(ckpt["py_rng"]))
    return Progress(
        losses=[float(x) for x in ckpt["losses"]],
        skipped=int(ckpt["skipped"]),
        trained_rows=int(ckpt["trained_rows"]),
        source_counts={str(k): int(v) for k, v in json.loads(ckpt["source_counts"]).items()},
        sittings=json.loads(ckpt["sittings"]),
        start=int(ckpt["step"]),
    )


def save_checkpoint(out_dir: Path, identity: dict, state: dict) -> None:
    """Write ``out_dir/checkpoint/``: what a resume must match (options, data digests), then
    the state (atomically: a crash mid-write leaves the previous checkpoint)."""
    d = out_dir / CHECKPOINT_DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / _CKPT_CONFIG).write_text(json.dumps(identity, indent=1, default=str), encoding="utf-8")
    tmp = d / f".{CHECKPOINT_FILE}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, d / CHECKPOINT_FILE)


def load_checkpoint(out_dir: Path, identity: dict) -> dict:
    """The checkpoint in ``out_dir`` (a KVLinkError naming what is wrong: none, another run's
    options or data, unreadable). Loaded with ``weights_only``: a checkpoint is data, never code."""
    d = out_dir / CHECKPOINT_DIR
    if not (d / CHECKPOINT_FILE).is_file():
        raise KVLinkError(f"nothing to resume: {d} holds no checkpoint ({CHECKPOINT_FILE})")
    try:
        saved = json.loads((d / _CKPT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise KVLinkError(f"cannot read the checkpoint's {_CKPT_CONFIG} in {d}: {e}") from None
    now = json.loads(json.dumps(identity, default=str))
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if diff:
        show = lambda v: repr(v) if len(repr(v)) <= 80 else "<another value>"  # noqa: E731 - data digests are long
        raise KVLinkError(
            "the checkpoint in "
            + str(d)
            + " was made with other options or data: "
            + ", ".join(f"{k}={show(saved.get(k))} (now {show(now.get(k))})" for k in diff)
            + "; resume with the same ones"
        )
    try:
        return torch.load(d / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem
        raise KVLinkError(f"cannot read the checkpoint {d / CHECKPOINT_FILE}: {type(e).__name__}: {e}") from None
