"""Find cached chunk texts, verbatim, inside a final prompt string.

A RAG framework hands kvrag the *rendered* prompt (template + retrieved chunks + question). The
``Segmenter`` splits it into ordered segments, plain text | cached chunk, by an exact multi-pattern
search (Aho-Corasick, ``pyahocorasick``) over every registered chunk text. Only exact matches
count: a chunk is reused only if its text appears character for character (no normalisation),
because its stored K/V belong to exactly those tokens.

Matching rule: non-overlapping, leftmost-first, and at one start the longest registered text.

Partial matches (``Segmenter(partial=True)``, what ``KVRag`` uses): frameworks hand over chunk
texts that are *almost* the registered ones -- cut to fit a context window (LlamaIndex repacking,
a ``[:n]`` in a format function), or with their edge whitespace trimmed (``strip()`` in a
format function or a synthesizer, a chat template's ``| trim``). Whole-text matching loses the
whole chunk then. In partial mode a registered text also matches where the prompt holds only
its beginning (a prefix of at least ``min_partial_chars`` characters, or all of its
non-whitespace content), and its leading whitespace may be missing. The segment then says
which characters of the chunk it holds (``offset``) and that it is ``partial``; the engine
serves only the chunk tokens the prompt's own tokenization shares on those characters. A prefix
of a chunk is exact reuse: a token's K/V depend only on the tokens before it.

Why not ``Automaton.iter_long``: in pyahocorasick 2.3.1 it drops matches (e.g. patterns
``{"b", "abb"}`` on ``"xab"`` find nothing: it follows the ``ab…`` path, hits the end, and never
falls back to ``b``), so we take every occurrence from ``iter()`` and pick leftmost-longest
ourselves — linear in the prompt plus the number of occurrences.

Memory/speed at 100k chunks: only each text's first ``anchor_chars`` characters go into the
automaton (a trie of whole chunks would cost ~40 bytes per character: gigabytes for 100k
paragraphs); an anchor hit is then confirmed with an exact ``str.startswith`` of the full text.
A prefix of a match is always found, so this is still exact. Texts added after the last build go
into a small *delta* automaton, so a background precompute worker that adds a chunk between
every two queries does not force a full rebuild per query; the main automaton is rebuilt once
the delta (or the set of removed-but-still-indexed texts) grows past a size that amortises it.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import ahocorasick

from kvrag.checks import check_int

__all__ = ["Segment", "Segmenter"]


@dataclass(frozen=True)
class Segment:
    """One piece of a prompt: ``key`` is the store key of a cached chunk, None for plain text.

    A cached segment's ``text`` is the chunk's characters ``offset .. offset + len(text)``;
    ``partial``: the prompt holds only that part of the chunk (a partial match), not all of it."""

    text: str
    key: str | None = None
    offset: int = 0
    partial: bool = False

    @property
    def cached(self) -> bool:
        return self.key is not None


def _lead(text: str) -> int:
    """Length of ``text``'s leading whitespace."""
    return len(text) - len(text.lstrip())


class _Index:
    """An immutable Aho-Corasick automaton over the anchors of a fixed set of texts.

    ``groups[i] = (anchor_len, members)``: the ``(text, offset)`` variants sharing anchor
    ``i``, longest ``text[offset:]`` first. A text's variant at offset 0 is the text itself; in
    partial mode a text with leading whitespace also gets one at the end of that whitespace (the
    text as a ``strip()`` leaves it), and anchors stop before trailing whitespace, so a text
    whose trailing whitespace was cut is still found. Never mutated after construction
    (pyahocorasick invalidates running iterators on mutation)."""

    __slots__ = ("automaton", "groups", "texts")

    def __init__(self, texts, anchor_chars: int, partial: bool = False):
        self.texts = frozenset(texts)
        by_anchor: dict[str, list[tuple[str, int]]] = {}
        for t in self.texts:
            if not partial:
                by_anchor.setdefault(t[:anchor_chars], []).append((t, 0))
                continue
            lead = _lead(t)
            core = len(t.rstrip())  # the anchor must not need trailing whitespace
            for off in (0, lead) if lead else (0,):
                by_anchor.setdefault(t[off : off + min(anchor_chars, core - off)], []).append((t, off))
        self.groups: list[tuple[int, tuple[tuple[str, int], ...]]] = []
        self.automaton = None
        if not by_anchor:
            return
        # STORE_INTS keeps one machine int per word instead of a Python object.
        a = ahocorasick.Automaton(ahocorasick.STORE_INTS)
        for anchor, members in by_anchor.items():
            members.sort(key=lambda m: len(m[0]) - m[1], reverse=True)
            a.add_word(anchor, len(self.groups))
            self.groups.append((len(anchor), tuple(members)))
        a.make_automaton()
        self.automaton = a

    def __len__(self) -> int:
        return len(self.texts)

    def candidates(self, prompt: str, out: dict[int, list[tuple[tuple[str, int], ...]]]) -> None:
        """Append, per start offset in ``prompt``, the text groups whose anchor occurs there."""
        if self.automaton is None:
            return
        groups = self.groups
        for end, gi in self.automaton.iter(prompt):
            anchor_len, members = groups[gi]
            out.setdefault(end - anchor_len + 1, []).append(members)


