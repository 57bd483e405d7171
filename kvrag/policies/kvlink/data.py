"""Training data for KVLink from real text, many sources (``kvrag tune``).

An adapter trained on one synthetic template learns that template, not chunk reuse. Reuse is a
property of *any* text, so the training prompts here are built from whatever real prose is at
hand, with targets that need no labels:

* **passage pools** -- lists of passages, no questions: the chunks a user ingested
  (``DiskStore.texts``), text files a user points at (cut into passages of ~N tokens at
  paragraph, then sentence boundaries), and prose every machine holds: the Python standard
  library's documentation (``pydoc_data.topics``), ``/usr/share/doc/*`` READMEs, copyright
  files and changelogs, and manual pages (``man -P cat``, only where ``man`` exists);
* **labelled QA** -- any file :mod:`kvrag.qa.files` reads (MuSiQue's paragraphs, HotpotQA, ...;
  ``kvrag train kvlink --data`` trains on such a file alone, :func:`load_qa`) and
  :mod:`kvrag.qa.synthetic`'s generator, one source among several.

A :class:`Mixture` draws one :class:`Task` at a time: 2-10 passages in shuffled order and an
instruction after them. From a passage pool the instruction is made from one passage (the
"answering" one): *continue* it (placed last), *summarise* the passage that begins with its
first words, or a *cloze* (quote the sentence that follows a given sentence); a share of the
prompts leaves the answering passage out. The target is the base model's own greedy answer with
full prefill (self-distillation, :class:`TaskSampler`): the adapter learns to answer from
reused chunks as the model answers from a full prefill, on any corpus. QA sources train on
their gold answer. Every task records its source; :meth:`Mixture.describe` gives the counts
and content hashes ``kvlink.json`` records.

Splits are deterministic: an item or passage belongs to ``"eval"`` when the sha256 of its key
(a QA question, a passage's text) falls in the held-out fraction (:func:`split_of`), so a run
trains on ``"train"`` and evaluation code reads the other half with the same function.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvrag.policies.kvlink.adapter import KVLinkError
from kvrag.policies.kvlink.samples import (
    Sample,
    answer_ids,
    build_sample,
    pick_passages,
    prompt_pieces,
    rag_prompt,
    truncate_passage,
)
from kvrag.qa import files, synthetic
from kvrag.qa.example import Passage, QAExample, rendered

log = logging.getLogger("kvrag.kvlink")

# Sources read from the machine itself: what `kvrag tune` adds when the user names no source.
MACHINE_SOURCES = ("pydoc", "usr-share-doc", "man")
TASK_KINDS = ("continue", "summary", "cloze")
SPLITS = ("train", "eval")
EVAL_PERCENT = 50  # MuSiQue's dev file has 100 items: half to train on, half held out
SYNTHETIC_SEED = 1000  # training draws the synthetic generator from here; `kvrag bench` uses seed 0

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_PARAGRAPH = re.compile(r"\n\s*\n")


# ---- splits ---------------------------------------------------------------------------------
def split_of(key: str, eval_percent: int = EVAL_PERCENT) -> str:
    """``"train"`` or ``"eval"`` for an item or passage key: the sha256 of the key modulo 100
    against ``eval_percent`` -- deterministic on every machine, independent of file order."""
    h = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "eval" if h < eval_percent else "train"


def _check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise KVLinkError(f"split must be one of {SPLITS} or None (all), got {split!r}")


# ---- passages from text -------------------------------------------------------------------
def approx_tokens(text: str) -> int:
    """A tokenizer-free token estimate (~4/3 tokens a word, English prose with a BPE vocabulary)."""
    return (4 * len(text.split()) + 2) // 3


def _is_prose(text: str, min_words: int = 0) -> bool:
    """Enough words, mostly letters: drops tables, file lists, hex dumps, separator lines."""
    if len(text.split()) < max(1, min_words):
        return False
    letters = sum(c.isalpha() for c in text)
    return letters >= 0.6 * len(text.replace(" ", "").replace("\n", ""))


def split_passages(
    text: str, max_tokens: int = 200, *, count: Callable[[str], int] = approx_tokens, min_words: int = 30
) -> list[str]:
    """``text`` cut into passages of at most ``max_tokens`` (by ``count``): whole paragraphs
    packed together while they fit, a longer paragraph cut at sentence ends, a longer sentence at
    words. Paragraphs that are not prose (:func:`_is_prose`) are dropped, and passages of fewer
    than ``min_words`` words."""
    if max_tokens < 16:
        raise KVLinkError(f"passage tokens must be >= 16, got {max_tokens}")
    units: list[str] = []
    for para in _PARAGRAPH.split(text.replace("\r\n", "\n")):
        para = " ".join(para.split())
        if not _is_prose(para):  # a table row or separator is not packed with the prose around it
            continue
        if count(para) <= max_tokens:
            units.append(para)
            continue
        for sent in _SENTENCE_END.split(para):
            while count(sent) > max_tokens:  # a run-on "sentence": cut at words
                words = sent.split()
                k = max(1, len(words) * max_tokens // max(1, count(sent)))
                units.append(" ".join(words[:k]))
                sent = " ".join(words[k:])
            if sent:
                units.append(sent)
    out, cur = [], ""
    for u in units:
        joined = f"{cur}\n\n{u}" if cur else u
        if cur and count(joined) > max_tokens:
            out.append(cur)
            cur = u
        else:
            cur = joined
    if cur:
        out.append(cur)
    return [p for p in out if _is_prose(p, min_words)]


def file_passages(paths: Iterable[str | os.PathLike], max_tokens: int = 200, **kw) -> list[str]:
    """Passages of text files (UTF-8; undecodable bytes replaced). A missing path is an error
    naming it; a directory reads its ``*.txt``/``*.md``/``*.rst`` files."""
    out = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            files = sorted(f for ext in ("*.txt", "*.md", "*.rst") for f in path.rglob(ext))
        elif path.is_file():
            files = [path]
        else:
            raise KVLinkError(f"text source {str(p)!r} does not exist")
        for f in files:
            out += split_passages(f.read_text(encoding="utf-8", errors="replace"), max_tokens, **kw)
    return out


def store_passages(store) -> list[str]:
    """The chunk texts a user ingested (``DiskStore.texts(None)``: every model's), each one
    passage as the user chunked it, in key order."""
    texts = store.texts(None)
    return [texts[k] for k in sorted(texts) if texts[k].strip()]


def pydoc_passages(max_tokens: int = 200, **kw) -> list[str]:
    """The Python standard library's topic documentation (``pydoc_data.topics``)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        log.info("source pydoc skipped: pydoc_data is not installed")
        return []
    return [p for name in sorted(topics) for p in split_passages(topics[name], max_tokens, **kw)]


def usr_share_doc_passages(
    max_tokens: int = 200, *, root: str | os.PathLike = "/usr/share/doc", max_files: int = 200, **kw
) -> list[str]:
    """README, copyright and changelog text files under ``/usr/share/doc`` (plain text only:
    gzipped changelogs are read through :mod:`gzip`); at most ``max_files``, in name order."""
    import gzip

    base = Path(root)
    if not base.is_dir():
        log.info("source usr-share-doc skipped: %s does not exist", base)
        return []
    wanted = re.compile(r"^(README|copyright|changelog|NEWS)", re.IGNORECASE)
    files = sorted(f for f in base.glob("*/*") if wanted.match(f.name) and f.is_file())[:max_files]
    out = []
    for f in files:
        try:
            raw = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
        except (OSError, EOFError):
            continue
        if b"\0" in raw[:4096]:
            continue  # binary
        out += split_passages(raw.decode("utf-8", errors="replace"), max_tokens, **kw)
    return out


def man_passages(
    max_tokens: int = 200, *, max_pages: int = 40, section_dir: str = "/usr/share/man/man1", **kw
) -> list[str]:
    """Manual pages rendered by ``man -P cat`` (the first ``max_pages`` of section 1 in name
    order); none, with the reason logged, where the ``man`` command does not exist."""
    if shutil.which("man") is None:
        log.info("source man skipped: no 'man' command on this machine")
        return []
    pages = sorted({f.name.split(".")[0] for f in Path(section_dir).glob("*")}) if Path(section_dir).is_dir() else []
    out = []
    # No hyphenation (-rHY=0): a word split over two lines would be two words once joined.
    env = {**os.environ, "MANWIDTH": "100", "MAN_KEEP_FORMATTING": "", "LC_ALL": "C.UTF-8", "MANROFFOPT": "-rHY=0"}
    for name in pages[:max_pages]:
        try:
            r = subprocess.run(["man", "-P", "cat", name], capture_output=True, text=True, timeout=10, env=env)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            out += split_passages(r.stdout, max_tokens, **kw)
    return out


# ---- QA sources ------------------------------------------------------------------------------
#: What separates a passage's title from its text in the prompts KVLink trains on from QA data
#: (``kvrag.qa.example.passage_text``), where the benchmark puts the title on a line of its own:
#: the adapters trained from titled data so far, and the checkpoints of runs in progress, were
#: made on these prompts, and a resume checks the data file's digest, not the prompts built from
#: it, so another separator would train a resumed run on other prompts than its first sittings.
#: (The shipped adapters trained on untitled passages, where both read the same.)
TRAIN_TITLE_SEP = ": "


def _training_examples(examples: list[QAExample[Passage]], source: str) -> list[QAExample[str]]:
    """``examples`` as training reads them: every passage must hold text (a KVLinkError names
    the first that does not), each rendered with :data:`TRAIN_TITLE_SEP`."""
    for ex in examples:
        for j, (_, text) in enumerate(ex.passages):
            if not text.strip():
                raise KVLinkError(f"{source}: example {ex.id} ctx {j} has no 'text' string (empty)")
    return [rendered(ex, TRAIN_TITLE_SEP) for ex in examples]


def load_qa(path: str | os.PathLike) -> list[QAExample[str]]:
    """QA examples from a file in any format :mod:`kvrag.qa.files` reads (MuSiQue/KVLink's
    ``{"question", "answers", "ctxs": [{"title", "text"}]}``, HotpotQA, LongBench, SQuAD; a JSON
    list or JSON lines), as training reads them (``title: text``, the text alone without a
    title; an empty passage is an error)."""
    try:
        examples = files.read_examples(path)
    except (OSError, ValueError) as e:
        raise KVLinkError(f"training data: {e}") from None
    return _training_examples(examples, str(path))


def qa_items(
    path: str | os.PathLike, split: str | None = None, eval_percent: int = EVAL_PERCENT
) -> list[QAExample[str]]:
    """The QA examples of a file (:func:`load_qa`) in ``split`` (keyed by the question text;
    None = all)."""
    _check_split(split)
    items = load_qa(path)
    return [it for it in items if split is None or split_of(it.question, eval_percent) == split]


def synthetic_items(n: int, seed: int, count: Callable[[str], int] | None = None) -> list[QAExample[str]]:
    """``n`` items of kvrag's synthetic generator (:mod:`kvrag.qa.synthetic`)."""
    return _training_examples(
        files.parse_items(synthetic.generate(n, seed, count_tokens=count), "synthetic"), "synthetic"
    )


# ---- tasks ------------------------------------------------------------------------------------
@dataclass
class Task:
    """One training prompt before tokenization: ``passages`` in prompt order, the instruction
    (``question``) after them, and ``answers``: gold answers (trained on with ``target="gold"``;
    for pool tasks the text the instruction points at, kept for evaluation) -- ``target``
    ``"teacher"``: the base model's own full-prefill answer is the target."""

    source: str
    kind: str
    passages: list[str]
    question: str
    answers: list[str]
    target: str
    has_answer: bool


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(" ".join(text.split())) if s.strip()]


