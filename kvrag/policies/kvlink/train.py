"""KVLink training: fine-tuning with the link-token attention mask (``kvrag train kvlink``).

KVLink (paper sections 2.3 and A.2) fine-tunes the model so that separately encoded documents
plus a few *link tokens* after each of them answer as well as a full prefill. The training
sequence is the inference prompt itself::

    template | doc 1 | link_1,1..link_1,K | doc 2 | link_2,1..link_2,K | ... | question | answer

with the paper's mask (its reference code's ``make_segment_mask``): a token of document ``d``
attends only to earlier tokens of ``d`` and to a private copy of the anchor kvrag precomputes
chunks behind (``ModelHandle.anchor_ids``), so its K/V are exactly the chunk cache kvrag stores:
documents do *not* see the template; every other token (template, link tokens, question,
answer) attends causally to everything before it. The sequence is laid out by the code that
lays out queries (``kvrag.query.align.place_chunks``): the tokenizer's ids of the whole prompt, a
document being the run of its tokens the chunk cache serves (``prompt_pieces``), so training
sees the token ids, positions and link-token places inference runs. The loss is on the answer
tokens. The n-th document's link tokens are their own embeddings (``link<n>-<k>``, A.2), so
the trainable link table is ``[max_docs, K, E]``; documents past ``max_docs`` reuse the last
row. Only the rows training reached are saved (``trained_rows``: at most ``docs`` documents per
sample), so a later document reuses the last *trained* row, never an untrained initial one.

The forward pass is kvrag's own layer loop (``Arch.qkv`` / ``Arch.attention`` /
``Arch.finish_layer``) with that mask, run with gradients; it is the same function the fusion
engine computes at query time (a test holds them equal). A step's samples run as one forward,
their rows packed end to end, each attending to its own rows only (``forward_hidden_batch``).
The model is adapted with LoRA (``peft``) or not at all (``lora_rank=0``: link embeddings only,
the model — and its fingerprint and chunk caches — stay unchanged).

The result is written as an adapter directory (``kvrag.policies.kvlink.adapter``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvrag import qa_data
from kvrag.arch import Arch
from kvrag.model import ModelHandle
from kvrag.model.digests import sha256_file
from kvrag.policies.kvlink.adapter import (
    FORMAT_VERSION,
    LINKS_FILE,
    LORA_FILE,
    META_FILE,
    KVLinkAdapter,
    KVLinkError,
    adapter_key,
    check_fits,
    default_adapter_dirs,
    find_adapter,
    load_adapter,
    save_adapter,
)
from kvrag.policies.kvlink.policy import mean_embedding

log = logging.getLogger("kvrag.kvlink")

OBJECTIVES = ("answer", "distill")
PASSAGE_ORDERS = ("shuffle", "source")


# ---- training data ---------------------------------------------------------------------
@dataclass
class QAItem:
    """One QA example: question, gold answers, candidate passages (title + text)."""

    question: str
    answers: list[str]
    passages: list[str]


def load_qa(path: str | os.PathLike) -> list[QAItem]:
    """QA examples from a file in any format :mod:`kvrag.qa_data` reads (MuSiQue/KVLink's
    ``{"question", "answers", "ctxs": [{"title", "text"}]}``, HotpotQA, LongBench, SQuAD; a JSON
    list or JSON lines). Each passage is ``title: text`` (the text alone without a title)."""
    try:
        records = qa_data.load_records(path)
    except (OSError, ValueError) as e:
        raise KVLinkError(f"training data: {e}") from None
    items = []
    for r in records:
        for j, (title, text) in enumerate(r.passages):
            if not text.strip():
                raise KVLinkError(f"{path}: example {r.id} ctx {j} has no 'text' string (empty)")
        items.append(
            QAItem(r.question, r.answers, [f"{title}: {text}" if title.strip() else text for title, text in r.passages])
        )
    return items


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

    def without_links(self) -> "Sample":
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
    chunk cache (``KVRag.chunk_ids``) shares with the prompt (``kvrag.query.align.match_chunk``);
    edge tokens the two tokenizations split otherwise are plain tokens, as at query time.

    Returns ``(ids, False)`` for plain pieces and ``(ids, True, hidden)`` for documents, where
    ``hidden`` are the chunk tokens before the reused run (its first token merged with the text
    before it): the cached K/V were computed behind them, so the document reads them too.

    Tokenizing each segment alone instead would train on another sequence than the one served:
    with SmolLM2 a blank line between passages is one token alone (``"\\n\\n"``) but two inside
    the prompt (``"\\n"``, ``"\\n"``), shifting every later position."""
    from kvrag.query.align import chunk_spans, place_chunks, prompt_prefix, prompt_tokens, spell_chunk
    from kvrag.query.segment import Segmenter

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
    """kvrag's RAG prompt (``kvrag.query.prompt.rag_prompt``: chat messages rendered with the chat
    template, plain text without one); the same layout the demo and the benchmark use, so
    training matches inference."""
    from kvrag.query.prompt import rag_prompt as layout
    from kvrag.query.prompt import render_messages

    prompt = layout(handle.tokenizer, list(passages), question)
    return prompt if isinstance(prompt, str) else render_messages(handle.tokenizer, prompt)


