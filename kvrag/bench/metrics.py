"""Quality metrics of the benchmark.

* Answer scores against gold answers: SQuAD / LongBench normalisation (lower-case, drop
  punctuation and the articles a/an/the, collapse whitespace), token-level F1 and exact match,
  the maximum over the gold answers (``qa_f1_score`` of LongBench, ``f1_score`` of the SQuAD
  v1.1 script, which CacheBlend's MuSiQue numbers use).
* Fidelity: the same scores of a policy's answer against ``full_prefill``'s answer.
* Teacher-forced scores from ``KVRag.continuation_logits`` rows: mean log-likelihood per token
  of a continuation, top-1 agreement and KL divergence of the next-token distribution with the
  reference (``full_prefill``) distribution.

Shapes: ``T`` continuation tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD v1.1 / LongBench ``normalize_answer``: lower, no punctuation, no articles, single spaces."""
    if not isinstance(s, str):
        raise TypeError(f"answer must be a str, got {type(s).__name__}")
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def token_f1(prediction: str, reference: str) -> float:
    """Token-level F1 of two answers after normalisation (bag of words, as SQuAD/LongBench).

    Two answers that both normalise to nothing score 1.0 (they agree); one empty side scores 0."""
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(reference).split()
    if not pred and not ref:
        return 1.0
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, reference: str) -> float:
    """1.0 if the normalised answers are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def contains_answer(prediction: str, reference: str) -> float:
    """1.0 if the normalised reference occurs in the normalised prediction as whole words.

    The "accuracy" of Liu et al., *Lost in the Middle* (2023): a small chat model answers in
    a sentence ("X was born in the city of C."), which token F1 against a one-word gold
    answer scores ~0.2 whether it is right or wrong; containment tells the two apart."""
    ref = normalize_answer(reference)
    if not ref:
        return 0.0
    return float(f" {ref} " in f" {normalize_answer(prediction)} ")


def _answers(references: str | Iterable[str]) -> list[str]:
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("no reference answers: need at least one gold answer")
    return refs


def best_f1(prediction: str, references: str | Iterable[str]) -> float:
    """Maximum token F1 over the reference answers."""
    return max(token_f1(prediction, r) for r in _answers(references))


def best_em(prediction: str, references: str | Iterable[str]) -> float:
    """Maximum exact match over the reference answers."""
    return max(exact_match(prediction, r) for r in _answers(references))


def best_acc(prediction: str, references: str | Iterable[str]) -> float:
    """1.0 if any reference answer is contained in the prediction (:func:`contains_answer`)."""
    return max(contains_answer(prediction, r) for r in _answers(references))


def _check_rows(logits: torch.Tensor, n: int, what: str) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{what}: logits must be [rows, V], got shape {tuple(logits.shape)}")
    if logits.shape[0] < n:
        raise ValueError(f"{what}: need {n} logit rows, got {logits.shape[0]}")


def mean_logprob(logits: torch.Tensor, token_ids: Sequence[int]) -> float:
    """Mean log-probability per token of ``token_ids`` [T] under teacher forcing.

    logits: [>= T, V], row t predicts token t (``continuation_logits`` returns [1 + T, V];
    the extra last row is ignored)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("mean_logprob: empty continuation")
    _check_rows(logits, ids.numel(), "mean_logprob")
    # On the CPU: the logits may come from a CUDA model, the ids are a CPU tensor.
    logp = torch.log_softmax(logits[: ids.numel()].detach().cpu().double(), dim=-1)
    return float(logp.gather(1, ids.unsqueeze(1)).mean())


def next_token_agreement(
    reference: torch.Tensor, logits: torch.Tensor, positions: int | None = None
) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || policy) in nats) over the first ``positions`` rows.

    reference, logits: [T, V] next-token logits of the reference (``full_prefill``) and of a
    policy at the same teacher-forced positions."""
    n = min(reference.shape[0], logits.shape[0]) if positions is None else positions
    if n <= 0:
        raise ValueError("next_token_agreement: no positions to compare")
    _check_rows(reference, n, "next_token_agreement (reference)")
    _check_rows(logits, n, "next_token_agreement (policy)")
    if reference.shape[1] != logits.shape[1]:
        raise ValueError(f"vocabulary mismatch: reference has {reference.shape[1]} logits, policy {logits.shape[1]}")
    ref = torch.log_softmax(reference[:n].detach().cpu().double(), dim=-1)
    pol = torch.log_softmax(logits[:n].detach().cpu().double(), dim=-1)
    top1 = float((ref.argmax(-1) == pol.argmax(-1)).double().mean())
    kl = torch.nn.functional.kl_div(pol, ref, log_target=True, reduction="none").sum(-1)
    return top1, float(kl.mean().clamp_min(0.0))


def relative_gap(value: float, reference: float) -> float:
    """|value - reference| / |reference| (0 when both are 0; inf when only the reference is 0)."""
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return abs(value - reference) / abs(reference)
