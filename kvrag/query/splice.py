"""A prompt's token ids from its parts, without tokenizing its cached chunks: the plain text
between chunks is tokenized in context and the chunks' stored ids are spliced in between.

Tokenizing a whole 16k-token prompt costs tens of milliseconds on the query path, while most
of its tokens belong to chunks whose ids are already stored. A tokenizer's ids are local but
not separable, though: a plain span tokenized alone is not tokenized as it is in the prompt
(byte-level BPE's pre-tokenizer keeps "\\n\\n" whole at the end of a string but splits it
before a word; Gemma 3's BPE splits no words before merging, so a merge may cross any seam; " The" after
"Context:" is one token), and a chunk's stored ids, spelled after a line break, need not be
what the prompt's context makes of its first or last characters.

So each plain span (the text before, between and after the chunks, empty ones included) is
tokenized together with the edge tokens of its neighbouring chunks (``context`` of them, the
cut at a character boundary, moved to a word boundary where one is near), and that
tokenization must *begin with the previous chunk's stored edge ids and end with the next
chunk's*: then the seams lie where the splice puts them, the chunks' ids hold on both sides
of each, and the tokens between are the plain span's in context. A window that does not begin
or end so (a chunk whose first token merges with what precedes it, a chunk found inside a
word) makes ``splice_ids`` return None, and the caller tokenizes the whole prompt instead.
What is tokenized is the plain text plus ~``2 * context`` tokens per chunk, in one batch call
(a Hugging Face fast tokenizer encodes a batch in parallel, in Rust); the edges' texts, which
place the windows' ends, are decoded in batch calls too.

Ids are ``list[int]``, without the BOS ids the tokenizer adds (``kvrag.layout.align.prompt_prefix``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CONTEXT_TOKENS", "Spliced", "seam_merges", "splice_ids"]

#: Stored tokens of a chunk tokenized with each plain span beside it. A seam of the supported
#: tokenizers is decided within a pre-token or two (a BPE word, a whitespace run and the
#: lookahead of the pattern that splits it); four tokens hold those with room.
CONTEXT_TOKENS = 4

#: How many more tokens an edge may take to end at a word boundary (or at a character
#: boundary at all: a byte-level token can end inside a multi-byte character).
_EDGE_STEPS = 8


@dataclass(frozen=True)
class Spliced:
    """The prompt's ids ``ids`` (the tokenizer's own, proved seam by seam); ``offsets``: each
    token's character span, as the tokenizer gives it for a plain span's tokens, the whole
    chunk's ``(start, end)`` for a spliced chunk's (sorted by start, as
    ``kvrag.layout.align.place_chunks`` reads them); ``starts``: per chunk given to
    ``splice_ids``, the index in ``ids`` of its first token."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    starts: list[int]


def seam_merges(prompt: str, start: int, end: int) -> bool:
    """Whether the characters beside a chunk at ``prompt[start:end]`` say that a seam of it
    will not hold (a cheap guess before its entry is read; ``splice_ids`` proves the others):
    a space or a letter/digit before its first non-space character (" The" is one token, for
    byte-level BPE and SentencePiece alike), or a letter/digit on both sides of its end (a
    word that goes on)."""
    if start > 0 and not prompt[start].isspace() and (prompt[start - 1] == " " or prompt[start - 1].isalnum()):
        return prompt[start - 1] == " " or prompt[start].isalnum()
    return end < len(prompt) and prompt[end - 1].isalnum() and prompt[end].isalnum()