def answer_ids(handle: ModelHandle, answer: str) -> list[int]:
    """Answer ids followed by the end-of-turn token (the model must learn to stop)."""
    ids = handle.encode(answer)
    eos = handle.tokenizer.eos_token_id
    return ids + ([eos] if eos is not None else [])


def pick_passages(item: QAItem, n: int, rng: random.Random, *, shuffle: bool = True) -> list[str]:
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
    item: QAItem,
    rng: random.Random,
    *,
    docs: int,
    max_passage_chars: int,
    link_tokens: int,
    max_docs: int,
    shuffle: bool = True,
) -> Sample:
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


# ---- the forward pass with the KVLink mask ---------------------------------------------
def kvlink_mask(segment: torch.Tensor, private: torch.Tensor | None = None) -> torch.Tensor:
    """bool [N, N] (True = may attend): causal, and a document token (segment d >= 1) sees only
    its own document; every other token sees everything before it except ``private`` [N]
    tokens (anchor copies), which only their own document sees."""
    n = segment.numel()
    idx = torch.arange(n, device=segment.device)
    causal = idx[:, None] >= idx[None, :]
    own = segment[:, None] == segment[None, :]
    shared = segment[:, None] == 0
    if private is not None:
        shared = shared & ~private[None, :]
    return causal & (shared | own)


def forward_hidden(arch: Arch, sample: Sample, links: torch.Tensor | None) -> torch.Tensor:
    """Last-layer hidden states [N, E] of ``sample`` under the KVLink mask, differentiable.

    links: the link table [max_docs, K, E] (ignored when the sample has no link slots)."""
    return forward_hidden_batch(arch, [sample], links)[0]


