"""``KVRag``: the facade that ties model, store, segmenter, fusion and decoding together.

Integrations (LlamaIndex, LangChain) and the CLI talk to this class only::

    rag = KVRag(cache_dir=".kvrag", policy="cacheblend", recompute_ratio=0.15)
    rag.precompute(chunk_texts)
    out = rag.generate(prompt)          # finds the chunk texts inside the prompt
    print(out.text, out.stats.ttft_s)
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvrag.arch import Arch
from kvrag.chunk import compute_chunk_kv, pack
from kvrag.decode import FusedStepper, HFStepper, Sampling, TextStream, eos_ids, generate_tokens
from kvrag.errors import ChunkError, StoreError
from kvrag.fusion import CACHED, INSERTED, PLAIN, FusionEngine, FusionResult, FusionStats, Layout, Piece
from kvrag.hotcache import HotCache, resolve_budget
from kvrag.model import ModelHandle, default_home
from kvrag.policies import Policy, get_policy
from kvrag.policies.base import check_int
from kvrag.precompute import check_texts_iterable, validate_chunk_text
from kvrag.segment import Segmenter, render_messages
from kvrag.store import ChunkEntry, KVStore

log = logging.getLogger("kvrag")

STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Generation:
    """A finished generation: text, generated token ids, and what the prefill did."""

    text: str
    token_ids: list[int]
    stats: FusionStats
    prompt_ids: list[int] = field(default_factory=list)
    #: Why decoding ended: "stop" (EOS token or a stop string), "length" (max_new_tokens
    #: reached without either), None if unknown. Recorded by the decoder, not guessed from
    #: the token count: a stop on the last allowed token is still "stop".
    finish_reason: str | None = None


@dataclass
class _Prepared:
    """A request checked and segmented by ``KVRag._prepare``, ready for ``_fuse``: layout is
    None when the prompt takes the exact full-prefill path. t0/t_ready: perf_counter at the
    start and end of the preparation."""

    policy: Policy
    pieces: list[Piece]
    seg_stats: FusionStats
    layout: Layout | None
    t0: float
    t_ready: float


class Stream:
    """Iterator of text deltas; ``.stats``/``.text``/``.token_ids`` are complete once exhausted."""

    def __init__(self, gen: Iterator[str]):
        self._gen = gen
        self.text = ""
        self.token_ids: list[int] = []
        self.stats: FusionStats | None = None
        self.prompt_ids: list[int] = []
        self.finish_reason: str | None = None  # "stop" / "length" once exhausted (see Generation)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def close(self) -> None:
        """Stop generating now (a reader that went away) and free the decode cache; further
        ``next`` raises StopIteration, and ``stats`` stays None."""
        self._gen.close()

    def generation(self) -> Generation:
        """What the stream produced, as ``generate`` returns it (complete once exhausted)."""
        return Generation(self.text, self.token_ids, self.stats, self.prompt_ids, self.finish_reason)


def resolve_anchor(handle: ModelHandle, anchor: str | Sequence[int]) -> list[int]:
    """``KVRag(chunk_anchor=...)`` -> token ids (see ``KVRag``)."""
    if isinstance(anchor, str):
        if anchor == "auto":
            return handle.anchor_ids()
        if anchor == "none":
            return []
        raise ValueError(f"chunk_anchor must be 'auto', 'none' or a list of token ids, got {anchor!r}")
    ids = list(anchor)
    vocab = handle.config.vocab_size
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"chunk_anchor holds {bad[:3]}: token ids must be ints in [0, {vocab})")
    return ids


def cache_fingerprint(model_fingerprint: str, anchor: Sequence[int]) -> str:
    """The fingerprint chunk caches are keyed and checked by: the model's, extended with the
    anchor chunks are computed behind (the model's own when there is none)."""
    if not anchor:
        return model_fingerprint
    tag = f"{model_fingerprint}|anchor={','.join(str(int(t)) for t in anchor)}"
    return hashlib.sha256(tag.encode("utf-8")).hexdigest()


def spell_chunk(handle: ModelHandle, text: str, newline_ids: Sequence[int]) -> list[int]:
    """Token ids of a chunk as the tokenizer spells it inside a prompt after a line break
    (``KVRag.chunk_ids`` without its checks); ``newline_ids``: ``handle.encode("\\n")``."""
    nl = list(newline_ids)
    ids = handle.encode("\n" + text)
    if nl and ids[: len(nl)] == nl and len(ids) > len(nl):
        return ids[len(nl):]
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
    if nl and ids[:len(nl)] == nl and ids[len(nl):] == chunk:
        return [max(s - 1, 0) for s, _ in enc["offset_mapping"][len(nl):]]
    return None


def match_chunk(tokenizer, newline_ids: Sequence[int], chunk: list[int], text: str, start: int, end: int,
                ids: list[int], offsets: list[tuple[int, int]], starts: list[int], lo: int,
                offset: int = 0) -> tuple[int, int, int]:
    """Where the prompt's tokens reuse a stored chunk (token ids ``chunk``, text ``text``),
    whose characters ``offset ..`` were found at the prompt's characters [start, end): prompt
    tokens ``j..j+m-1`` are its tokens ``k..k+m-1`` (m = 0: nowhere). ``ids`` / ``offsets`` /
    ``starts``: the prompt's tokens, their character spans and span starts; ``lo``: the first
    token not placed yet. Shared by ``KVRag.pieces`` and the KVLink trainer
    (``kvrag.kvlink_train.prompt_pieces``), so training sequences are laid out as queries are."""
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


class KVRag:
    """Precompute chunk KV caches, then answer prompts by fusing them under a policy.

    model: a ``ModelHandle``, a local HF model directory or ``.gguf`` path, or None for the
    default SmolLM2-135M-Instruct. cache_dir: where the KV store lives. policy/policy_params:
    the default reuse policy (overridable per call). storage_dtype: dtype of stored K/V.
    size_limit: bytes of the store's blob cache, recorded in the store; None keeps the limit
    the store already has (16 GiB for a new one).
    ingest_policies: policies whose per-chunk extras are computed at precompute time (the
    default ``policy`` is one when it has extras: ``KVRag(policy="a2ats")`` stores A2ATS codes).
    kvlink_adapter: ``"auto"`` or a directory: load the model with a KVLink adapter (trained
    link tokens, maybe a LoRA merged into a copy of the model, with its own fingerprint and
    so its own chunk caches). The default ``"default"`` applies the adapter found for this
    model (``$KVRAG_HOME/kvlink/<key>/``, then the one shipped in ``kvrag/assets/kvlink/``)
    when it can be applied without surprise: a *links-only* adapter always (it changes no
    weight, fingerprint or other policy), one with LoRA weights only when ``policy`` is
    ``"kvlink"`` (a KVRag built for KVLink runs the KVLink model; one built for another
    policy keeps the base model, and its per-call ``kvlink`` runs untrained). ``"links"``:
    links-only adapters only. None: no adapter.
    chunk_anchor: token ids every chunk is precomputed behind (and which are then dropped):
    ``"auto"`` = the model's attention-sink token (``ModelHandle.anchor_ids``: BOS, or the
    chat template's first token), ``"none"`` = chunks read alone from position 0, or a list
    of ids. ``fingerprint`` (the cache's) covers it.
    hot_cache: bytes of served chunk K/V kept in memory on the compute device, least recently
    used dropped first (``kvrag.hotcache``): a chunk served again skips the disk read, checksum
    and host-to-device copy. ``"auto"``: a fifth of the GPU's memory, or 1 GiB on the CPU; 0
    reads every chunk from disk. ``FusionStats.chunks_hot`` counts the chunks it served."""

    def __init__(
        self,
        model: ModelHandle | str | None = None,
        *,
        cache_dir: str | os.PathLike | None = None,
        policy: str | Policy = "cacheblend",
        storage_dtype: str = "float16",
        size_limit: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        ingest_policies: Sequence[str | Policy] = (),
        query_tokens: int | None = None,
        refresh_s: float = 2.0,
        kvlink_adapter: str | os.PathLike | None = "default",
        chunk_anchor: str | Sequence[int] = "auto",
        hot_cache: int | str = "auto",
        **policy_params,
    ) -> None:
        # Bad options fail before a model load, and before the store is opened: opening it
        # records ``size_limit`` in a store other processes may share.
        pol = get_policy(policy, **policy_params)
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {storage_dtype!r}")
        if hot_cache != "auto":
            resolve_budget(hot_cache, torch.device("cpu"))  # a bad value fails before the model load
        if query_tokens is not None:
            query_tokens = check_int("query_tokens (the last k prompt tokens are the question)", query_tokens, 1)
        if isinstance(ingest_policies, (str, Policy)):
            ingest_policies = [ingest_policies]
        ingest = [get_policy(p) for p in ingest_policies]
        self.handle = model if isinstance(model, ModelHandle) else ModelHandle.load(model, dtype=dtype, device=device)
        if kvlink_adapter is not None:
            # A KVLink adapter ("auto" or a directory) may hold LoRA weights that change every
            # K/V: the adapted model is a copy with its own fingerprint (kvrag.kvlink_train).
            from kvrag.kvlink_train import apply_adapter, default_adapter

            if isinstance(kvlink_adapter, str) and kvlink_adapter in ("default", "links"):
                found = default_adapter(self.handle, allow_lora=kvlink_adapter == "default" and pol.name == "kvlink")
                if found is not None:
                    self.handle = apply_adapter(self.handle, found)
            else:
                self.handle = apply_adapter(self.handle, kvlink_adapter)
        self.arch = Arch(self.handle.model)
        pol.check_model(self.arch)  # e.g. a2ats without a codebook: now, not at the first hit
        # The default policy's per-chunk extras (A2ATS codes) are computed at precompute time,
        # with its own configuration (codebook=...): an ingest policy of the same name is it.
        ingest = [pol if q.name == pol.name else q for q in ingest]
        if type(pol).chunk_extras is not Policy.chunk_extras and pol not in ingest:
            ingest.append(pol)
        self.tokenizer = self.handle.tokenizer
        self.anchor = resolve_anchor(self.handle, chunk_anchor)
        # Chunk K/V depend on the anchor they were computed behind: it is part of the cache
        # fingerprint, so a store shared by differently configured instances never mixes them.
        self.fingerprint = cache_fingerprint(self.handle.fingerprint, self.anchor)
        cache_dir = Path(cache_dir) if cache_dir is not None else default_home() / "store"
        self.store = KVStore(cache_dir, size_limit=size_limit)
        self.hot = HotCache(resolve_budget(hot_cache, self.handle.device), self.handle.device, self.handle.dtype)
        self.storage_dtype = STORAGE_DTYPES[storage_dtype]
        self.policy = pol
        self.ingest_policies = ingest
        self.engine = FusionEngine(self.arch)
        # Partial matches: a chunk the framework cut or whose edge whitespace it trimmed is
        # still served for the tokens the prompt shares with it (kvrag.segment).
        self.segmenter = Segmenter(partial=True)
        self.query_tokens = query_tokens
        self._newline_ids = self.handle.encode("\n")
        self.eos = eos_ids(self.handle.model, self.tokenizer)
        self._refresh_s = refresh_s
        self._last_refresh = -1e9
        # One re-read of the text index at a time: concurrent queries that are due at once
        # wait for the one reading it (and then skip theirs) instead of all reading it.
        self._refresh_lock = threading.Lock()
        self._warned_no_reuse = False
        # Chunk reads (``_read_entries``); the pool starts its threads at the first read.
        self._readers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="kvrag-read")

    # ---- chunks ----------------------------------------------------------------------
    def chunk_ids(self, text: str) -> list[int]:
        """Token ids of a chunk as the tokenizer spells it inside a prompt, after a line break
        (how RAG prompts separate passages): for byte-level BPE tokenizers (Llama 3, Qwen,
        SmolLM) the ids of the text alone; for SentencePiece ones that mark the first word
        of a text (Llama 2, Mistral) the ids without that mark. A prompt reuses the chunk only
        where its own tokenization holds exactly these ids (``pieces``)."""
        validate_chunk_text(text)
        ids = spell_chunk(self.handle, text, self._newline_ids)
        if len(ids) > self.handle.max_context:
            raise ChunkError(
                f"chunk of {len(ids)} tokens exceeds the model context ({self.handle.max_context} tokens); "
                "split the document into smaller chunks"
            )
        return ids

    def chunk_key(self, text: str) -> str:
        return KVStore.make_key(self.fingerprint, self.chunk_ids(text))

    def is_cached(self, text: str) -> bool:
        return self.chunk_key(text) in self.store

    def precompute(self, texts: Iterable[str], *, batch_tokens: int = 2048, progress: bool = False) -> list[str]:
        """Compute and store the KV of every text not cached yet; returns their keys.

        Chunks are packed ``batch_tokens`` at a time (one pass per pack)."""
        check_texts_iterable(texts, "precompute")
        texts = list(texts)
        ids = []
        for i, t in enumerate(texts):
            try:
                ids.append(self.chunk_ids(t))
            except (ChunkError, TypeError, ValueError) as e:
                # Checked before any work: a batch with a bad text stores nothing, and says which.
                preview = repr(t[:60] + ("..." if len(t) > 60 else "")) if isinstance(t, str) else type(t).__name__
                raise type(e)(f"text {i} of {len(texts)} ({preview}): {e}") from e
        keys = [KVStore.make_key(self.fingerprint, i) for i in ids]
        todo, stored = [], {}
        for j, k in enumerate(keys):
            if k not in stored:
                # Stored and listed in the text index, re-listed if a writer killed mid-put
                # left it out: other processes find chunks through the index only.
                stored[k] = self.store.ensure_indexed(k)
                if not stored[k]:
                    todo.append(j)
            if stored[k]:
                self.segmenter.add(k, texts[j])
        packs = list(pack([len(ids[j]) for j in todo], batch_tokens))
        bar = None
        if progress and todo:
            from tqdm import tqdm

            bar = tqdm(total=sum(len(ids[j]) for j in todo), unit="tok", desc="precompute")
        for group in packs:
            members = [todo[g] for g in group]
            kvs = compute_chunk_kv(self.arch, [ids[j] for j in members], self.anchor)
            for j, (k, v) in zip(members, kvs):
                self._put(keys[j], texts[j], ids[j], k, v)
                if bar:
                    bar.update(len(ids[j]))
        if bar:
            bar.close()
        return keys

    def _put(self, key, text, ids, k, v) -> None:
        token_ids = torch.tensor(ids, dtype=torch.long)
        k, v = k.to(self.storage_dtype), v.to(self.storage_dtype)
        if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
            # Served, an inf/NaN would silently wreck every answer that reads the chunk.
            raise ChunkError(
                f"chunk {text[:60]!r}: its K/V are not finite in {str(self.storage_dtype).removeprefix('torch.')} "
                "(the model's activations overflow it?); not stored -- use storage_dtype='bfloat16' or 'float32'")
        extras = {}
        for p in self.ingest_policies:
            # From the stored (rounded) K/V in the compute dtype: what a query reads back.
            extras.update(p.chunk_extras(self.arch, k.to(self.handle.dtype), v.to(self.handle.dtype), token_ids))
        entry = ChunkEntry(
            fingerprint=self.fingerprint, text=text, token_ids=token_ids, keys=k.cpu(), values=v.cpu(), extras=extras,
        )
        self.store.put(key, entry)
        self.segmenter.add(key, text)

    # ---- prompts ---------------------------------------------------------------------
    def render(self, prompt: str | Sequence[dict]) -> str:
        """A prompt string, or chat messages rendered with the tokenizer's chat template."""
        if isinstance(prompt, (bytes, bytearray)):
            raise TypeError("prompt must be a str or a list of chat messages, got bytes: decode it first")
        if not isinstance(prompt, (str, Sequence)):
            raise TypeError(f"prompt must be a str or a list of chat messages, got {type(prompt).__name__}")
        text = prompt if isinstance(prompt, str) else render_messages(self.tokenizer, list(prompt))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # the tokenizer would fail with an obscure TypeError
            raise ValueError(
                f"prompt contains an unpaired surrogate {text[e.start]!r} at character {e.start}: not "
                "valid Unicode text; decode its source with errors='replace'") from None
        return text

    def _prefix_for(self, text: str) -> list[int]:
        """The BOS ids the tokenizer would add before ``text`` (none if it starts with BOS)."""
        prefix = self.handle.prefix_ids()
        bos = self.tokenizer.bos_token
        return [] if bos and text.startswith(bos) else list(prefix)

    def count_tokens(self, prompt: str | Sequence[dict]) -> int:
        """Tokens the model reads for ``prompt`` (a string, or chat messages rendered with the
        chat template), as ``generate`` would read them."""
        text = self.render(prompt)
        return len(self._prefix_for(text)) + len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _refresh_segmenter(self) -> None:
        # Other processes (or an earlier session) may have added chunks: re-read the store's
        # text index now and then, not on every query (it is a disk read).
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

    def pieces(self, prompt: str, use_cache: bool = True) -> tuple[list[Piece], FusionStats]:
        """The prompt's token ids, split into plain pieces and cached chunks: ([Piece], stats
        with hits/misses).

        The ids are the tokenizer's own for the whole prompt (what ``model.generate`` on the
        tokenized prompt reads), for every policy alike, ``full_prefill`` included. A chunk
        found in the prompt text is served from the cache only where that tokenization holds
        exactly the chunk's ids (``chunk_ids``) on its characters; a chunk the prompt holds only
        in part (cut, or without its edge whitespace: ``Segmenter(partial=True)``) is served
        for the tokens it shares on that part (``chunks_partial``). Where the two tokenizations
        part at the chunk's edges — its last token merges with the next line break, its first
        with a preceding space (" The" after "Context:") — only the run of tokens they share is
        reused and the edge tokens are computed (``match_chunk``); a chunk they share no run of is
        counted in ``chunks_unaligned`` and computed as plain text. Never a different token
        sequence from the tokenizer's."""
        stats = FusionStats()
        pieces: list[Piece] = []
        prefix = self._prefix_for(prompt)
        if prefix:
            pieces.append(Piece(torch.tensor(prefix, dtype=torch.long)))
        ids, offsets, starts = prompt_tokens(self.tokenizer, prompt)
        tok = 0  # first token not yet placed in a piece
        if use_cache:
            self._refresh_segmenter()
            spans = list(chunk_spans(self.segmenter.split(prompt)))
            hot_entries = {seg.key: e for seg, _, _ in spans if (e := self.hot.get(seg.key)) is not None}
            disk = self._read_entries([seg.key for seg, start, end in spans if seg.key not in hot_entries
                                       and token_inside(starts, offsets, start, end, 0)])
            for seg, start, end in spans:
                if not token_inside(starts, offsets, start, end, tok):  # its entry is not even read from disk
                    stats.chunks_unaligned += 1
                    continue
                entry = hot_entries.get(seg.key)
                hot = entry is not None
                if not hot:
                    entry = disk[seg.key].result()
                    if entry is None:
                        stats.chunks_missed += 1  # evicted/corrupt: fall back to computing it
                        continue
                j, k, m = match_chunk(self.tokenizer, self._newline_ids, entry.token_ids.tolist(), entry.text,
                                      start, end, ids, offsets, starts, tok, seg.offset)
                if m == 0:
                    stats.chunks_unaligned += 1
                    continue
                if seg.partial:
                    stats.chunks_partial += 1
                if hot:
                    stats.chunks_hot += 1
                else:
                    entry = self.hot.put(seg.key, entry)
                if m < entry.token_ids.numel():
                    entry = entry.span(k, k + m)
                stats.bytes_loaded += entry.nbytes
                if j > tok:
                    pieces.append(Piece(torch.tensor(ids[tok:j], dtype=torch.long), PLAIN))
                pieces.append(Piece(entry.token_ids, CACHED, entry=entry, key=seg.key, span=(k, k + m)))
                tok = j + m
        if tok < len(ids):
            pieces.append(Piece(torch.tensor(ids[tok:], dtype=torch.long), PLAIN))
        total = sum(int(p.token_ids.numel()) for p in pieces)
        if total == 0:
            raise ValueError("empty prompt: it tokenizes to no tokens")
        if total > self.handle.max_context:
            raise ValueError(f"prompt of {total} tokens exceeds the model context ({self.handle.max_context})")
        return pieces, stats

    def _read_entries(self, keys: list[str]) -> dict[str, Future]:
        """Store entries by key, read concurrently: the file read (or mapping) and the checksum
        release the GIL, and the tensors are views of the read buffer (no parse). On a CUDA
        device the buffer is pinned, so the copy to the GPU is asynchronous and at full speed
        (docs/cache.md, "How a blob is read")."""
        pin = self.handle.device.type == "cuda"
        return {k: self._readers.submit(self.store.get, k, self.fingerprint, pin_memory=pin)
                for k in dict.fromkeys(keys)}

    def _note_no_reuse(self, seg_stats) -> None:
        """Say why a reuse policy got a prompt with no cached chunk, while chunks are cached:
        the speed-up is lost silently otherwise (a framework that rewrites the chunk texts, a
        store another process evicted). A warning the first time per KVRag, debug after."""
        registered = len(self.segmenter)
        if not registered:
            return  # nothing ingested yet: computing in full is the expected path
        level = logging.DEBUG if self._warned_no_reuse else logging.WARNING
        self._warned_no_reuse = True
        log.log(level, "no cached chunk served in this prompt (%d chunk texts cached; %d found but "
                "unreadable/evicted, %d found but tokenized otherwise): computed in full. Expected for "
                "a prompt without retrieved text (a chat engine's question rewrite); if it holds "
                "retrieved text, see docs/segmentation.md for what breaks a match. Said once.",
                registered, seg_stats.chunks_missed, seg_stats.chunks_unaligned)

    def _prepare(self, text: str, pol: Policy, t0: float) -> "_Prepared":
        """Everything of a prefill that can reject the request: the policy against this model,
        tokenization and the context limit, segmentation and chunk reads, the policy's inserted
        tokens (KVLink's link tokens count toward the context too) and its check of the
        layout. ``stream`` runs this at the call, so bad input fails there. ``t0``: perf_counter
        when the request arrived (rendering a chat template counts toward load_s and TTFT)."""
        pol.check_model(self.arch)
        pieces, seg_stats = self.pieces(text, use_cache=pol.uses_cache)
        has_cached = any(p.kind == CACHED for p in pieces)
        layout = None
        if pol.uses_cache and has_cached:
            layout = self.engine.apply_insertions(pieces, pol, self.query_tokens)
            if layout.n > self.handle.max_context:
                raise ValueError(
                    f"prompt of {layout.n} tokens with the {layout.n - sum(int(p.token_ids.numel()) for p in pieces)} "
                    f"tokens {pol.name} inserts exceeds the model context ({self.handle.max_context})")
            pol.check_layout(layout, self.arch)
        return _Prepared(pol, pieces, seg_stats, layout, t0, time.perf_counter())

    def _fuse(self, prep: "_Prepared"):
        """The prefill itself, after ``_prepare``: (logits [V], stepper, stats, prompt ids)."""
        pol, pieces, seg_stats, layout = prep.policy, prep.pieces, prep.seg_stats, prep.layout
        t_fuse = time.perf_counter()
        if layout is None:
            # Invariant: a prompt with no cached chunk takes the exact full-prefill path.
            ids = torch.cat([p.token_ids for p in pieces])
            stepper = HFStepper(self.handle.model, cache=None, K=[], V=[], next_position=0)
            logits = stepper.step(ids.tolist(), last_only=True)[-1]
            n = int(ids.numel())
            stats = FusionStats(prompt_tokens=n, computed_tokens=n, kept_tokens=n, policy=pol.name)
            prompt_ids = ids.tolist()
        else:
            # Decoding over a thinned cache (SamKV, A3's eviction) on a model with sliding-window
            # layers must window by position: HF's cache windows by slot, and there slot and
            # position no longer agree. kvrag's own layer step does it by position.
            windowed = any(w is not None for w in self.arch.windows)
            own_decode = pol.decode_select is not None or windowed
            res: FusionResult = self.engine.prefill(layout, pol, keep_state=own_decode)
            stats, logits = res.stats, res.logits
            thinned = res.positions.dim() != 1 or res.positions.numel() != layout.n
            if pol.decode_select is not None or (windowed and thinned):
                stepper = FusedStepper(self.arch, res.K, res.V, res.next_position, pol, res.state, res.positions)
            else:
                stepper = HFStepper(self.handle.model, res.K, res.V, res.next_position)
            # The tokenizer's sequence: inserted (link) tokens have no id and are not part of it.
            prompt_ids = layout.token_ids[layout.kind != INSERTED].tolist()
        if pol.uses_cache and layout is None:
            self._note_no_reuse(seg_stats)
        stats.chunks_hit = sum(p.kind == CACHED for p in pieces)
        stats.chunks_missed = seg_stats.chunks_missed
        stats.chunks_unaligned = seg_stats.chunks_unaligned
        stats.chunks_partial = seg_stats.chunks_partial
        stats.chunks_hot = seg_stats.chunks_hot
        stats.bytes_loaded = seg_stats.bytes_loaded
        stats.load_s = prep.t_ready - prep.t0
        if logits.is_cuda:  # kernels run asynchronously: wait for the logits before the clock
            torch.cuda.synchronize(logits.device)
        stats.prefill_s = time.perf_counter() - t_fuse
        return logits, stepper, stats, prompt_ids

    def prefill(self, prompt: str | Sequence[dict], policy: str | Policy | None = None, **policy_params):
        """Fused prefill of a prompt. Returns (logits [V], stepper, stats, prompt ids, start time)."""
        t0 = time.perf_counter()
        pol = get_policy(policy if policy is not None else self.policy, **policy_params)
        prep = self._prepare(self.render(prompt), pol, t0)
        return (*self._fuse(prep), t0)

    def stream(
        self,
        prompt: str | Sequence[dict],
        *,
        policy: str | Policy | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] = (),
        seed: int | None = None,
        **policy_params,
    ) -> Stream:
        """Generate token by token; iterate for text deltas. Bad options, policy parameters
        and prompts raise here, at the call. TTFT is the work from the call to the first
        sampled token (rendering, segmentation, loading and prefill; not the time a lazily
        read stream waits for its first ``next()``)."""
        if "max_tokens" in policy_params:  # the name most LLM APIs use; not a policy parameter
            raise ValueError("KVRag.generate/stream take max_new_tokens, not max_tokens")
        sampling = Sampling(max_new_tokens, temperature, top_p, top_k, stop, seed)
        # Bad policy options and prompts fail at the call, not at the first iteration; the
        # time this takes (rendering a chat template) still counts in TTFT and load_s.
        t_call = time.perf_counter()
        pol = get_policy(policy if policy is not None else self.policy, **policy_params)
        prep = self._prepare(self.render(prompt), pol, t_call)
        prep_s = time.perf_counter() - t_call
        holder: Stream

        def run() -> Iterator[str]:
            # TTFT counts the call's work and this one's, not the wait for the first next().
            t0 = time.perf_counter() - prep_s
            logits, stepper, stats, prompt_ids = self._fuse(prep)
            text = TextStream(self.tokenizer, sampling.stop)
            t_first = None
            for tok in generate_tokens(logits, stepper, sampling, self.eos):
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - t0
                holder.token_ids.append(tok)
                delta = text.push(tok)
                if delta:
                    holder.text += delta
                    yield delta
                if text.stopped:
                    break
            tail = text.flush() if not text.stopped else ""
            if tail:
                holder.text += tail
                yield tail
            stats.new_tokens = len(holder.token_ids)
            stats.decode_s = time.perf_counter() - (t_first or t0)
            # EOS or a stop string wins over the token budget when both end on the same token.
            stopped = text.stopped or bool(holder.token_ids and holder.token_ids[-1] in self.eos)
            holder.finish_reason = "stop" if stopped else "length"
            holder.stats = stats
            holder.prompt_ids = prompt_ids

        holder = Stream(run())
        return holder

    def generate(self, prompt: str | Sequence[dict], **kwargs) -> Generation:
        """Generate a whole answer (see ``stream`` for the options)."""
        s = self.stream(prompt, **kwargs)
        for _ in s:
            pass
        return s.generation()

    @torch.no_grad()
    def continuation_logits(
        self, prompt: str | Sequence[dict], continuation_ids: Sequence[int], *, policy=None, **policy_params
    ) -> tuple[torch.Tensor, FusionStats]:
        """Teacher-forced logits: row 0 predicts ``continuation_ids[0]`` after the prompt,
        row t predicts ``continuation_ids[t]``; shape [1 + T, V] (last row follows the whole
        continuation)."""
        (out,), stats = self.continuations_logits(prompt, [continuation_ids], policy=policy, **policy_params)
        return out, stats

    def continuations_logits(
        self, prompt: str | Sequence[dict], continuations: Sequence[Sequence[int]], *, policy=None,
        **policy_params,
    ) -> tuple[list[torch.Tensor], FusionStats]:
        """``continuation_logits`` for several continuations of one prompt: one [1 + T_i, V]
        tensor each. One prefill serves them all when the decoder can rewind its cache (a
        policy with its own decode-time state gets a fresh prefill per continuation)."""
        logits, stepper, stats, _, _ = self.prefill(prompt, policy, **policy_params)
        rewindable = hasattr(stepper, "rewind")
        outs = []
        for i, ids in enumerate(continuations):
            if i and not rewindable:
                logits, stepper, stats, _, _ = self.prefill(prompt, policy, **policy_params)
            point = stepper.checkpoint() if rewindable else None
            rows = [logits.unsqueeze(0)]
            if len(ids):
                rows.append(stepper.step(list(ids)))
            outs.append(torch.cat(rows).float())
            if rewindable:
                stepper.rewind(point)
        return outs, stats
