"""Ingestion: a chunk text -> its token ids, its store key, its K/V computed behind the anchor
(``kvrag.chunk``), the ingest policies' per-chunk extras, and one entry in the store, listed
in the segmenter so the next query finds it.

The one ingestion path: ``KVRag.precompute`` (synchronous) and the background
``kvrag.precompute.Precomputer`` both go through an ``Ingestor``.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence

import torch

from kvrag.checks import check_int, check_texts_iterable, check_token_ids, validate_chunk_text
from kvrag.chunk import compute_chunk_kv, pack
from kvrag.defaults import DEFAULT_BATCH_TOKENS
from kvrag.errors import ChunkError
from kvrag.layout.align import spell_chunk
from kvrag.limits import check_chunk_chars, max_chunk_chars
from kvrag.store.base import ChunkEntry, make_key
from kvrag.store.kv_format import FLOAT_FORMATS, check_format, decode, encode, is_packed


def resolve_anchor(handle, anchor: str | Sequence[int]) -> list[int]:
    """``KVRag(chunk_anchor=...)`` -> token ids (see ``KVRag``); ``handle``: a ``ModelHandle``."""
    if isinstance(anchor, str):
        if anchor == "auto":
            return handle.anchor_ids()
        if anchor == "none":
            return []
        raise ValueError(f"chunk_anchor must be 'auto', 'none' or a list of token ids, got {anchor!r}")
    return check_token_ids("chunk_anchor", anchor, handle.config.vocab_size)


def cache_fingerprint(model_fingerprint: str, anchor: Sequence[int]) -> str:
    """The fingerprint chunk caches are keyed and checked by: the model's, extended with the
    anchor chunks are computed behind (the model's own when there is none)."""
    if not anchor:
        return model_fingerprint
    tag = f"{model_fingerprint}|anchor={','.join(str(int(t)) for t in anchor)}"
    return hashlib.sha256(tag.encode("utf-8")).hexdigest()


class Ingestor:
    """Computes and stores chunk K/V for one model (``arch``), anchor and store.

    ``policies``: those whose ``chunk_extras`` are stored with each chunk. ``segmenter``: the
    query path's (``kvrag.query.lookup.ChunkLookup``), where every stored or found chunk is
    registered."""

    def __init__(
        self,
        handle,
        arch,
        store,
        segmenter,
        *,
        anchor: Sequence[int],
        fingerprint: str,
        storage_dtype: str,
        policies: Sequence = (),
    ) -> None:
        self.handle = handle
        self.arch = arch
        self.store = store
        self.segmenter = segmenter
        self.anchor = list(anchor)
        self.fingerprint = fingerprint
        #: The storage format (``kvrag.store.kv_format``): a float dtype's name or a packed format.
        self.storage_dtype = check_format(storage_dtype)
        self.policies = list(policies)
        self.newline_ids = handle.encode("\n")

    def chunk_ids(self, text: str) -> list[int]:
        """Token ids of a chunk as the tokenizer spells it inside a prompt, after a line break
        (how RAG prompts separate passages): for byte-level BPE tokenizers (Llama 3, Qwen,
        SmolLM) the ids of the text alone; for SentencePiece ones that mark the first word
        of a text (Llama 2, Mistral) the ids without that mark. A prompt reuses the chunk only
        where its own tokenization holds exactly these ids (``kvrag.query.lookup``)."""
        if isinstance(text, str):  # before the checks that copy it (its UTF-8 encoding)
            check_chunk_chars(text, self.max_chars, self.handle.max_context)
        validate_chunk_text(text)
        ids = spell_chunk(self.handle, text, self.newline_ids)
        if len(ids) > self.handle.max_context:
            raise ChunkError(
                f"chunk of {len(ids)} tokens exceeds the model context ({self.handle.max_context} tokens); "
                "split the document into smaller chunks"
            )
        return ids

    @functools.cached_property
    def max_chars(self) -> int | None:
        """Characters past which a text cannot fit in the model's context (None: unknown)."""
        return max_chunk_chars(self.handle.tokenizer, self.handle.max_context)

    def key(self, ids: Sequence[int]) -> str:
        return make_key(self.fingerprint, ids)

    def ensure_listed(self, key: str, text: str) -> bool:
        """True if ``key`` is stored (and then registered with the segmenter): stored is not
        enough, other processes find a chunk through the store's text index, which a writer
        killed mid-put leaves without it, so it is re-listed if so. False: compute it."""
        if not self.store.ensure_stored(key, self.fingerprint):
            return False
        # Registered now: it may come from another process the segmenter has not re-read yet.
        self.segmenter.add(key, text)
        return True

    def precompute(
        self, texts: Iterable[str], *, batch_tokens: int = DEFAULT_BATCH_TOKENS, progress: bool = False
    ) -> list[str]:
        """Compute and store the K/V of every text not stored yet; returns their keys (one per
        text). Every text is checked before any work: a batch with a bad text stores nothing
        and names it. Chunks are packed ``batch_tokens`` at a time (one pass per pack)."""
        check_texts_iterable(texts, "precompute")
        batch_tokens = check_int("batch_tokens (tokens per pack)", batch_tokens, 1)
        texts = list(texts)
        ids = []
        for i, t in enumerate(texts):
            try:
                ids.append(self.chunk_ids(t))
            except (ChunkError, TypeError, ValueError) as e:
                preview = repr(t[:60] + ("..." if len(t) > 60 else "")) if isinstance(t, str) else type(t).__name__
                raise type(e)(f"text {i} of {len(texts)} ({preview}): {e}") from e
        keys = [self.key(i) for i in ids]
        todo, stored = [], {}
        for j, k in enumerate(keys):
            if k not in stored:
                stored[k] = self.ensure_listed(k, texts[j])
                if not stored[k]:
                    todo.append(j)
            elif stored[k]:
                self.segmenter.add(k, texts[j])
        bar = None
        if progress and todo:
            from tqdm import tqdm

            bar = tqdm(total=sum(len(ids[j]) for j in todo), unit="tok", desc="precompute")
        for group in pack([len(ids[j]) for j in todo], batch_tokens):
            members = [todo[g] for g in group]
            kvs = compute_chunk_kv(self.arch, [ids[j] for j in members], self.anchor)
            for j, (k_j, v_j) in zip(members, kvs):
                self.put(keys[j], texts[j], ids[j], k_j, v_j)
                if bar:
                    bar.update(len(ids[j]))
        if bar:
            bar.close()
        return keys

    def put(self, key: str, text: str, ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one chunk's K/V (k, v [L, Hkv, T, D], pre-RoPE keys) in the storage format,
        with the ingest policies' extras, and register its text. ``self.fingerprint`` is the
        format's (``kv_format.format_fingerprint``)."""
        token_ids = torch.tensor(ids, dtype=torch.long)
        fmt = self.storage_dtype
        overflow = ChunkError(
            # Served, an inf/NaN would silently wreck every answer that reads the chunk.
            f"chunk {text[:60]!r}: its K/V are not finite in {fmt} "
            "(the model's activations overflow it?); not stored -- use storage_dtype='bfloat16' or 'float32'"
        )
        scales: dict[str, torch.Tensor] = {}
        if is_packed(fmt):
            try:
                (kc, ks), (vc, vs) = encode(k, fmt, "keys"), encode(v, fmt, "values")
            except ValueError:
                raise overflow from None
            scales = {
                **{f"keys.{n}": t.cpu() for n, t in ks.items()},
                **{f"values.{n}": t.cpu() for n, t in vs.items()},
            }
            # What a query reads back, for the policies' extras: the expanded codes.
            dev, dt, d = k.device, self.handle.dtype, k.shape[3]
            k_read, v_read = decode(kc, ks, fmt, "keys", d, dev, dt), decode(vc, vs, fmt, "values", d, dev, dt)
            k, v = kc, vc
        else:
            k, v = k.to(FLOAT_FORMATS[fmt]), v.to(FLOAT_FORMATS[fmt])
            if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
                raise overflow
            # From the stored (rounded) K/V in the compute dtype: what a query reads back.
            k_read, v_read = k.to(self.handle.dtype), v.to(self.handle.dtype)
        extras = {}
        for p in self.policies:
            extras.update(p.chunk_extras(self.arch, k_read, v_read, token_ids))
        entry = ChunkEntry(
            fingerprint=self.fingerprint,
            text=text,
            token_ids=token_ids,
            keys=k.cpu(),
            values=v.cpu(),
            extras=extras,
            kv_format=fmt if is_packed(fmt) else "",
            scales=scales,
        )
        self.store.put(key, entry)
        self.segmenter.add(key, text)
