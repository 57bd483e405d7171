"""KVLink training samples: a QA example (or a tune task) laid out as the sequence the model
trains on, which is the inference prompt itself::

    template | doc 1 | link_1,1..link_1,K | doc 2 | link_2,1..link_2,K | ... | question | answer

The sequence is laid out by the code that lays out queries (``kvrag.layout.align.place_chunks``):
the tokenizer's ids of the whole prompt, a document being the run of its tokens the chunk cache
serves (``prompt_pieces``), so training sees the token ids, positions and link-token places
inference runs. Every document reads a private copy of the anchor kvrag precomputes chunks
behind (``ModelHandle.anchor_ids``), so its K/V are exactly the chunk cache kvrag stores. The
n-th document's link tokens are their own embeddings (``link<n>-<k>``, paper A.2): a link slot
names a row of the link table ``[max_docs, K, E]``; documents past ``max_docs`` reuse the last
row. The loss is on the answer tokens (:mod:`kvrag.policies.kvlink.loss`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvrag.layout.align import chunk_spans, place_chunks, prompt_prefix, prompt_tokens, spell_chunk
from kvrag.layout.prompt import rag_prompt as layout
from kvrag.layout.prompt import render_messages
from kvrag.layout.segment import Segmenter
from kvrag.model import ModelHandle
from kvrag.policies.kvlink.adapter import KVLinkError
from kvrag.policies.kvlink.config import TrainConfig
from kvrag.qa.example import QAExample


def truncate_passage(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters at a word boundary (0 = unchanged)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    space = cut.rfind(" ")
    return (cut[:space] if space > max_chars // 2 else cut).rstrip()


@dataclass
class Sample:
    """One training/eval sequence in the KVLink layout.

    ids [N] (0 at link slots), link_slot [N] (-1 for a real token, else ``doc * K + k``: a row
    of the flattened link table), segment [N] (0: attends to everything before it; d >= 1:
    token of the d-th document, attends to its own document only), answer_start (first answer
    token; the loss covers ids[answer_start:]). private bool [N] or None: anchor copies placed
    before each document (``KVRag(chunk_anchor=...)``), seen by that document only and absent
    from the prompt; positions [N] or None (= 0..N-1): RoPE positions, an anchor copy sits
    just before its document's first position, as when the chunk was precomputed."""

    ids: torch.Tensor
    link_slot: torch.Tensor
    segment: torch.Tensor
    answer_start: int
    private: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    #: [T, V] the base model's logits predicting the T answer tokens over the plain prompt, when
    #: the sampler already has them (the teacher's own greedy generation computes exactly these):
    #: saves the distillation step a second no-grad forward over the whole prompt.
    teacher_logits: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return int(self.ids.numel())

    def without_links(self) -> Sample:
        """The same sequence with the link tokens (and anchor copies) removed: what full
        prefill reads."""
        keep = self.link_slot < 0
        if self.private is not None:
            keep &= ~self.private
        start = int(keep[: self.answer_start].sum())
        return Sample(self.ids[keep], self.link_slot[keep], self.segment[keep], start)


def build_sample(
    pieces: Sequence[tuple],
    answer_ids: Sequence[int],
    link_tokens: int,
    max_docs: int,
    anchor: Sequence[int] = (),
) -> Sample:
    """Assemble a ``Sample`` from prompt pieces ``(token ids, is_document)`` in order and the
    answer ids; ``link_tokens`` link slots follow every document; every document reads the
    ``anchor`` ids before it (private copies), as its chunk cache was computed. A document
    piece may carry a third item, the chunk tokens before the part of it the prompt reuses
    (``prompt_pieces``): private copies too, between the anchor and the document."""
    if not answer_ids:
        raise KVLinkError("empty answer: nothing to train on")
    ids, slot, seg, private, pos = [], [], [], [], []
    n_doc = 0
    next_pos = 0  # RoPE position of the next prompt token (anchor copies take none)

    def add(toks, slots, d, priv=False):
        nonlocal next_pos
        ids.extend(toks)
        slot.extend(slots)
        seg.extend([d] * len(toks))
        private.extend([priv] * len(toks))
        if priv:  # just before the document, as when its chunk was precomputed behind them
            pos.extend(range(next_pos - len(toks), next_pos))
        else:
            pos.extend(range(next_pos, next_pos + len(toks)))
            next_pos += len(toks)

    for toks, is_doc, *hidden in pieces:
        toks = list(toks)
        if not toks:
            continue
        if is_doc:
            n_doc += 1
            behind = list(anchor) + (list(hidden[0]) if hidden else [])
            if behind:
                add(behind, [-1] * len(behind), n_doc, priv=True)
            add(toks, [-1] * len(toks), n_doc)
            row = min(n_doc - 1, max_docs - 1)
            add([0] * link_tokens, [row * link_tokens + k for k in range(link_tokens)], 0)
        else:
            add(toks, [-1] * len(toks), 0)
    start = len(ids)
    add(list(answer_ids), [-1] * len(answer_ids), 0)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    if not any(private):
        return Sample(t(ids), t(slot), t(seg), start)
    return Sample(t(ids), t(slot), t(seg), start, torch.tensor(private), t(pos))


