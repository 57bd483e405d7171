"""Token alignment: where, in the tokenizer's own ids of a whole prompt, a stored chunk's
token ids stand.

Segmentation (``kvrag.layout.segment``) finds a chunk's *characters* in the prompt; the prompt
is then tokenized once, whole, and a chunk is served only on the run of prompt tokens that
equal its stored ids on those characters (a tokenizer may merge a chunk's first or last token
with its neighbours). ``place_chunks`` walks a prompt's chunk spans in order and says, for
each, which prompt tokens it serves: the query path and the KVLink trainer both walk it, so a
training sequence is laid out exactly as a query is.

Ids are ``list[int]``; ``offsets`` are the prompt tokens' ``(start, end)`` character spans and
``starts`` their start characters (sorted), as ``prompt_tokens`` returns them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


def prompt_prefix(handle, text: str) -> list[int]:
    """The BOS ids the tokenizer would add before ``text`` (none if it starts with BOS):
    ``handle`` is a ``kvrag.model.ModelHandle``."""
    prefix = handle.prefix_ids()
    bos = handle.tokenizer.bos_token
    return [] if bos and text.startswith(bos) else list(prefix)


def spell_chunk(handle, text: str, newline_ids: Sequence[int]) -> list[int]:
    """Token ids of a chunk as the tokenizer spells it inside a prompt after a line break
    (``KVRag.chunk_ids`` without its checks); ``newline_ids``: ``handle.encode("\\n")``."""
    nl = list(newline_ids)
    ids = handle.encode("\n" + text)
    if nl and ids[: len(nl)] == nl and len(ids) > len(nl):
        return ids[len(nl) :]
    return handle.encode(text)  # the line break merged into the text's first token: spell the text alone


def chunk_token_starts(tokenizer, newline_ids: Sequence[int], text: str, chunk: list[int]) -> list[int] | None:
    """The character where each of a stored chunk's tokens (``chunk``, spelled as
    ``spell_chunk`` spells it) starts in ``text``; None if no tokenization of the text gives
    exactly these ids (then no token boundary of it can be trusted)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) == chunk:
        return [s for s, _ in enc["offset_mapping"]]
    # Spelled after a line break (SentencePiece tokenizers, without the first-word mark).
    nl = list(newline_ids)
    enc = tokenizer("\n" + text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if nl and ids[: len(nl)] == nl and ids[len(nl) :] == chunk:
        return [max(s - 1, 0) for s, _ in enc["offset_mapping"][len(nl) :]]
    return None


def match_chunk(
    tokenizer,
    newline_ids: Sequence[int],
    chunk: list[int],
    text: str,
    start: int,
    end: int,
    ids: list[int],
    offsets: list[tuple[int, int]],
    starts: list[int],
    lo: int,
    offset: int = 0,
) -> tuple[int, int, int]:
    """Where the prompt's tokens reuse a stored chunk (token ids ``chunk``, text ``text``),
    whose characters ``offset ..`` were found at the prompt's characters [start, end): prompt
    tokens ``j..j+m-1`` are its tokens ``k..k+m-1`` (m = 0: nowhere). ``ids`` / ``offsets`` /
    ``starts``: the prompt's tokens, their character spans and span starts; ``lo``: the first
    token not placed yet. Read through ``place_chunks``, which both the query path (``kvrag.query.lookup``) and the
    KVLink trainer walk, so training sequences are laid out as queries are."""
    j = bisect.bisect_left(starts, start, lo=lo)

    def run(j: int, k: int) -> int:
        # Equal ids from one shared boundary on cover equal characters, so a run that ends
        # inside [start, end) in the prompt ends inside the matched part of the chunk: a cut
        # chunk is served only up to its last whole token the prompt holds.
        m = 0
        while k + m < len(chunk) and j + m < len(ids) and ids[j + m] == chunk[k + m] and offsets[j + m][1] <= end:
            m += 1
        return m

    if not offset and not (j > 0 and offsets[j - 1][1] > start):
        m = run(j, 0)
        if m:
            return j, 0, m
    # The chunk's first token merged with what precedes it (" The" after "Context:"), or the
    # prompt holds the chunk from a later character on (its leading whitespace trimmed), or
    # the two tokenizations part at its first character: resume at the first token boundary
    # both share; the tokens there on are the chunk's (their K/V were computed behind the
    # chunk's own beginning).
    starts_in_chunk = chunk_token_starts(tokenizer, newline_ids, text, chunk)
    if starts_in_chunk is None:
        return j, 0, 0
    at: dict[int, list[int]] = {}
    for i, s in enumerate(starts_in_chunk):
        at.setdefault(s, []).append(i)
    while j < len(ids) and starts[j] < end:
        ks = at.get(starts[j] - start + offset)
        if ks is None:
            j += 1
            continue
        # Byte-level BPE splits a multi-byte character into several tokens that all start at
        # that character, and the prompt may have merged its first byte with the space before
        # it (" П" -> "ĠÐ", "Ł" where the chunk has "Ð", "Ł"): pair every prompt token and
        # chunk token starting there, and take the longest run of equal ids.
        here = range(j, bisect.bisect_right(starts, starts[j], lo=j))
        m, jj, k = max(((run(jj, k), jj, k) for jj in here for k in ks), key=lambda t: t[0])
        if m:
            return jj, k, m
        j = here.stop
    return j, 0, 0


def prompt_tokens(tokenizer, prompt: str) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """The tokenizer's ids of the whole ``prompt`` (no special tokens), their character spans
    and span starts: what ``match_chunk`` reads."""
    enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    return list(enc["input_ids"]), offsets, [a for a, _ in offsets]


def chunk_spans(segments: Iterable) -> Iterator:
    """``(segment, start, end)`` for each chunk segment of a split prompt (``Segmenter.split``):
    its characters [start, end) in the prompt."""
    pos = 0
    for seg in segments:
        start, end = pos, pos + len(seg.text)
        pos = end
        if seg.key is not None:
            yield seg, start, end


def token_inside(starts: list[int], offsets: list[tuple[int, int]], start: int, end: int, lo: int) -> bool:
    """Whether a prompt token from ``lo`` on lies inside characters [start, end): if none does
    (a short chunk text found inside a word), nothing of that chunk can be reused."""
    first = bisect.bisect_left(starts, start, lo=lo)
    return first < len(starts) and offsets[first][1] <= end


@dataclass
class Placement:
    """One chunk span of a prompt after alignment. ``status``: "placed" (prompt tokens
    ``j .. j+m-1`` are the chunk's stored tokens ``k .. k+m-1``), "unaligned" (no run of tokens
    shared, or no prompt token inside the span) or "missed" (``read`` found no entry).
    ``chunk``: the payload ``read`` returned for it (None unless placed)."""

    segment: Any
    status: str
    chunk: Any = None
    j: int = 0
    k: int = 0
    m: int = 0


def place_chunks(
    tokenizer,
    newline_ids: Sequence[int],
    ids: list[int],
    offsets: list[tuple[int, int]],
    starts: list[int],
    spans: Iterable,
    read: Callable[[Any], tuple[list[int], str, Any] | None],
) -> Iterator[Placement]:
    """Align each ``(segment, start, end)`` of ``spans`` (``chunk_spans``, in prompt order)
    with the prompt's tokens, left to right: a chunk is placed only after the tokens the
    previous one took. ``read(segment)`` returns the chunk as ``(stored token ids, text,
    payload)`` (ids spelled as ``spell_chunk`` spells them; ``payload`` is handed back in the
    placement), or None for a miss; it is called only for spans with a prompt token inside."""
    tok = 0  # first prompt token not placed yet
    for seg, start, end in spans:
        if not token_inside(starts, offsets, start, end, tok):
            yield Placement(seg, "unaligned")  # its entry is not even read
            continue
        got = read(seg)
        if got is None:
            yield Placement(seg, "missed")
            continue
        chunk_ids, text, payload = got
        j, k, m = match_chunk(
            tokenizer, newline_ids, chunk_ids, text, start, end, ids, offsets, starts, tok, seg.offset
        )
        if m == 0:
            yield Placement(seg, "unaligned")
            continue
        yield Placement(seg, "placed", payload, j, k, m)
        tok = j + m
