"""Checks of the paths a command will write to, made before any expensive work.

A command that loads a model, runs a benchmark or trains for an hour must not find out only
at the end that its output cannot be written (the results would be lost). These checks leave
nothing behind: they look at what exists and whether a file can be made in it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvrag.errors import KVRagError


def _first_existing(p: Path) -> Path:
    """``p`` or its nearest ancestor that exists."""
    q = p
    while not (q.exists() or q.is_symlink()) and q != q.parent:
        q = q.parent
    return q


def _writable(d: Path) -> bool:
    """Whether files can be created in directory ``d``: a temporary file is made and removed
    (``os.access`` says yes to root everywhere, read-only mounts and /proc included)."""
    try:
        with tempfile.TemporaryFile(dir=d):
            return True
    except OSError:
        return False


def check_dir(path: str | os.PathLike, what: str, error: type[Exception] = KVRagError) -> Path:
    """``path`` is a writable directory, or one that can be created (its nearest existing
    ancestor is a writable directory). Raises ``error`` naming ``what`` (e.g. ``--out``) and the
    problem otherwise; returns the path (``~`` expanded)."""
    p = Path(path).expanduser()
    if p.exists() or p.is_symlink():
        if not p.is_dir():
            raise error(f"{what} {p}: exists and is not a directory")
        if not _writable(p):
            raise error(f"{what} {p}: the directory is not writable")
        return p
    anc = _first_existing(p.absolute().parent)
    if not anc.is_dir():
        raise error(f"{what} {p}: cannot create it, {anc} is not a directory")
    if not _writable(anc):
        raise error(f"{what} {p}: cannot create it, {anc} is not writable")
    return p


def check_file(path: str | os.PathLike, what: str, error: type[Exception] = KVRagError) -> Path:
    """``path`` names a file that can be written: not a directory, writable if it exists, in a
    directory that is writable or can be created."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise error(f"{what} {p}: is a directory, expected a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise error(f"{what} {p}: the file is not writable")
    parent = p.absolute().parent
    anc = _first_existing(parent)
    if not anc.is_dir():
        raise error(f"{what} {p}: cannot create it, {anc} is not a directory")
    if not _writable(anc):
        raise error(f"{what} {p}: cannot write it, {anc} is not writable")
    return p