def _opening(text: str, words: int = 8) -> str:
    return " ".join(text.split()[:words])


def pool_task(
    source: str,
    pool: Sequence[str],
    rng: random.Random,
    n_docs: int,
    *,
    p_without: float,
    kinds: Sequence[str] = TASK_KINDS,
) -> Task:
    """A self-distillation task over ``n_docs`` passages of ``pool`` (see the module doc)."""
    # One more than asked: the spare stands in for the answering passage when it is left out.
    idx = rng.sample(range(len(pool)), min(n_docs + 1, len(pool)))
    main, rest = pool[idx[0]], [pool[i] for i in idx[1:n_docs]]
    spare = [pool[i] for i in idx[n_docs:]]
    kind = rng.choice(list(kinds))
    sents = _sentences(main)
    if kind == "cloze" and len(sents) < 2:
        kind = "summary"
    if kind == "continue":
        # The last document is continued: it must stay last, the others shuffled before it.
        rng.shuffle(rest)
        return Task(source, kind, rest + [main], "Continue the text of the last document.", [], "teacher", True)
    if kind == "summary":
        q = f'Summarise in one sentence the document that begins "{_opening(main)}".'
        answers = [sents[0]] if sents else []
    else:
        i = rng.randrange(1, len(sents))
        q = f'In the documents above, which sentence comes right after "{sents[i - 1]}"? Quote it.'
        answers = [sents[i]]
    without = len(rest + spare) >= 1 and rng.random() < p_without
    docs = rest + spare if without else rest + [main]
    rng.shuffle(docs)  # the paper shuffles the documents (A.2)
    return Task(source, kind, docs, q, answers, "teacher", not without)