def _check_text(key, text) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"chunk key must be a non-empty str, got {key!r}")
    if not isinstance(text, str):
        raise TypeError(f"chunk text for key {key!r} must be a str, got {type(text).__name__}")
    if not text.strip():
        # An empty or whitespace-only "chunk" would match between/inside every word of every
        # prompt and shred it into bogus cached segments.
        raise ValueError(
            f"chunk text for key {key!r} is {'empty' if not text else 'whitespace-only'}: "
            "only texts with non-whitespace characters can be registered"
        )


class Segmenter:
    """Multi-pattern exact search over the registered chunk texts (pyahocorasick automaton).

    ``texts`` maps store key -> chunk text. Several keys may share one text; the most recently
    added key wins, and removing it falls back to the previous one still registered.
    Thread-safe: ``split`` may run in several threads while another ``add``s; the automaton is
    (re)built lazily, under the lock, by the first ``split`` after a change.

    ``partial``: also match a text the prompt holds only in part (see ``split``);
    ``min_partial_chars``: the shortest cut match taken (>= ``anchor_chars``, below which a
    cut text could not be found by its anchor)."""

    # The delta automaton is rebuilt on each split after a change, the main one only when the
    # delta passes ~DELTA_FACTOR*sqrt(N) texts: that balances the per-query delta rebuild
    # (O(delta)) against the amortised full rebuild (O(N) every delta-cap additions).
    DELTA_MIN = 256
    DELTA_FACTOR = 4

    def __init__(
        self,
        texts: Mapping[str, str] | None = None,
        *,
        anchor_chars: int = 32,
        partial: bool = False,
        min_partial_chars: int = 64,
    ):
        anchor_chars = check_int("anchor_chars", anchor_chars, 1)
        # Below the anchor length a partial match could not be found by its anchor.
        min_partial_chars = check_int("min_partial_chars", min_partial_chars, anchor_chars)
        self.anchor_chars = anchor_chars
        self.partial = bool(partial)
        self.min_partial_chars = min_partial_chars
        self._lock = threading.Lock()
        self._key_text: dict[str, str] = {}
        # key -> ``_version`` of its latest add: ``update(since=)`` keeps keys added after a
        # snapshot was taken (see ``update``).
        self._added_at: dict[str, int] = {}
        self._version = 0
        # text -> its keys in add order (dict as an ordered set); the last one is the winner.
        self._text_keys: dict[str, dict[str, None]] = {}
        self._main = _Index((), anchor_chars, self.partial)
        self._delta = _Index((), anchor_chars, self.partial)
        self._delta_texts: set[str] = set()  # live texts not in the main index
        self._stale = 0  # texts in the main index that are no longer live
        self._delta_dirty = False
        if texts:
            self.update(texts)

    # ---- registration ----------------------------------------------------------------
    def add(self, key: str, text: str) -> None:
        """Register ``text`` under ``key`` (re-adding moves the key to "most recent")."""
        _check_text(key, text)
        with self._lock:
            self._add(key, text)

    def remove(self, key: str) -> None:
        """Forget ``key``; an unknown key is a no-op (the store may have evicted it already)."""
        with self._lock:
            self._remove(key)

    def version(self) -> int:
        """A counter that every ``add`` advances: take it *before* reading a snapshot that is
        then passed to ``update(..., since=...)``."""
        with self._lock:
            return self._version

    def update(self, texts: Mapping[str, str], *, since: int | None = None) -> None:
        """Make the registered mapping exactly ``texts``: add new/changed keys, drop missing ones.

        Unchanged keys keep their order, and nothing is rebuilt when nothing changed.

        ``since``: the ``version()`` taken before ``texts`` was read. A key added after that
        is newer than the snapshot and is left as it is, neither dropped nor changed: a query
        re-reading the store's text index while the precompute worker stores and adds a chunk
        would otherwise drop that chunk again, and queries would miss it until the next
        re-read."""
        if not isinstance(texts, Mapping):
            raise TypeError(f"update() takes a Mapping key -> text, got {type(texts).__name__}")
        # Validate everything first so a bad entry leaves the segmenter untouched.
        for k, t in texts.items():
            _check_text(k, t)
        with self._lock:

            def older(k: str) -> bool:
                return since is None or self._added_at.get(k, -1) <= since

            for k in [k for k in self._key_text if k not in texts and older(k)]:
                self._remove(k)
            for k, t in texts.items():
                if self._key_text.get(k) != t and older(k):
                    self._add(k, t)

    def __len__(self) -> int:
        """Number of registered keys."""
        with self._lock:
            return len(self._key_text)

    def _add(self, key: str, text: str) -> None:
        self._version += 1
        self._added_at[key] = self._version
        old = self._key_text.get(key)
        if old == text:
            keys = self._text_keys[text]
            del keys[key]
            keys[key] = None  # move to last: the later add wins; the indexed texts are unchanged
            return
        if old is not None:
            self._remove(key)
        self._key_text[key] = text
        known = self._text_keys.get(text)
        if known is None:
            self._text_keys[text] = {key: None}
            self._text_became_live(text)
        else:
            known[key] = None  # appended last: this key now wins for the text

    def _remove(self, key: str) -> None:
        self._added_at.pop(key, None)
        text = self._key_text.pop(key, None)
        if text is None:
            return
        keys = self._text_keys[text]
        del keys[key]
        if not keys:
            del self._text_keys[text]
            self._text_died(text)

    def _text_became_live(self, text: str) -> None:
        if text in self._main.texts:
            self._stale -= 1  # still indexed from before its removal: nothing to rebuild
        else:
            self._delta_texts.add(text)
            self._delta_dirty = True

    def _text_died(self, text: str) -> None:
        if text in self._delta_texts:
            self._delta_texts.discard(text)
            self._delta_dirty = True
        else:
            # Left in the main automaton: its hits are filtered out at verification until the
            # next full rebuild.
            self._stale += 1

    def _refresh(self) -> None:
        """Bring the automata up to date with the registered texts (caller holds the lock)."""
        n = len(self._main)
        cap = max(self.DELTA_MIN, self.DELTA_FACTOR * math.isqrt(n))
        if len(self._delta_texts) > cap or self._stale > max(self.DELTA_MIN, n // 2):
            self._main = _Index(self._text_keys.keys(), self.anchor_chars, self.partial)
            self._delta = _Index((), self.anchor_chars, self.partial)
            self._delta_texts.clear()
            self._stale = 0
            self._delta_dirty = False
        elif self._delta_dirty:
            self._delta = _Index(self._delta_texts, self.anchor_chars, self.partial)
            self._delta_dirty = False

    # ---- search ----------------------------------------------------------------------
    def split(self, prompt: str) -> list[Segment]:
        """Split ``prompt`` into plain and cached segments whose texts concatenate to it.

        Cached segments are the registered texts found verbatim, non-overlapping,
        leftmost-first and longest at one start; plain text between them is one segment; no
        segment is empty (an empty prompt gives ``[]``).

        Partial mode (``partial=True``): at a start, a registered text ``t`` also matches
        ``t[o:]`` (``o``: 0, or the end of ``t``'s leading whitespace) where the prompt holds
        only a prefix of it, of at least ``min(min_partial_chars, len(t[o:].rstrip()))``
        characters (a cut chunk, or one whose edge whitespace was trimmed). The longest match
        at a start, not counting its trailing whitespace, wins; among equally long ones one at
        offset 0, then a whole ``t[o:]`` over a cut one, then the shorter text, then the
        smaller one (so the choice never depends on the order texts were added). A cut match
        ends before the first start inside it whose own match ends past it (the next chunk,
        whose beginning the cut text happens to go on with), if it is still long enough then;
        if not, the later match is taken instead."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        with self._lock:
            self._refresh()
            cands: dict[int, list[tuple[tuple[str, int], ...]]] = {}
            self._main.candidates(prompt, cands)
            self._delta.candidates(prompt, cands)
            live = self._text_keys
            out: list[Segment] = []
            pos = 0
            starts = sorted(cands)
            found: dict[int, tuple[str, int, int] | None] = {}

            def best_at(s: int):
                if s not in found:
                    found[s] = self._best(prompt, s, cands[s], live)
                return found[s]

            for i, start in enumerate(starts):
                if start < pos:
                    continue  # inside the match just taken: matches never overlap
                if not self.partial:
                    best = self._best_whole(prompt, start, cands[start], live)
                else:
                    best = best_at(start)
                    # A cut match runs as far as the prompt goes on like the chunk, which may be
                    # into the next chunk (the cut chunk's next paragraph starts like it: "\n\nThe
                    # "). A match starting in that tail and ending past it is the prompt's own next
                    # chunk: the cut ends where it starts instead of swallowing its beginning.
                    while best is not None and best[2] < len(best[0]) - best[1]:
                        end = start + best[2]
                        block = next(
                            (
                                s
                                for s in starts[i + 1 : bisect.bisect_left(starts, end, i + 1)]
                                if (b := best_at(s)) is not None and s + b[2] > end
                            ),
                            None,
                        )
                        if block is None:
                            break
                        best = self._best(prompt, start, cands[start], live, limit=block - start)
                if best is None:
                    continue
                t, off, n = best
                if start > pos:
                    out.append(Segment(prompt[pos:start]))
                whole = off == 0 and n == len(t)
                out.append(
                    Segment(prompt[start : start + n] if not whole else t, next(reversed(live[t])), off, not whole)
                )
                pos = start + n
            if pos < len(prompt):
                out.append(Segment(prompt[pos:]))
            return out

    @staticmethod
    def _best_whole(prompt, start, groups, live):
        best = None
        for members in groups:
            for t, _ in members:  # longest first: the first exact hit is this group's best
                if best is not None and len(t) <= len(best):
                    break
                # `in live` drops texts removed since the main automaton was built.
                if t in live and prompt.startswith(t, start):
                    best = t
                    break
        return None if best is None else (best, 0, len(best))

    def _best(self, prompt, start, groups, live, limit=None):
        """The (text, offset, matched chars) that wins at ``start`` in partial mode; ``limit``:
        a cut match takes at most that many characters.

        Many texts can share an anchor (chunks of one file behind the same metadata header),
        so a cut is measured only where it can still win: whole matches are found first (one
        compare each), and a cut must then hold at least as many characters as the best so far
        (one compare of that prefix) before its length is searched for."""
        best, best_rank, cuts = None, None, []
        for members in groups:
            for t, off in members:
                if t not in live:
                    continue
                full = len(t) - off
                if best_rank is not None and full < best_rank[0]:
                    break  # longest first: no later member of this group can match more
                if prompt.startswith(t[off:] if off else t, start):
                    rank = (full - _trail(prompt, start + full, full), off == 0, 1, -len(t))
                    if best_rank is None or rank > best_rank or (rank == best_rank and t < best[0]):
                        best, best_rank = (t, off, full), rank
                else:
                    cuts.append((t, off, full))
        mp = self.min_partial_chars
        for t, off, full in cuts:
            # The shortest cut taken: min_partial_chars, or all of the text's non-whitespace.
            need = mp if full > mp and not t[-1].isspace() else min(mp, len(t.rstrip()) - off)
            if best_rank is not None:
                # Trailing whitespace a match takes along does not make it better: a text
                # registered both bare and padded ("\n\nX\n") is served bare where the prompt
                # holds it bare, from its own first character (off == 0: K/V computed in the
                # exact context), whole before cut.
                need = max(need, best_rank[0])
            if (limit is not None and need > limit) or not prompt.startswith(t[off : off + need], start):
                continue  # shorter than the shortest cut taken, or than the best so far
            n = _common_prefix(prompt, start, t, off, need, limit)
            rank = (n - _trail(prompt, start + n, n), off == 0, 0, -len(t))
            if best_rank is None or rank > best_rank or (rank == best_rank and t < best[0]):
                best, best_rank = (t, off, n), rank
        return best


def _trail(prompt: str, end: int, n: int) -> int:
    """How many of the ``n`` characters before ``end`` in ``prompt`` are trailing whitespace."""
    if not prompt[end - 1].isspace():
        return 0
    return n - len(prompt[end - n : end].rstrip())


def _common_prefix(prompt: str, start: int, text: str, off: int, lo: int = 0, limit: int | None = None) -> int:
    """How many characters of ``text[off:]`` ``prompt`` holds from ``start`` on (at most
    ``limit``), knowing that it holds the first ``lo``."""
    hi = min(len(text) - off, len(prompt) - start)
    if limit is not None:
        hi = min(hi, limit)
    # Gallop, then binary search, each step comparing only the characters after the ``lo``
    # known to match (C-speed compares; a mismatch shortly after ``lo`` costs little).
    step = 64
    while lo < hi:
        mid = min(lo + step, hi)
        if not prompt.startswith(text[off + lo : off + mid], start + lo):
            hi = mid - 1
            break
        lo, step = mid, step * 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prompt.startswith(text[off + lo : off + mid], start + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo
