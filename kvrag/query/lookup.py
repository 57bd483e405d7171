"""The cached chunks of a prompt: find their texts in it (``kvrag.layout.segment``), read their
entries from the tiers that hold them (the in-memory hot tier, then the store) and align them
with the prompt's own tokenization (``kvrag.layout.align``) -- built, where that is proved,
from the chunks' stored ids and the plain text around them, without tokenizing the chunks
(``kvrag.query.splice``).

The result is the prompt as ``Piece``\\ s: plain token runs and cached chunks, in order, whose
token ids concatenated are exactly the tokenizer's ids of the whole prompt (after the BOS ids
it adds), for every policy alike. Those ids are decided in one place, ``ChunkLookup._tokens``:
``pieces`` runs it, and so does ``ChunkLookup.tokens`` for a caller that counts a prompt's
tokens before its prefill (the server's scheduler) and hands them (``PromptTokens``) to
``pieces``, which then neither tokenizes nor segments the prompt again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from kvrag.errors import StoreError
from kvrag.layout.align import Placement, chunk_spans, place_chunks, prompt_prefix, prompt_tokens, token_inside
from kvrag.layout.segment import Segmenter
from kvrag.layout.state import CACHED, PLAIN, FusionStats, Piece
from kvrag.query.splice import seam_merges, splice_ids

log = logging.getLogger("kvrag")


class PromptTokens(NamedTuple):
    """A prompt string's tokens as its prefill reads them (``ChunkLookup.tokens``; BOS ids not
    included). ``ids`` [n]: the tokenizer's own ids of the whole prompt; ``offsets`` [n]: each
    token's character span, ``starts`` [n] the spans' starts (sorted), as
    ``kvrag.layout.align.prompt_tokens`` gives them, except that each token of a spliced chunk
    spans the whole chunk. ``spans``: the prompt's chunk spans (``chunk_spans``) as the lookup
    found them, None where it was not segmented (its prefill segments it); ``spliced``:
    ``(index in spans, index in ids of its first token)`` per chunk whose stored ids were
    spliced in. A bare ``(ids, offsets, starts)`` of ``prompt_tokens`` reads as the whole
    prompt tokenized, nothing segmented or spliced."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    starts: list[int]
    spans: list | None = None
    spliced: tuple[tuple[int, int], ...] = ()


