"""What a benchmark record says of where it ran: the machine, the devices and the git commit."""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger("kvrag.bench")

log = logging.getLogger("kvrag.bench")


def machine_info(devices: Sequence[str]) -> dict:
    """What the numbers were measured on."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(mem, 1) if mem else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "devices": list(devices),
    }
    if any(d.startswith("cuda") for d in devices) and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def git_commit() -> str | None:
    head = Path(__file__).resolve().parents[2] / ".git"
    try:
        ref = (head / "HEAD").read_text().strip()
        if ref.startswith("ref: "):
            return (head / ref[5:]).read_text().strip()
        return ref
    except OSError:
        return None