def forward_hidden_batch(arch: Arch, samples: Sequence[Sample], links: torch.Tensor | None) -> list[torch.Tensor]:
    """Last-layer hidden states [N_i, E] of each of ``samples`` under its KVLink mask, from one
    forward over their rows packed end to end ([sum N_i, E]), differentiable.

    The token-wise work of a layer (norms, projections with their LoRA, MLP) runs once over
    every row, which is what batching buys on a GPU; each sample's attention runs over its own
    rows only, with its own mask [N_i, N_i] and RoPE tables, so no row sees another sample and
    no padding is computed (as batched decoding does, ``kvrag.query.batch``). Each result
    equals ``forward_hidden`` of its sample alone, up to float rounding.

    links: the link table [max_docs, K, E] (ignored when no sample has link slots)."""
    if not samples:
        raise ValueError("forward_hidden_batch: no samples")
    dev = arch.device
    ids, slot = _join([s.ids for s in samples]).to(dev), _join([s.link_slot for s in samples]).to(dev)
    hidden = arch.embed(ids)
    is_link = slot >= 0
    if bool(is_link.any()):
        assert links is not None, "a sample with link slots needs the link table"
        flat = links.reshape(-1, links.shape[-1]).to(device=dev, dtype=hidden.dtype)
        hidden = torch.where(is_link[:, None], flat[slot.clamp(min=0)], hidden)
    masks, positions, tables = [], [], []
    for s in samples:
        private = s.private.to(dev) if s.private is not None else None
        masks.append(kvlink_mask(s.segment.to(dev), private))
        pos = (s.positions if s.positions is not None else torch.arange(s.n)).to(dev)
        positions.append(pos)
        # Per sample: LongRoPE / dynamic NTK choose their frequencies from the largest
        # position of the call, which must be the sample's own.
        tables.append(arch.cos_sin(pos))
    cs = (_join([c for c, _ in tables]), _join([sn for _, sn in tables]))
    sizes = [s.n for s in samples]
    starts = [0, *itertools.accumulate(sizes[:-1])]
    for layer in range(arch.n_layers):
        q, k, v, _ = arch.qkv(layer, hidden, cs)  # q [H, sum N_i, D], k/v [Hkv, sum N_i, D]
        parts = [
            arch.attention(q[:, a : a + n], k[:, a : a + n], v[:, a : a + n], arch.windowed(layer, m, pos, pos))
            for a, n, m, pos in zip(starts, sizes, masks, positions)
        ]
        hidden = arch.finish_layer(layer, hidden, _join(parts))
    return list(hidden.split(sizes))


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """The samples' rows end to end (dim 0); one sample's as they are, with no copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def answer_logits(arch: Arch, sample: Sample, links: torch.Tensor | None) -> torch.Tensor:
    """Logits [T, V] predicting the T answer tokens (row t predicts ids[answer_start + t])."""
    return answer_logits_batch(arch, [sample], links)[0]


def answer_logits_batch(arch: Arch, samples: Sequence[Sample], links: torch.Tensor | None) -> list[torch.Tensor]:
    """``answer_logits`` of each of ``samples`` ([T_i, V] each) from one packed forward
    (``forward_hidden_batch``) and one LM-head call over all their answer rows."""
    hidden = forward_hidden_batch(arch, samples, links)
    rows = [h[s.answer_start - 1 : s.n - 1] for h, s in zip(hidden, samples)]
    return list(arch.logits(_join(rows)).split([r.shape[0] for r in rows]))


def _loss(logits: torch.Tensor, sample: Sample, objective: str, teacher_logits: torch.Tensor | None) -> torch.Tensor:
    """The loss of one sample from its answer logits [T, V] (see ``sample_loss``)."""
    if objective == "answer":
        return F.cross_entropy(logits, sample.ids[sample.answer_start :].to(logits.device))
    if teacher_logits is None:
        raise KVLinkError("objective 'distill' needs the teacher's logits of every sample")
    logp = F.log_softmax(logits, dim=-1)
    t_logp = F.log_softmax(teacher_logits.to(logp.device), dim=-1)
    return F.kl_div(logp, t_logp, log_target=True, reduction="batchmean")


def sample_loss(arch: Arch, sample: Sample, links, objective: str, teacher_logits=None) -> torch.Tensor:
    """'answer': cross-entropy on the answer tokens (the paper). 'distill': KL(teacher || model)
    per answer position, the teacher being the base model's full prefill over the same tokens
    without link tokens — it optimises fidelity to full prefill rather than the gold answer.
    Either is a mean over the sample's T answer tokens; teacher_logits [T, V]."""
    return _loss(answer_logits(arch, sample, links), sample, objective, teacher_logits)