def qa_task(source: str, item: QAExample[str], rng: random.Random, n_docs: int, *, p_without: float) -> Task:
    """A labelled task: ``n_docs`` of the item's passages, shuffled, the one holding a gold
    answer included -- or, with probability ``p_without``, left out; then the target is the
    teacher's answer (a gold answer the context does not hold would teach guessing)."""
    low = [a.lower() for a in item.answers]
    gold = [i for i, p in enumerate(item.passages) if any(a in p.lower() for a in low)]
    without = bool(gold) and len(item.passages) > len(gold) and rng.random() < p_without
    if without:
        idx = [i for i in range(len(item.passages)) if i not in gold]
        rng.shuffle(idx)
        passages = [item.passages[i] for i in idx[:n_docs]]
        rng.shuffle(passages)
    else:  # the gold passage and others, shuffled: as `kvrag train kvlink` picks them
        passages = pick_passages(item, n_docs, rng)
    return Task(
        source, "qa", passages, item.question, list(item.answers), "teacher" if without else "gold", not without
    )


class Mixture:
    """Draws tasks from several sources: a source by weight (default: equal), then a task of
    ``min_docs..max_docs`` passages from it. ``pools``: source -> passages; ``qa``: source ->
    QA items (``QAExample[str]``). Deterministic given the ``random.Random`` passed to :meth:`task`."""

    def __init__(
        self,
        pools: dict[str, Sequence[str]] | None = None,
        qa: dict[str, Sequence[QAExample[str]]] | None = None,
        *,
        min_docs: int = 2,
        max_docs: int = 10,
        p_without: float = 0.25,
        weights: dict[str, float] | None = None,
        kinds: Sequence[str] = TASK_KINDS,
    ):
        self.pools = {k: list(dict.fromkeys(v)) for k, v in (pools or {}).items() if v}
        self.qa = {k: list(v) for k, v in (qa or {}).items() if v}
        if not self.pools and not self.qa:
            raise KVLinkError("no training data: every source is empty")
        both = set(self.pools) & set(self.qa)
        if both:
            raise KVLinkError(f"source names used twice: {sorted(both)}")
        if not 1 <= min_docs <= max_docs:
            raise KVLinkError(f"need 1 <= min_docs <= max_docs, got {min_docs}, {max_docs}")
        if not 0.0 <= p_without <= 1.0:
            raise KVLinkError(f"p_without must be in [0, 1], got {p_without}")
        bad = [k for k in kinds if k not in TASK_KINDS]
        if bad or not kinds:
            raise KVLinkError(f"task kinds must be some of {TASK_KINDS}, got {list(kinds)}")
        self.min_docs, self.max_docs, self.p_without, self.kinds = min_docs, max_docs, p_without, tuple(kinds)
        self.names = sorted(self.pools) + sorted(self.qa)
        w = weights or {}
        unknown = [k for k in w if k not in self.names]
        if unknown:
            raise KVLinkError(f"weights for sources without data: {unknown} (sources: {self.names})")
        self.weights = [float(w.get(k, 1.0)) for k in self.names]
        if any(x < 0 for x in self.weights) or sum(self.weights) <= 0:
            raise KVLinkError(f"source weights must be >= 0 with a positive sum, got {self.weights}")

    def task(self, rng: random.Random) -> Task:
        source = rng.choices(self.names, self.weights)[0]
        n_docs = rng.randint(self.min_docs, self.max_docs)
        if source in self.pools:
            return pool_task(source, self.pools[source], rng, n_docs, p_without=self.p_without, kinds=self.kinds)
        items = self.qa[source]
        return qa_task(source, items[rng.randrange(len(items))], rng, n_docs, p_without=self.p_without)

    def describe(self) -> dict:
        """What ``kvlink.json`` records: per source its passage or item count and a sha256 of
        its content (in order), the weights and the task settings."""
        out: dict[str, dict[str, Any]] = {}
        for name in self.names:
            h = hashlib.sha256()
            if name in self.pools:
                for p in self.pools[name]:
                    h.update(p.encode("utf-8") + b"\0")
                out[name] = {"passages": len(self.pools[name])}
            else:
                for it in self.qa[name]:
                    h.update("\x1f".join([it.question, *it.answers, *it.passages]).encode("utf-8") + b"\0")
                out[name] = {"items": len(self.qa[name])}
            out[name].update(sha256=h.hexdigest(), weight=self.weights[self.names.index(name)])
        return {
            "sources": out,
            "min_docs": self.min_docs,
            "max_docs": self.max_docs,
            "p_without": self.p_without,
            "kinds": list(self.kinds),
        }


