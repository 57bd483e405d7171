"""The KVLink training losses over the answer tokens of a sample: cross-entropy on the answer
(the paper's objective) or distillation from the base model's full prefill."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvrag.arch import Arch
from kvrag.policies.kvlink.adapter import KVLinkError
from kvrag.policies.kvlink.forward import answer_logits, answer_logits_batch
from kvrag.policies.kvlink.samples import Sample


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
