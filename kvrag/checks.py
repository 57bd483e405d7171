"""Argument checks shared across kvrag: numbers and sequences of policy and engine options,
chunk texts and iterables of them. Each raises with a message naming the argument and what
was wrong with it, before any work is done."""

from __future__ import annotations

import numbers
from typing import Any

from kvrag.errors import ChunkError


def check_real(name: str, x, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> float:
    """``x`` as a float if it is a real number (not a bool, not a string) in [lo, hi] (or
    (lo, hi] with ``lo_open``); else ValueError naming the parameter. A string such as "0.5"
    would pass float() and fail deep inside a policy."""
    rng = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
    ok = not isinstance(x, bool) and isinstance(x, numbers.Real) and x == x
    if ok:
        x = float(x)
        ok = (lo is None or (x > lo if lo_open else x >= lo)) and (hi is None or x <= hi)
    if not ok:
        raise ValueError(f"{name} must be a number in {rng}, got {x!r}")
    return x


def check_int(name: str, x, lo: int | None = 0) -> int:
    """``x`` as an int if it is an integer value >= ``lo`` (None: any) (2.0 passes; a bool,
    string, 2.5 or inf does not); else ValueError naming the parameter."""
    ok = not isinstance(x, bool) and isinstance(x, numbers.Real) and x == x and abs(x) != float("inf")
    if not (ok and int(x) == x and (lo is None or int(x) >= lo)):
        raise ValueError(f"{name} must be an integer{'' if lo is None else f' >= {lo}'}, got {x!r}")
    return int(x)


def is_integer_dtype(dtype: Any) -> bool:
    """Whether a torch dtype holds integers: not a float, complex or bool dtype (read from the
    dtype itself, so this module needs no torch import)."""
    return not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")


def check_token_ids(name: str, ids: Any, vocab: int) -> list[int]:
    """``ids`` (a sequence of ints, or a 1-D integer tensor) as a list of token ids in
    ``[0, vocab)``; else ValueError naming ``name`` and the first bad id. A float would be
    truncated, a negative id would index from the end, and one past the vocabulary raises
    IndexError deep inside the model."""
    if hasattr(ids, "dtype") and hasattr(ids, "dim"):  # a tensor
        if ids.dim() != 1 or not is_integer_dtype(ids.dtype):
            raise ValueError(
                f"{name} must be a 1-D sequence of int token ids, got a tensor of shape {tuple(ids.shape)} "
                f"dtype {ids.dtype}"
            )
        ids = ids.tolist()
    ids = list(check_seq(name, ids, "a sequence of int token ids"))
    for t, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= int(x) < vocab:
            raise ValueError(f"{name}: {x!r} at position {t} is not a token id of this model (an int in [0, {vocab}))")
    return [int(x) for x in ids]


def check_seq(name: str, x, what: str):
    """``x`` if it is a sequence (iterable, not a string); else ValueError saying ``name`` must
    be ``what``. Its entries are the caller's to check."""
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        raise ValueError(f"{name} must be {what}, got {x!r}")
    return x


def validate_chunk_text(text: Any) -> str:
    """Check what can be checked without tokenizing; returns ``text`` or raises ChunkError.

    A lone surrogate (e.g. from bytes decoded with ``errors="surrogateescape"``) is not valid
    Unicode: the tokenizer would reject it with an obscure TypeError, so it is named here."""
    if not isinstance(text, str):
        raise ChunkError(
            f"chunk must be a str, got {type(text).__name__}"
            + (
                " (decode bytes first, e.g. data.decode('utf-8', errors='replace'))"
                if isinstance(text, (bytes, bytearray))
                else ""
            )
        )
    if not text.strip():
        raise ChunkError("empty chunk: a chunk must contain non-whitespace text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ChunkError(
            f"chunk contains an unpaired surrogate {text[e.start]!r} at character {e.start}: not valid "
            "Unicode text; decode the source with errors='replace' (or fix its encoding)"
        ) from None
    return text


def check_texts_iterable(texts: Any, where: str, hint: str = "") -> None:
    """Raise TypeError unless ``texts`` is an iterable of texts: a bare str/bytes is iterable
    too, and would be cached one character (or byte) at a time. ``hint``: appended to the
    message for a single text (another call that takes one)."""
    if isinstance(texts, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"{where}() takes an iterable of texts, got a single {type(texts).__name__}: "
            f"pass a list ({where}([text])){hint}"
        )
    try:
        iter(texts)
    except TypeError:
        raise TypeError(f"{where}() takes an iterable of texts, got {type(texts).__name__}") from None