# ---- tasks -> training samples -------------------------------------------------------------
class TaskSampler:
    """Turns a :class:`Mixture`'s tasks into KVLink training samples for ``handle``'s model.

    A ``"teacher"`` task's answer is the base model's greedy continuation of the full prompt
    (``answer_tokens`` at most, to the end-of-turn token): computed by the caller's model, which
    training never changes (it trains a copy). Call as ``sampler(rng) -> (Sample, source)``."""

    def __init__(
        self,
        handle,
        mixture: Mixture,
        *,
        link_tokens: int,
        max_docs: int,
        answer_tokens: int = 24,
        max_passage_chars: int = 0,
        max_tokens: int | None = None,
    ):
        if answer_tokens < 1:
            raise KVLinkError(f"answer_tokens must be >= 1, got {answer_tokens}")
        self.handle, self.mixture = handle, mixture
        self.link_tokens, self.max_docs = link_tokens, max_docs
        self.answer_tokens, self.max_passage_chars = answer_tokens, max_passage_chars
        self.max_tokens = max_tokens  # a longer prompt gets no teacher answer: training skips it anyway

    def _prompt_tokens(self, pieces) -> int:
        """The length of the sample ``build_sample`` makes of ``pieces``, without its answer."""
        per_doc = len(self.handle.anchor_ids()) + self.link_tokens
        return sum(len(p[0]) + (len(p[2]) + per_doc if p[1] else 0) for p in pieces)

    def sample(self, task: Task) -> Sample:
        """The training sample of ``task`` (its teacher answer generated alone)."""
        return self.samples([task])[0]

    def samples(self, tasks: Sequence[Task]) -> list[Sample]:
        """The training samples of ``tasks``, in order. The teacher answers of all that need
        one come from one greedy generation over their prompts, left-padded: on a GPU a
        generation step of one prompt is launch-bound, so B prompts cost about what one does.
        Each sample equals ``sample`` of its task alone up to float rounding (a lone prompt is
        generated unpadded, exactly as alone)."""
        h = self.handle
        laid: list[tuple[list, list[int] | None]] = []  # (pieces, answer ids; None: the teacher's)
        for task in tasks:
            cut = (truncate_passage(p, self.max_passage_chars) for p in task.passages)
            passages = list(dict.fromkeys(p for p in cut if p.strip()))
            prompt = rag_prompt(h, passages, task.question)
            pieces = prompt_pieces(h, prompt, passages)
            if task.target == "gold":
                laid.append((pieces, answer_ids(h, task.answers[0])))
            elif self.max_tokens is not None and self._prompt_tokens(pieces) >= self.max_tokens:
                laid.append((pieces, [self._pad_id()]))  # over the limit already: the caller skips it
            else:
                laid.append((pieces, None))
        prompts = [[t for piece in pieces for t in piece[0]] for pieces, ans in laid if ans is None]
        answers = iter(self._teacher_answers(prompts) if prompts else [])
        out = []
        for pieces, ans in laid:
            logits = None
            if ans is None:
                ans, logits = next(answers)
            sample = build_sample(pieces, ans, self.link_tokens, self.max_docs, h.anchor_ids())
            sample.teacher_logits = logits
            out.append(sample)
        return out

    def _pad_id(self) -> int:
        """The id that stands in where one is needed and none is read: the end token, or 0
        for a tokenizer without one."""
        eos = self.handle.tokenizer.eos_token_id
        return eos if eos is not None else 0

    def _teacher_answers(self, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """The base model's greedy answer to each prompt (``answer_tokens`` at most, through
        the end-of-turn token) with its logits [T_i, V] float32 (row t predicts answer token t
        over the plain prompt: the distillation target, so training need not run the teacher
        again), from one ``generate`` over the prompts left-padded."""
        h = self.handle
        eos = h.tokenizer.eos_token_id
        pad = self._pad_id()
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            out = h.model.generate(
                ids.to(h.device),
                attention_mask=mask.to(h.device),
                max_new_tokens=self.answer_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
                output_logits=True,
                return_dict_in_generate=True,
            )
        steps = torch.stack(out.logits, dim=1) if out.logits else None  # [B, T, V]
        result = []
        for i, row in enumerate(out.sequences[:, width:].tolist()):
            # A row that ended is padded with the end token while the others go on: its answer
            # stops at its first end token, as a lone generation does.
            if eos is not None and eos in row:
                row = row[: row.index(eos) + 1]
            logits = steps[i, : len(row)].float() if row and steps is not None else None
            result.append((row or [pad], logits))
        return result

    def draw(self, rng: random.Random, n: int) -> list[tuple[Sample, str]]:
        """``n`` calls at once, ``[(Sample, source)]``: the same tasks in the same order as
        ``n`` calls (the RNG is the data cursor), their teacher answers generated together
        (``samples``)."""
        tasks = [self.mixture.task(rng) for _ in range(n)]
        return list(zip(self.samples(tasks), (t.source for t in tasks)))

    def __call__(self, rng: random.Random) -> tuple[Sample, str]:
        task = self.mixture.task(rng)
        return self.sample(task), task.source


# ---- held-out evaluation sets ------------------------------------------------------------------
POOL_EVAL_PERCENT = 10  # of a passage pool, held out by passage hash for the label-free cloze eval


def pool_split(passages: Sequence[str], split: str | None, eval_percent: int = POOL_EVAL_PERCENT) -> list[str]:
    """The passages of ``split`` (by the sha256 of the text; None = all)."""
    _check_split(split)
    return [p for p in passages if split is None or split_of(p, eval_percent) == split]


def cloze_items(pool: Sequence[str], n: int, seed: int = 0, *, docs: int = 4) -> list[dict]:
    """``n`` labelled questions from unlabelled passages, for ``kvrag bench --data``: a cloze
    (quote the sentence after a given one) over ``docs`` shuffled passages that include the
    one it quotes; the gold answer is that sentence. As QA data-file dicts (:mod:`kvrag.qa.files`)."""
    rng = random.Random(f"kvrag-cloze:{seed}")
    out: list[dict] = []
    for _ in range(20 * n):
        if len(out) == n:
            break
        t = pool_task("eval", pool, rng, docs, p_without=0.0, kinds=("cloze",))
        if t.kind == "cloze":
            out.append(
                {
                    "id": f"cloze-{seed}-{len(out)}",
                    "question": t.question,
                    "answers": t.answers,
                    "ctxs": [{"title": "", "text": p} for p in t.passages],
                }
            )
    return out