def batch_loss(
    arch: Arch,
    samples: Sequence[Sample],
    links,
    objective: str,
    teacher_logits: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The mean over ``samples`` of each one's ``sample_loss`` (a scalar), from one packed
    forward (``forward_hidden_batch``): its gradients are those of accumulating
    ``sample_loss / len(samples)`` sample by sample, up to float rounding. teacher_logits:
    [T_i, V] per sample ('distill')."""
    teachers = list(teacher_logits) if teacher_logits is not None else [None] * len(samples)
    if len(teachers) != len(samples):
        raise ValueError(f"batch_loss: {len(teachers)} teacher logits for {len(samples)} samples")
    logits = answer_logits_batch(arch, samples, links)
    return torch.stack([_loss(lg, s, objective, t) for lg, s, t in zip(logits, samples, teachers)]).mean()


# ---- training ----------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Hyper-parameters of ``kvrag train kvlink`` (see ``kvrag train kvlink --help``)."""

    data: str
    steps: int = 200
    lora_rank: int = 8
    lora_alpha: float | None = None  # None: 2 * rank
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    link_tokens: int = 5
    max_docs: int = 10
    docs: int = 3
    min_docs: int = 0  # > 0: each sample draws its passage count uniformly from [min_docs, docs]
    passage_order: str = "shuffle"  # or "source": the passages in the item's order
    max_passage_chars: int = 0
    holdout: int = 0
    objective: str = "answer"
    lr: float = 2e-4
    link_lr: float = 1e-3
    batch: int = 1
    # True: a step's ``batch`` samples run as one packed forward (``batch_loss``); False: one
    # forward each, gradients accumulated (less memory). The same step, up to float rounding.
    batched: bool = True
    warmup: int = 10
    max_tokens: int = 2048
    seed: int = 0
    log_every: int = 10
    max_seconds: float = 0.0  # > 0: stop after this much training time (CPU budgets); 0 = run all steps
    init: str | None = None  # an adapter directory to start from ("auto": the model's own); None: fresh

    def validate(self) -> None:
        def need(ok, msg):
            if not ok:
                raise KVLinkError(msg)

        need(isinstance(self.steps, int) and self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        need(isinstance(self.lora_rank, int) and self.lora_rank >= 0, f"lora_rank must be >= 0, got {self.lora_rank}")
        need(self.lora_alpha is None or self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}")
        need(self.lora_rank == 0 or len(self.lora_targets) > 0, "lora_targets is empty")
        need(
            isinstance(self.link_tokens, int) and 0 <= self.link_tokens <= 64,
            f"link_tokens must be in [0, 64], got {self.link_tokens}",
        )
        need(
            self.lora_rank > 0 or self.link_tokens > 0,
            "nothing to train: lora_rank=0 and link_tokens=0 (train LoRA, link tokens, or both)",
        )
        need(isinstance(self.max_docs, int) and self.max_docs >= 1, f"max_docs must be >= 1, got {self.max_docs}")
        need(isinstance(self.docs, int) and self.docs >= 1, f"docs must be >= 1, got {self.docs}")
        need(
            isinstance(self.min_docs, int) and 0 <= self.min_docs <= self.docs,
            f"min_docs must be in [0, docs={self.docs}] (0 = always docs), got {self.min_docs}",
        )
        need(
            self.passage_order in PASSAGE_ORDERS,
            f"passage_order must be one of {PASSAGE_ORDERS}, got {self.passage_order!r}",
        )
        need(self.max_passage_chars >= 0, f"max_passage_chars must be >= 0, got {self.max_passage_chars}")
        need(self.holdout >= 0, f"holdout must be >= 0, got {self.holdout}")
        need(self.objective in OBJECTIVES, f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        need(self.lr > 0 and self.link_lr > 0, "learning rates must be > 0")
        need(isinstance(self.batch, int) and self.batch >= 1, f"batch must be >= 1, got {self.batch}")
        need(isinstance(self.batched, bool), f"batched must be True or False, got {self.batched!r}")
        need(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        need(self.max_tokens >= 16, f"max_tokens must be >= 16, got {self.max_tokens}")
        need(self.max_seconds >= 0, f"max_seconds must be >= 0, got {self.max_seconds}")
        need(self.init is None or str(self.init).strip() != "", "init must name an adapter directory or 'auto'")


@dataclass
class TrainResult:
    out: Path
    losses: list[float]
    adapter: KVLinkAdapter
    meta: dict = field(default_factory=dict)


def _lr_lambda(cfg: TrainConfig):
    # Linear warm-up, then cosine decay to 10%: the usual fine-tuning schedule (the paper's
    # runs use cosine with warm-up too).
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / (cfg.warmup + 1)
        span = max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / span)))

    return f


class _SignalStop:
    """While entered, SIGTERM and SIGINT only note that they came (``received``: the first
    one's number), so the training loop can finish its step and save before it stops.

    Python runs signal handlers in the main thread only, so elsewhere (a server's worker
    thread) nothing is installed and the signals act as before. The first signal puts the
    previous handlers back: a second one acts as it would without the trainer (a second
    Ctrl-C stops at once). Leaving restores them in any case, also on an error."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_SignalStop":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                # None: a handler set outside Python, which signal.signal could not put back.
                if signal.getsignal(sig) is not None:
                    self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __exit__(self, *exc) -> None:
        self._restore()


def train_kvlink(
    handle: ModelHandle,
    cfg: TrainConfig,
    out: str | os.PathLike | None = None,
    *,
    items: Sequence[QAItem] | None = None,
    command: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    force: bool = False,
    sampler: Callable[[random.Random], tuple[Sample, str]] | None = None,
    data_meta: dict | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    stop_at_step: int | None = None,
    bar: bool = False,
) -> TrainResult:
    """Fine-tune ``handle``'s model (a copy) for KVLink and save the adapter to ``out``
    (default: ``$KVRAG_HOME/kvlink/<model key>/``, where ``adapter="auto"`` finds it).

    ``items`` overrides ``cfg.data`` (tests); the last ``cfg.holdout`` examples are never used.
    ``sampler(rng) -> (Sample, source name)`` replaces the QA examples altogether (``kvrag
    tune``'s mixture of sources, :mod:`kvrag.policies.kvlink.data`); ``data_meta`` (its sources,
    counts, hashes) goes into ``kvlink.json``. Checkpoints (:data:`CHECKPOINT_DIR` in ``out``:
    LoRA and link weights, optimizer, scheduler, both RNGs -- the RNG being the data cursor --
    step, losses) are written every ``checkpoint_every`` steps and at the end (0: neither) and
    whenever the run stops early (``cfg.max_seconds``, ``stop_at_step``, or SIGTERM / SIGINT
    received while training in the main thread: the step finishes, then the run saves and
    returns); ``resume`` continues from the one in ``out``, and a resumed run computes what an
    uninterrupted one does. ``bar``: a tqdm
    progress bar with the loss. Returns the output directory, the per-step losses and the
    loaded adapter."""
    cfg.validate()
    say = progress or (lambda msg: log.info("%s", msg))
    out_dir = Path(out).expanduser() if out is not None else default_adapter_dirs(handle)[0]
    if (out_dir / META_FILE).exists() and not force and not resume:
        more = (
            ", or resume=True (--resume) to continue its run"
            if (out_dir / CHECKPOINT_DIR / _CKPT_FILE).is_file()
            else ""
        )
        raise KVLinkError(f"{out_dir} already holds a KVLink adapter; pass force=True (--force) to overwrite it{more}")
    if checkpoint_every < 0:
        raise KVLinkError(f"checkpoint_every must be >= 0 (0 = only when stopping early), got {checkpoint_every}")
    from kvrag.outpaths import check_dir

    check_dir(out_dir, "adapter directory", KVLinkError)  # now, not after the training
    n_train = None  # QA examples trained on (None: a caller's sampler)
    data_sha = None
    if sampler is None:
        data = list(items) if items is not None else load_qa(cfg.data)
        if cfg.holdout >= len(data):
            raise KVLinkError(f"holdout={cfg.holdout} leaves no training examples out of {len(data)}")
        train_items = data[: len(data) - cfg.holdout]
        n_train = len(train_items)
        data_sha = sha256_file(Path(cfg.data)) if items is None else None

        def sampler(rng: random.Random) -> tuple[Sample, str]:
            item = train_items[rng.randrange(len(train_items))]
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

    # Checked before the model is copied: a mismatched adapter fails in seconds, not after it.
    start_from = _start_adapter(handle, cfg) if cfg.init is not None else None
    init_meta = None if start_from is None else _init_record(start_from)
    # What a resumed run must share with the checkpoint's: every option that changes a step,
    # the data (its digests) and the adapter it started from (its weights' digests).
    identity = {**_resumable_config(cfg), "data_sha256": data_sha, "data": data_meta}
    if init_meta is not None:
        identity["init_digest"] = {k: init_meta[k] for k in ("links_sha256", "lora_digest")}
    ckpt = _load_checkpoint(out_dir, identity) if resume else None
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)

    model = copy.deepcopy(handle.model)
    peft_model = None
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        # peft adapts whichever targets exist and skips the rest silently: Phi-3's fused
        # qkv_proj would leave only o_proj adapted under the default q/k/v/o targets.
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        missing = [t for t in cfg.lora_targets if t not in names]
        if missing:
            attn = sorted(n for n, _ in Arch(model).layers[0].self_attn.named_children())
            raise KVLinkError(
                f"LoRA targets {', '.join(missing)} name no module of this model (its attention "
                f"has {', '.join(attn)}); pass --lora-targets / lora_targets that exist"
            )
        lcfg = LoraConfig(
            r=cfg.lora_rank,
            # peft scales by lora_alpha / r and takes a float at run time; its annotation says int.
            lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank,  # type: ignore[arg-type]
            target_modules=list(cfg.lora_targets),
            lora_dropout=0.0,
            bias="none",
        )
        try:
            peft_model = get_peft_model(model, lcfg)
        except ValueError as e:  # e.g. a target module name the model does not have
            raise KVLinkError(f"cannot attach LoRA to the model: {e}") from None
    else:
        model.requires_grad_(False)
    # peft injects its LoRA layers in place, so ``model`` itself is the adapted network.
    arch = Arch(model)
    hidden = arch.hidden_size
    init = mean_embedding(arch)
    links = torch.nn.Parameter(init.expand(cfg.max_docs, cfg.link_tokens, hidden).clone().to(arch.device))
    groups: list[dict[str, Any]] = []
    lora_params = [p for p in model.parameters() if p.requires_grad]
    if lora_params:
        groups.append({"params": lora_params, "lr": cfg.lr})
    if cfg.link_tokens > 0:
        groups.append({"params": [links], "lr": cfg.link_lr})
    if start_from is not None:
        _warm_start(start_from, peft_model, links)
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))

    def teachers(samples: list[Sample]) -> list[torch.Tensor | None]:
        """The distillation targets [T_i, V] of ``samples`` (None each for 'answer'): a
        sampler's own, else the base model's logits over the plain prompt, one packed no-grad
        forward for all the samples that need them."""
        if cfg.objective != "distill":
            return [None] * len(samples)
        out: list[torch.Tensor | None] = [s.teacher_logits for s in samples]
        need = [i for i, t in enumerate(out) if t is None]
        if need:
            plain = [samples[i].without_links() for i in need]
            plain = [Sample(p.ids, p.link_slot, torch.zeros_like(p.segment), p.answer_start) for p in plain]
            ctx = peft_model.disable_adapter() if peft_model is not None else contextlib.nullcontext()
            with torch.no_grad(), ctx:
                for i, logits in zip(need, answer_logits_batch(arch, plain, None)):
                    out[i] = logits
        return out

    losses: list[float] = []
    t0 = time.perf_counter()
    skipped = 0
    # Link-table rows some sample used (the rest keep their initial value); a warm start's
    # rows were trained by its own run.
    trained_rows = 0 if start_from is None else start_from.max_docs
    source_counts: dict[str, int] = {}
    sittings: list[dict] = []  # each sitting of a resumed run: its command and the steps it ran
    start = 0
    if ckpt is not None:
        if peft_model is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(peft_model, ckpt["lora"])
        with torch.no_grad():
            links.copy_(ckpt["links"].to(links.device))
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        torch.set_rng_state(ckpt["torch_rng"])
        rng.setstate(_rng_state(ckpt["py_rng"]))
        start, losses = int(ckpt["step"]), [float(x) for x in ckpt["losses"]]
        skipped, trained_rows = int(ckpt["skipped"]), int(ckpt["trained_rows"])
        source_counts = {str(k): int(v) for k, v in json.loads(ckpt["source_counts"]).items()}
        sittings = json.loads(ckpt["sittings"])
        say(f"resuming from {out_dir / CHECKPOINT_DIR} at step {start}/{cfg.steps}")

    sittings.append({"command": list(command) if command is not None else None, "from_step": start})

    def checkpoint(step: int) -> None:
        sittings[-1].update(to_step=step, seconds=round(time.perf_counter() - t0, 1))
        _save_checkpoint(
            out_dir,
            identity,
            {
                "lora": _lora_state(peft_model),
                "links": links.detach().cpu(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "py_rng": rng.getstate(),
                "step": step,
                "losses": torch.tensor(losses, dtype=torch.float64),
                "skipped": skipped,
                "trained_rows": trained_rows,
                "source_counts": json.dumps(source_counts),
                "sittings": json.dumps(sittings),
            },
        )

    # A sampler that can draw several samples at once (``TaskSampler.draw``: their teacher
    # answers generated together) serves a packed step; the others are called once a sample.
    draw_many = getattr(sampler, "draw", None) if cfg.batched else None

    def draw() -> list[Sample]:
        """The step's ``cfg.batch`` samples in the sampler's order (the RNG is the data cursor,
        so the draws never depend on how the samples are then run). Drawn in rounds of as many
        as are still missing, so the samples drawn, skipped included, are those one at a time
        would give."""
        nonlocal skipped, trained_rows
        drawn: list[Sample] = []
        while len(drawn) < cfg.batch:
            need = cfg.batch - len(drawn)
            for sample, source in draw_many(rng, need) if draw_many is not None else [sampler(rng)]:
                if sample.n > cfg.max_tokens:
                    skipped += 1
                    if skipped > 100 * cfg.steps:
                        raise KVLinkError(
                            f"almost every example exceeds max_tokens={cfg.max_tokens}; "
                            "use fewer docs or --max-passage-chars"
                        )
                    continue
                trained_rows = max(trained_rows, min(int(sample.segment.max()), cfg.max_docs))
                source_counts[source] = source_counts.get(source, 0) + 1
                drawn.append(sample)
        return drawn

    # SIGTERM (`timeout`, a job scheduler) or Ctrl-C while training: finish the step, then stop
    # as the time budget does (checkpoint and adapter, resumable).
    with _SignalStop() as stop:
        pbar = None
        if bar:
            from tqdm import tqdm

            pbar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True)
        for step in range(start, cfg.steps):
            opt.zero_grad(set_to_none=True)
            samples = draw()
            if cfg.batched:
                loss = batch_loss(arch, samples, links, cfg.objective, teachers(samples))
                loss.backward()
                total = float(loss.detach())
            else:
                total = 0.0
                for sample in samples:
                    loss = sample_loss(arch, sample, links, cfg.objective, teachers([sample])[0]) / cfg.batch
                    loss.backward()
                    total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
            opt.step()
            sched.step()
            losses.append(total)
            if step == start:  # the step that pays one-time costs (kernel choice, allocator growth)
                sittings[-1]["first_step_seconds"] = round(time.perf_counter() - t0, 2)
            recent = losses[-cfg.log_every :]
            if pbar is not None:
                pbar.update(1)
                pbar.set_postfix(loss=f"{sum(recent) / len(recent):.4f}")
            elif (step + 1) % cfg.log_every == 0 or step == start or step + 1 == cfg.steps:
                say(
                    f"step {step + 1}/{cfg.steps}  loss {sum(recent) / len(recent):.4f}  "
                    f"{(time.perf_counter() - t0) / (step + 1 - start):.2f} s/step"
                )
            last = step + 1 == cfg.steps
            if stop_at_step is not None and step + 1 >= stop_at_step and not last:
                say(f"stopping at step {step + 1} as asked; saving (resume to go on)")
                checkpoint(step + 1)
                break
            if stop.received is not None and not last:
                name = signal.Signals(stop.received).name
                say(f"{name} received: stopping after {step + 1} steps; saving (resume to go on)")
                checkpoint(step + 1)
                break
            if cfg.max_seconds and time.perf_counter() - t0 > cfg.max_seconds and not last:
                say(f"time budget of {cfg.max_seconds:.0f} s reached after {step + 1} steps; saving (resume to go on)")
                checkpoint(step + 1)
                break
            if checkpoint_every and (last or (step + 1) % checkpoint_every == 0):
                checkpoint(step + 1)  # at the end too: resuming a finished run re-saves it, no error
        if pbar is not None:
            pbar.close()
        sittings[-1].update(to_step=len(losses), seconds=round(time.perf_counter() - t0, 1))

        meta = {
            "format": FORMAT_VERSION,
            "base_key": adapter_key(handle),
            "base_fingerprint": handle.fingerprint,
            "base_source": handle.source,
            "link_tokens": cfg.link_tokens,
            "max_docs": cfg.max_docs,
            "trained_rows": max(1, trained_rows),
            "lora": _lora_record(cfg),
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
            "data_sha256": data_sha,
            "train_examples": n_train,
            "init": init_meta,
            "data": data_meta,
            "samples_by_source": source_counts,
            "command": list(command) if command is not None else None,
            "sittings": sittings,
            "steps": len(losses),
            "complete": len(losses) == cfg.steps,
            "losses": [round(x, 6) for x in losses],
            "train_seconds": round(sum(x.get("seconds", 0.0) for x in sittings), 1),  # every sitting
            "torch": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        save_adapter(out_dir, links.detach()[: max(1, trained_rows)], peft_model, meta)
        say(f"saved KVLink adapter to {out_dir}")
        return TrainResult(out_dir, losses, load_adapter(out_dir), meta)


def _lora_record(cfg: TrainConfig) -> dict | None:
    """The LoRA shape ``kvlink.json`` records (None: links only)."""
    if cfg.lora_rank == 0:
        return None
    return {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha or 2 * cfg.lora_rank, "targets": list(cfg.lora_targets)}


# ---- warm start --------------------------------------------------------------------------
def _start_adapter(handle: ModelHandle, cfg: TrainConfig) -> KVLinkAdapter:
    """The adapter ``cfg.init`` names, checked against ``handle`` and ``cfg``: the same model,
    link tokens and LoRA shape (a KVLinkError names what differs)."""
    if cfg.init == "auto":
        path = find_adapter(handle)
        if path is None:
            dirs = ", ".join(str(p) for p in default_adapter_dirs(handle))
            raise KVLinkError(f"init='auto': no KVLink adapter for this model to start from (looked in {dirs})")
    else:
        path = Path(str(cfg.init)).expanduser()
    ad = load_adapter(path)
    check_fits(ad, handle)
    where = f"the adapter to start from ({ad.path})"
    if ad.link_tokens != cfg.link_tokens:
        raise KVLinkError(f"{where} has {ad.link_tokens} link tokens per document; link_tokens is {cfg.link_tokens}")
    if ad.max_docs > cfg.max_docs:
        raise KVLinkError(f"{where} has {ad.max_docs} trained link rows; max_docs must be >= {ad.max_docs}")
    lora, want = ad.meta.get("lora"), _lora_record(cfg)
    have = None if lora is None else {k: lora.get(k) for k in ("rank", "alpha", "targets")}
    if have != want:
        raise KVLinkError(f"{where} has LoRA {have}; these options give {want}: pass the same LoRA options")
    return ad


def _init_record(ad: KVLinkAdapter) -> dict:
    """What ``kvlink.json`` records of the adapter a run started from: where, its weights'
    digests, and its own training (its ``init`` too, so a chain of runs stays traceable)."""
    assert ad.path is not None
    m = ad.meta
    return {
        "path": str(ad.path),
        "links_sha256": sha256_file(ad.path / LINKS_FILE),
        "lora_digest": ad.lora_digest,
        "steps": m.get("steps"),
        "train_seconds": m.get("train_seconds"),
        "data_sha256": m.get("data_sha256"),
        "command": m.get("command"),
        "init": m.get("init"),
    }


def _warm_start(ad: KVLinkAdapter, peft_model, links: torch.nn.Parameter) -> None:
    """Load ``ad``'s LoRA weights into ``peft_model`` and its link rows into ``links``
    [max_docs, K, E]; rows past the adapter's take its last row, the one its inference serves
    there (``KVLinkAdapter.links_for``)."""
    if peft_model is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        assert ad.path is not None
        state = load_file(str(ad.path / LORA_FILE))
        result = set_peft_model_state_dict(peft_model, state)
        # peft returns torch's load result: a LoRA weight the file lacks would stay random.
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        if missing:
            raise KVLinkError(f"the adapter to start from ({ad.path}) lacks LoRA weights: {missing[:3]}")
    with torch.no_grad():
        rows = ad.links.to(links.device, links.dtype)
        links[: rows.shape[0]] = rows
        links[rows.shape[0] :] = rows[-1]


# ---- checkpoints (resumable runs) ----------------------------------------------------------
CHECKPOINT_DIR = "checkpoint"
_CKPT_FILE = "state.pt"
_CKPT_CONFIG = "config.json"
# Options a resumed sitting may change: they decide when a sitting stops, what it prints or
# how a step is run (``batched``: the same step, up to float rounding), not what it computes.
_PER_SITTING = ("max_seconds", "log_every", "batched")


def _resumable_config(cfg: TrainConfig) -> dict:
    d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    return {k: v for k, v in d.items() if k not in _PER_SITTING}


def _lora_state(peft_model) -> dict:
    if peft_model is None:
        return {}
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(peft_model).items()}


def _rng_state(state) -> tuple:
    """``random.Random.getstate()`` as saved (its tuples may come back as lists)."""
    version, internal, gauss = state
    return (int(version), tuple(int(x) for x in internal), gauss)


def _save_checkpoint(out_dir: Path, identity: dict, state: dict) -> None:
    """Write ``out_dir/checkpoint/``: what a resume must match (options, data digests), then
    the state (atomically: a crash mid-write leaves the previous checkpoint)."""
    d = out_dir / CHECKPOINT_DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / _CKPT_CONFIG).write_text(json.dumps(identity, indent=1, default=str), encoding="utf-8")
    tmp = d / f".{_CKPT_FILE}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, d / _CKPT_FILE)


def _load_checkpoint(out_dir: Path, identity: dict) -> dict:
    """The checkpoint in ``out_dir`` (a KVLinkError naming what is wrong: none, another run's
    options or data, unreadable). Loaded with ``weights_only``: a checkpoint is data, never code."""
    d = out_dir / CHECKPOINT_DIR
    if not (d / _CKPT_FILE).is_file():
        raise KVLinkError(f"nothing to resume: {d} holds no checkpoint ({_CKPT_FILE})")
    try:
        saved = json.loads((d / _CKPT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise KVLinkError(f"cannot read the checkpoint's {_CKPT_CONFIG} in {d}: {e}") from None
    now = json.loads(json.dumps(identity, default=str))
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if diff:
        show = lambda v: repr(v) if len(repr(v)) <= 80 else "<another value>"  # noqa: E731 - data digests are long
        raise KVLinkError(
            "the checkpoint in "
            + str(d)
            + " was made with other options or data: "
            + ", ".join(f"{k}={show(saved.get(k))} (now {show(now.get(k))})" for k in diff)
            + "; resume with the same ones"
        )
    try:
        return torch.load(d / _CKPT_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem
        raise KVLinkError(f"cannot read the checkpoint {d / _CKPT_FILE}: {type(e).__name__}: {e}") from None


def command_line() -> list[str]:
    """The command that is running (recorded in kvlink.json)."""
    launched = sys.argv[0] if sys.argv else ""
    # `kvrag ...` and `python -m kvrag ...` (argv[0] is then kvrag/__main__.py) are the same command.
    ours = launched.endswith("kvrag") or launched.endswith(os.path.join("kvrag", "__main__.py"))
    return ["kvrag", *sys.argv[1:]] if ours else list(sys.argv)