def _decode_batch(tokenizer, seqs: list[list[int]]) -> list[str]:
    """The texts of ``seqs`` exactly (no clean-up of spaces before punctuation), in one call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch(seqs, skip_special_tokens=False)
    return tokenizer.batch_decode(seqs, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _edges(tokenizer, prompt: str, chunks: Sequence[tuple[int, int, list[int]]], context: int):
    """Per chunk at ``prompt[start:end]``, its first and its last ``k`` >= ``context`` stored
    tokens whose text is the prompt's there, and that text's length: ``(k, chars)`` for the
    head and for the tail, or None for a chunk with no such cut. The cut is taken at a word
    boundary (whitespace right after a head, at the start of a tail, or before the cut) where
    one is within ``_EDGE_STEPS`` more tokens: a word cut in two can tokenize otherwise alone.
    A cut inside a character fails (its bytes decode to U+FFFD). Candidate cuts are decoded in
    batch calls."""
    found: dict[tuple[int, bool], tuple[int, int]] = {}
    first: dict[tuple[int, bool], tuple[int, int]] = {}
    # Two rounds: the cut at ``context`` tokens (at a word boundary for most edges of prose),
    # then the further ones for the edges still without a cut at a word boundary.
    for ks in (range(context, context + 1), range(context + 1, context + _EDGE_STEPS + 1)):
        seqs: list[list[int]] = []
        where: list[tuple[int, bool, int]] = []  # (chunk, head, k) of each candidate
        for c, (_, _, ids) in enumerate(chunks):
            n = len(ids)
            for k in ks:
                if k >= n:
                    break
                for head in (True, False):
                    if (c, head) not in found:
                        seqs.append(ids[:k] if head else ids[n - k :])
                        where.append((c, head, k))
        if not seqs:
            break
        for (c, head, k), text in zip(where, _decode_batch(tokenizer, seqs), strict=True):
            if (c, head) in found:
                continue
            start, end, _ = chunks[c]
            at = start + len(text) if head else end - len(text)
            if not text or not start < at < end or not prompt.startswith(text, start if head else at):
                continue
            first.setdefault((c, head), (k, len(text)))
            if (prompt[at].isspace() if head else text[0].isspace()) or prompt[at - 1].isspace():
                found[(c, head)] = (k, len(text))
    out: list[tuple[tuple[int, int], tuple[int, int]] | None] = []
    for c, (start, end, ids) in enumerate(chunks):
        whole = (len(ids), end - start)
        if len(ids) <= context:
            out.append((whole, whole))
            continue
        # A cut at a word boundary, else at any character boundary, else (a short chunk) none.
        h = found.get((c, True)) or first.get((c, True)) or (whole if len(ids) <= context + _EDGE_STEPS else None)
        t = found.get((c, False)) or first.get((c, False)) or (whole if len(ids) <= context + _EDGE_STEPS else None)
        out.append((h, t) if h is not None and t is not None else None)
    return out


def splice_ids(
    tokenizer, prompt: str, chunks: Sequence[tuple[int, int, Sequence[int]]], context: int = CONTEXT_TOKENS
) -> Spliced | None:
    """The tokenizer's ids of ``prompt`` (no special tokens added), built from ``chunks``
    without tokenizing them: ``(start, end, ids)`` per cached chunk, in prompt order and not
    overlapping, ``ids`` the stored token ids of ``prompt[start:end]`` (spelled as
    ``kvrag.layout.align.spell_chunk`` spells them). None where a seam does not check out (see
    the module docstring): the caller then tokenizes the whole prompt.

    ``tokenizer``: a Hugging Face tokenizer (its Rust backend decodes, where it has one)."""
    if not chunks:
        return None
    pos = 0
    for start, end, ids in chunks:
        if start < pos or end <= start or not len(ids):
            return None
        pos = end
    chunk_ids = [ids if isinstance(ids, list) else [int(i) for i in ids] for _, _, ids in chunks]
    edges = _edges(tokenizer, prompt, [(a, b, ids) for (a, b, _), ids in zip(chunks, chunk_ids, strict=True)], context)
    if any(e is None for e in edges):
        return None
    heads = [e[0] for e in edges if e is not None]
    tails = [e[1] for e in edges if e is not None]
    # Window g: the last tokens of chunk g-1, the plain text after it, the first tokens of chunk g.
    texts = []
    for g in range(len(chunks) + 1):
        a = chunks[g - 1][1] - tails[g - 1][1] if g else 0
        b = chunks[g][0] + heads[g][1] if g < len(chunks) else len(prompt)
        texts.append(prompt[a:b])
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out: list[int] = []
    offsets: list[tuple[int, int]] = []
    starts = []
    for g, (got, spans) in enumerate(zip(enc["input_ids"], enc["offset_mapping"], strict=True)):
        got = list(got)
        left = chunk_ids[g - 1][len(chunk_ids[g - 1]) - tails[g - 1][0] :] if g else []
        right = chunk_ids[g][: heads[g][0]] if g < len(chunks) else []
        if len(got) < len(left) + len(right) or got[: len(left)] != left or got[len(got) - len(right) :] != right:
            return None
        a = chunks[g - 1][1] - tails[g - 1][1] if g else 0
        out.extend(got[len(left) : len(got) - len(right)])
        offsets.extend((a + x, a + y) for x, y in spans[len(left) : len(got) - len(right)])
        if g < len(chunks):
            start, end, _ = chunks[g]
            starts.append(len(out))
            out.extend(chunk_ids[g])
            offsets.extend([(start, end)] * len(chunk_ids[g]))
    return Spliced(out, offsets, starts)