def prompt_pieces(handle: ModelHandle, prompt: str, documents: Sequence[str]) -> list[tuple]:
    """Split a rendered ``prompt`` into pieces exactly as ``kvrag.query.lookup.ChunkLookup.pieces`` does at query time:
    the tokenizer's prefix ids, then the tokenizer's ids of the *whole* prompt, in which each
    document is served — and so trained as a document — only on the run of tokens that its
    chunk cache (``KVRag.chunk_ids``) shares with the prompt (``kvrag.layout.align.match_chunk``);
    edge tokens the two tokenizations split otherwise are plain tokens, as at query time.

    Returns ``(ids, False)`` for plain pieces and ``(ids, True, hidden)`` for documents, where
    ``hidden`` are the chunk tokens before the reused run (its first token merged with the text
    before it): the cached K/V were computed behind them, so the document reads them too.

    Tokenizing each segment alone instead would train on another sequence than the one served:
    with SmolLM2 a blank line between passages is one token alone (``"\\n\\n"``) but two inside
    the prompt (``"\\n"``, ``"\\n"``), shifting every later position."""
    seg = Segmenter()
    for i, d in enumerate(documents):
        seg.add(f"doc{i}", d)
    out: list[tuple] = []
    prefix = prompt_prefix(handle, prompt)
    if prefix:
        out.append((list(prefix), False))
    ids, offsets, starts = prompt_tokens(handle.tokenizer, prompt)
    nl = handle.encode("\n")

    def read(s):
        text = documents[int(s.key[3:])]
        chunk = spell_chunk(handle, text, nl)
        return chunk, text, chunk

    tok = 0
    for pl in place_chunks(handle.tokenizer, nl, ids, offsets, starts, chunk_spans(seg.split(prompt)), read):
        if pl.status != "placed":
            continue  # computed as plain text at query time too
        if pl.j > tok:
            out.append((ids[tok : pl.j], False))
        out.append((pl.chunk[pl.k : pl.k + pl.m], True, pl.chunk[: pl.k]))
        tok = pl.j + pl.m
    if tok < len(ids):
        out.append((ids[tok:], False))
    return out


def rag_prompt(handle: ModelHandle, passages: Sequence[str], question: str) -> str:
    """kvrag's RAG prompt (``kvrag.layout.prompt.rag_prompt``: chat messages rendered with the chat
    template, plain text without one); the same layout the demo and the benchmark use, so
    training matches inference."""
    prompt = layout(handle.tokenizer, list(passages), question)
    return prompt if isinstance(prompt, str) else render_messages(handle.tokenizer, prompt)


def answer_ids(handle: ModelHandle, answer: str) -> list[int]:
    """Answer ids followed by the end-of-turn token (the model must learn to stop)."""
    ids = handle.encode(answer)
    eos = handle.tokenizer.eos_token_id
    return ids + ([eos] if eos is not None else [])


def pick_passages(item: QAExample[str], n: int, rng: random.Random, *, shuffle: bool = True) -> list[str]:
    """``n`` passages of ``item``, always including one that contains a gold answer when there
    is one (a QA example whose answer is nowhere in the context teaches guessing, not reading);
    in random order (``shuffle``, the paper's), else in the item's own order (consecutive
    chunks of one document, whose later chunk may continue the earlier one's sentence
    subject, keep the order that makes them readable)."""
    idx = list(range(len(item.passages)))
    low = [a.lower() for a in item.answers]
    gold = [i for i in idx if any(a in item.passages[i].lower() for a in low)]
    chosen = [rng.choice(gold)] if gold else []
    rest = [i for i in idx if i not in chosen]
    rng.shuffle(rest)
    chosen += rest[: max(0, n - len(chosen))]
    if shuffle:
        rng.shuffle(chosen)  # the paper shuffles the documents (A.2)
    else:
        chosen.sort()
    return [item.passages[i] for i in chosen]


def make_sample(
    handle,
    item: QAExample[str],
    rng: random.Random,
    *,
    docs: int,
    max_passage_chars: int,
    link_tokens: int,
    max_docs: int,
    shuffle: bool = True,
) -> Sample:
    """The training sample of ``item``: ``docs`` of its passages (:func:`pick_passages`), each
    cut to ``max_passage_chars``, in the RAG prompt, answered by its first gold answer."""
    passages = [truncate_passage(p, max_passage_chars) for p in pick_passages(item, docs, rng, shuffle=shuffle)]
    # Identical passages would be one chunk: drop duplicates, keeping order.
    passages = list(dict.fromkeys(p for p in passages if p.strip()))
    prompt = rag_prompt(handle, passages, item.question)
    # Documents read the anchor KVRag(chunk_anchor="auto") precomputes chunks behind.
    return build_sample(
        prompt_pieces(handle, prompt, passages),
        answer_ids(handle, item.answers[0]),
        link_tokens,
        max_docs,
        handle.anchor_ids(),
    )


def qa_sampler(
    handle: ModelHandle, items: Sequence[QAExample[str]], cfg: TrainConfig
) -> Callable[[random.Random], tuple[Sample, str]]:
    """``sampler(rng) -> (Sample, "data")``: a sample of one of ``items`` drawn by ``rng``, as
    ``cfg`` asks (passage count, order and length, link tokens)."""

    def sampler(rng: random.Random) -> tuple[Sample, str]:
        item = items[rng.randrange(len(items))]
        # A varying count trains every link row up to ``docs`` with the prompt lengths of
        # each place (the paper's data mixes prompts of many sizes); drawn only when asked,
        # so runs without it keep their sample sequence.
        n_docs = rng.randint(cfg.min_docs, cfg.docs) if cfg.min_docs else cfg.docs
        return make_sample(
            handle,
            item,
            rng,
            docs=n_docs,
            max_passage_chars=cfg.max_passage_chars,
            link_tokens=cfg.link_tokens,
            max_docs=cfg.max_docs,
            shuffle=cfg.passage_order == "shuffle",
        ), "data"

    return sampler