class ChunkLookup:
    """Finds, reads and aligns the cached chunks of prompts for one model and store.

    ``segmenter`` is shared with ingestion (``kvrag.precompute.ingest.Ingestor``), which registers what it
    stores, so the very next query finds it; chunks another process stored are found by
    re-reading the store's text index at most every ``refresh_s`` seconds."""

    def __init__(self, handle, store, hot, segmenter: Segmenter, fingerprint: str, refresh_s: float = 2.0) -> None:
        self.handle = handle
        self.tokenizer = handle.tokenizer
        self.store = store
        self.hot = hot
        self.segmenter = segmenter
        self.fingerprint = fingerprint
        self.newline_ids = handle.encode("\n")
        self.layout = (handle.n_layers, handle.n_kv_heads, handle.head_dim)  # what a served entry must hold
        self._refresh_s = refresh_s
        self._last_refresh = -1e9
        # One re-read of the text index at a time: concurrent queries that are due at once
        # wait for the one reading it (and then skip theirs) instead of all reading it.
        self._refresh_lock = threading.Lock()
        # Chunk reads (``read_entries``); the pool starts its threads at the first read.
        self._readers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="kvrag-read")

    def refresh(self) -> None:
        """Re-read the store's text index if ``refresh_s`` has passed: other processes (or an
        earlier session) may have added chunks. Not on every query: it is a disk read."""
        if time.monotonic() - self._last_refresh < self._refresh_s:
            return
        with self._refresh_lock:
            now = time.monotonic()
            if now - self._last_refresh < self._refresh_s:
                return  # another query re-read it while this one waited
            # The index is read while precompute (this process's worker) may store and register
            # chunks: those registered after ``since`` are newer than the snapshot, kept.
            since = self.segmenter.version()
            try:
                self.segmenter.update(self.store.texts(self.fingerprint), since=since)
            except StoreError as e:
                # Queries go on with the chunks already known (their reads fall back to
                # computing if the store cannot serve them); the next refresh tries again.
                log.warning("%s; serving the %d chunk texts known so far", e, len(self.segmenter))
            self._last_refresh = now

    def read_entries(self, keys: list[str]) -> dict[str, Future]:
        """Store entries by key, read concurrently: the file read (or mapping) and the checksum
        release the GIL, and the tensors are views of the read buffer (no parse). On a CUDA
        device the buffer is pinned, so the copy to the GPU is asynchronous and at full speed
        (docs/cache.md, "How a blob is read")."""
        pin = self.handle.device.type == "cuda"
        return {
            k: self._readers.submit(self.store.get, k, self.fingerprint, pin_memory=pin) for k in dict.fromkeys(keys)
        }

    def tokens(self, prompt: str, tokenizer=None, use_cache: bool = True) -> PromptTokens:
        """The prompt's tokens as ``pieces`` reads them, for a caller that counts them before
        the prefill (the server's scheduler refuses a prompt past the context at submit) and
        then hands them to ``pieces``, which tokenizes and segments nothing again.

        Made by ``pieces``' own rule (``_tokens``) from the chunks the hot tier holds: their
        stored ids are spliced in, and the chunks it does not hold are tokenized with the plain
        text around them. The store is not read here: a read entry (a pinned buffer beside a
        GPU) would be held for as long as the request waits; ``pieces`` reads them.
        ``use_cache`` False: the whole prompt tokenized, as ``pieces`` tokenizes it for a policy
        that reads no cache. ``tokenizer``: this model's (None) or a copy of it, for a thread of
        the caller's own (a fast tokenizer is not safe to share between threads; the hot tier
        and the segmenter are)."""
        tok = self.tokenizer if tokenizer is None else tokenizer
        if not use_cache:
            return PromptTokens(*prompt_tokens(tok, prompt))

        def hot(seg):
            entry = self.hot.get(seg.key)
            return None if entry is None else (entry.token_ids.tolist(), entry.text, None)

        return self._tokens(prompt, self._spans(prompt), tok, hot)

    def _spans(self, prompt: str) -> list:
        """The prompt's cached chunk spans, ``(segment, start, end)`` in prompt order."""
        self.refresh()
        return list(chunk_spans(self.segmenter.split(prompt)))

    @staticmethod
    def _tokens(
        prompt: str, spans: list, tokenizer, read: Callable, fetch: Callable[[list[str]], None] | None = None
    ) -> PromptTokens:
        """The prompt's tokens (the one rule, ``pieces``' and ``tokens``'): the chunks of
        ``spans`` found whole, whose seams may hold and whose stored ids ``read(segment)`` gives
        (``(ids, text, payload)``, or None), spliced between the plain text tokenized in
        context (``kvrag.query.splice``), every seam proved; where one does not hold, or with
        no chunk to splice, the whole prompt tokenized. ``fetch(keys)``: start the reads of the
        chunks that may be spliced, all at once, before the first is waited for."""
        whole = [
            (i, sp)
            for i, sp in enumerate(spans)
            if not sp[0].partial and not sp[0].offset and not seam_merges(prompt, sp[1], sp[2])
        ]
        if fetch is not None:
            fetch([sp[0].key for _, sp in whole])
        good = [(i, sp, g) for i, sp in whole if (g := read(sp[0])) is not None and g[1] == sp[0].text]
        spliced = splice_ids(tokenizer, prompt, [(a, b, g[0]) for _, (_, a, b), g in good]) if good else None
        if spliced is None:
            return PromptTokens(*prompt_tokens(tokenizer, prompt), spans)
        placed = tuple((i, j) for (i, _, _), j in zip(good, spliced.starts, strict=True))
        return PromptTokens(spliced.ids, spliced.offsets, [a for a, _ in spliced.offsets], spans, placed)

    def pieces(
        self, prompt: str, use_cache: bool = True, tokens: PromptTokens | tuple | None = None
    ) -> tuple[list[Piece], FusionStats]:
        """The prompt's token ids, split into plain pieces and cached chunks: ([Piece], stats
        with hits/misses).

        The ids are the tokenizer's own for the whole prompt (what ``model.generate`` on the
        tokenized prompt reads), for every policy alike, ``full_prefill`` included. A chunk
        found in the prompt text is served from the cache only where that tokenization holds
        exactly the chunk's ids (``KVRag.chunk_ids``) on its characters; a chunk the prompt
        holds only in part (cut, or without its edge whitespace: ``Segmenter(partial=True)``)
        is served for the tokens it shares on that part (``chunks_partial``). Where the two
        tokenizations part at the chunk's edges — its last token merges with the next line
        break, its first with a preceding space (" The" after "Context:") — only the run of
        tokens they share is reused and the edge tokens are computed (``align.match_chunk``);
        a chunk they share no run of is counted in ``chunks_unaligned`` and computed as plain
        text. Never a different token sequence from the tokenizer's."""
        stats = FusionStats()
        pieces: list[Piece] = []
        prefix = prompt_prefix(self.handle, prompt)
        if prefix:
            pieces.append(Piece(torch.tensor(prefix, dtype=torch.long)))
        tok = 0  # first token not yet placed in a piece
        if tokens is not None and not isinstance(tokens, PromptTokens):
            tokens = PromptTokens(*tokens)  # ``prompt_tokens`` of the whole prompt
        if not use_cache:
            # ``tokens``: this prompt's, when its caller tokenized it already.
            ids = tokens.ids if tokens is not None else prompt_tokens(self.tokenizer, prompt)[0]
        else:
            # The spans the caller's lookup found (``tokens``): its splice placed chunks of them.
            spans = tokens.spans if tokens is not None and tokens.spans is not None else self._spans(prompt)
            hot_entries = {seg.key: e for seg, _, _ in spans if (e := self.hot.get(seg.key)) is not None}
            disk: dict[str, Future] = {}
            read_once: dict[str, tuple | None] = {}

            def read(seg):
                if seg.key not in read_once:  # the splice and the alignment may both ask
                    read_once[seg.key] = read_entry(seg)
                return read_once[seg.key]

            def read_entry(seg):
                entry = hot_entries.get(seg.key)
                hot = entry is not None
                if not hot:
                    entry = disk[seg.key].result()
                    if entry is None:
                        return None  # evicted/corrupt: computed instead
                    if (problem := entry.layout_problem(self.layout)) is not None:
                        log.warning("stored chunk %s does not fit this model (%s); computed instead", seg.key, problem)
                        return None
                return entry.token_ids.tolist(), entry.text, (entry, hot)

            if tokens is None:
                tokens = self._tokens(
                    prompt,
                    spans,
                    self.tokenizer,
                    read,
                    lambda keys: disk.update(self.read_entries([k for k in keys if k not in hot_entries])),
                )
            ids = tokens.ids
            for pl in self._place(spans, tokens, hot_entries, disk, read):
                if pl.status == "unaligned":
                    stats.chunks_unaligned += 1
                    continue
                if pl.status == "missed":
                    stats.chunks_missed += 1
                    continue
                (entry, hot), j, k, m = pl.chunk, pl.j, pl.k, pl.m
                if pl.segment.partial:
                    stats.chunks_partial += 1
                if hot:
                    stats.chunks_hot += 1
                else:
                    entry = self.hot.put(pl.segment.key, entry)
                # A packed entry (kept packed in every tier) reaches the fusion engine packed,
                # which expands it on the compute device a layer at a time; a part of one is
                # cut from its expansion (its key groups would not start at the part).
                if m < entry.token_ids.numel():
                    entry = entry.expanded(self.handle.device, self.handle.dtype).span(k, k + m)
                stats.bytes_loaded += entry.nbytes
                if j > tok:
                    pieces.append(Piece(torch.tensor(ids[tok:j], dtype=torch.long), PLAIN))
                pieces.append(Piece(entry.token_ids, CACHED, entry=entry, key=pl.segment.key, span=(k, k + m)))
                tok = j + m
        if tok < len(ids):
            pieces.append(Piece(torch.tensor(ids[tok:], dtype=torch.long), PLAIN))
        total = sum(int(p.token_ids.numel()) for p in pieces)
        if total == 0:
            raise ValueError("empty prompt: it tokenizes to no tokens")
        if total > self.handle.max_context:
            raise ValueError(f"prompt of {total} tokens exceeds the model context ({self.handle.max_context})")
        return pieces, stats

    def _place(self, spans: list, tokens: PromptTokens, hot_entries: dict, disk: dict, read) -> Iterator[Placement]:
        """The ``Placement`` of each chunk of ``spans`` in ``tokens``, in prompt order; ``disk``
        (key -> read future) is filled here, for ``read``.

        A spliced chunk is placed whole where the splice put it: what ``place_chunks`` finds in
        the whole prompt's tokenization, equal to the splice (missed if its entry is gone
        since). The others (cut, unreadable, inside words, not read when spliced) are aligned
        in the tokens of the text around them (``place_chunks``), which are the whole prompt's
        where every seam holds, and the whole prompt's tokenization otherwise."""
        ids, offsets, starts = tokens.ids, tokens.offsets, tokens.starts
        placed = dict(tokens.spliced)
        # Reads start at once, all of them: the spliced chunks' not read yet (a caller's splice
        # from the hot tier alone), then those of the others a prompt token lies in.
        keys = [spans[i][0].key for i in placed]
        disk.update(self.read_entries([k for k in keys if k not in hot_entries and k not in disk]))
        rest = [sp for i, sp in enumerate(spans) if i not in placed]
        self._read_inside(rest, hot_entries, disk, offsets, starts)
        aligned = place_chunks(self.tokenizer, self.newline_ids, ids, offsets, starts, rest, read)
        for i, (seg, _, _) in enumerate(spans):
            if i not in placed:
                yield next(aligned)
            elif (got := read(seg)) is None:
                yield Placement(seg, "missed")
            else:
                yield Placement(seg, "placed", got[2], placed[i], 0, len(got[0]))

    def _read_inside(self, spans: list, hot_entries: dict, disk: dict, offsets, starts) -> None:
        """Start the reads, all at once, of the chunks of ``spans`` a prompt token lies in."""
        disk.update(
            self.read_entries(
                [
                    seg.key
                    for seg, start, end in spans
                    if seg.key not in hot_entries
                    and seg.key not in disk
                    and token_inside(starts, offsets, start, end, 0)
                ]
            )
        )
