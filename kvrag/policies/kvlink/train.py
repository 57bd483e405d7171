"""KVLink training: fine-tuning with the link-token attention mask (``kvrag train kvlink``).

KVLink (paper sections 2.3 and A.2) fine-tunes the model so that separately encoded documents
plus a few *link tokens* after each of them answer as well as a full prefill. The pieces, one
job a module:

* :mod:`~kvrag.policies.kvlink.samples` -- the training sequence, which is the inference prompt
  itself (documents, their link tokens, question, answer), laid out as queries are;
* :mod:`~kvrag.policies.kvlink.forward` -- kvrag's own layer loop under the paper's mask, with
  gradients: the function the fusion engine computes at query time;
* :mod:`~kvrag.policies.kvlink.loss` -- the loss on the answer tokens (the answer, or
  distillation from the base model's full prefill);
* :mod:`~kvrag.policies.kvlink.config` -- the options; :mod:`~kvrag.policies.kvlink.checkpoints`
  -- resumable runs; :mod:`~kvrag.policies.kvlink.warm_start` -- starting from an adapter;
* this module -- the loop: the model copied and adapted, the steps, the adapter saved.

The model is adapted with LoRA (``peft``) or not at all (``lora_rank=0``: link embeddings only,
the model — and its fingerprint and chunk caches — stay unchanged). The trainable link table is
``[max_docs, K, E]``; only the rows training reached are saved (``trained_rows``: at most
``docs`` documents per sample), so a later document reuses the last *trained* row, never an
untrained initial one. The result is written as an adapter directory
(``kvrag.policies.kvlink.adapter``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvrag.arch import Arch
from kvrag.model import ModelHandle
from kvrag.model.digests import sha256_file
from kvrag.policies.kvlink import checkpoints as C
from kvrag.policies.kvlink.adapter import (
    FORMAT_VERSION,
    META_FILE,
    KVLinkAdapter,
    KVLinkError,
    adapter_key,
    default_adapter_dirs,
    load_adapter,
    save_adapter,
)
from kvrag.policies.kvlink.config import TrainConfig, lora_record, lr_schedule
from kvrag.policies.kvlink.data import load_qa
from kvrag.policies.kvlink.forward import answer_logits_batch
from kvrag.policies.kvlink.loss import batch_loss, sample_loss
from kvrag.policies.kvlink.policy import mean_embedding
from kvrag.policies.kvlink.samples import Sample, qa_sampler
from kvrag.policies.kvlink.warm_start import init_record, start_adapter, warm_start
from kvrag.qa.example import QAExample

log = logging.getLogger("kvrag.kvlink")

Sampler = Callable[[random.Random], tuple[Sample, str]]


@dataclass
class TrainResult:
    out: Path
    losses: list[float]
    adapter: KVLinkAdapter
    meta: dict = field(default_factory=dict)


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

    def __enter__(self) -> _SignalStop:
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


# ---- the network being trained -------------------------------------------------------------
@dataclass
class _Trainable:
    """A copy of the handle's model (LoRA-adapted in place; ``peft_model`` its peft wrapper, or
    None for links only), ``arch`` over it, the link table ``links`` [max_docs, K, E], and
    their optimizer and learning-rate scheduler."""

    arch: Arch
    peft_model: Any
    links: torch.nn.Parameter
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR

    def params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.opt.param_groups for p in g["params"]]


def _adapted_copy(handle: ModelHandle, cfg: TrainConfig) -> tuple[torch.nn.Module, Any]:
    """A copy of the model, with LoRA attached (and its peft wrapper) or frozen (None)."""
    model = copy.deepcopy(handle.model)
    if cfg.lora_rank == 0:
        model.requires_grad_(False)
        return model, None
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
        return model, get_peft_model(model, lcfg)
    except ValueError as e:  # e.g. a target module name the model does not have
        raise KVLinkError(f"cannot attach LoRA to the model: {e}") from None


def _trainable(handle: ModelHandle, cfg: TrainConfig, start_from: KVLinkAdapter | None) -> _Trainable:
    model, peft_model = _adapted_copy(handle, cfg)
    # peft injects its LoRA layers in place, so ``model`` itself is the adapted network.
    arch = Arch(model)
    init = mean_embedding(arch)
    links = torch.nn.Parameter(init.expand(cfg.max_docs, cfg.link_tokens, arch.hidden_size).clone().to(arch.device))
    groups: list[dict[str, Any]] = []
    lora_params = [p for p in model.parameters() if p.requires_grad]
    if lora_params:
        groups.append({"params": lora_params, "lr": cfg.lr})
    if cfg.link_tokens > 0:
        groups.append({"params": [links], "lr": cfg.link_lr})
    if start_from is not None:
        warm_start(start_from, peft_model, links)
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    return _Trainable(arch, peft_model, links, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(cfg)))


def _teachers(t: _Trainable, cfg: TrainConfig, samples: list[Sample]) -> list[torch.Tensor | None]:
    """The distillation targets [T_i, V] of ``samples`` (None each for 'answer'): a sampler's
    own, else the base model's logits over the plain prompt, one packed no-grad forward for all
    the samples that need them."""
    if cfg.objective != "distill":
        return [None] * len(samples)
    out: list[torch.Tensor | None] = [s.teacher_logits for s in samples]
    need = [i for i, x in enumerate(out) if x is None]
    if need:
        plain = [samples[i].without_links() for i in need]
        plain = [Sample(p.ids, p.link_slot, torch.zeros_like(p.segment), p.answer_start) for p in plain]
        ctx = t.peft_model.disable_adapter() if t.peft_model is not None else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            for i, logits in zip(need, answer_logits_batch(t.arch, plain, None)):
                out[i] = logits
    return out


def _step(t: _Trainable, cfg: TrainConfig, samples: list[Sample]) -> float:
    """One optimizer step on ``samples`` (the gradients zeroed before they were drawn); the
    step's loss (the mean over its samples)."""
    if cfg.batched:
        loss = batch_loss(t.arch, samples, t.links, cfg.objective, _teachers(t, cfg, samples))
        loss.backward()
        total = float(loss.detach())
    else:
        total = 0.0
        for sample in samples:
            loss = sample_loss(t.arch, sample, t.links, cfg.objective, _teachers(t, cfg, [sample])[0]) / cfg.batch
            loss.backward()
            total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(t.params(), 1.0)
    t.opt.step()
    t.sched.step()
    return total


# ---- the data a step reads -----------------------------------------------------------------
def _file_sampler(
    handle: ModelHandle, cfg: TrainConfig, items: Sequence[QAExample[str]] | None
) -> tuple[Sampler, dict]:
    """The sampler of the QA examples (``items``, else ``cfg.data``'s) but the last
    ``cfg.holdout``, and what ``kvlink.json`` records of them."""
    data = list(items) if items is not None else load_qa(cfg.data)
    if cfg.holdout >= len(data):
        raise KVLinkError(f"holdout={cfg.holdout} leaves no training examples out of {len(data)}")
    train_items = data[: len(data) - cfg.holdout]
    record = {
        "train_examples": len(train_items),
        "data_sha256": sha256_file(Path(cfg.data)) if items is None else None,
    }
    return qa_sampler(handle, train_items, cfg), record


def _draw(sampler: Sampler, rng: random.Random, cfg: TrainConfig, progress: C.Progress) -> list[Sample]:
    """The step's ``cfg.batch`` samples in the sampler's order (the RNG is the data cursor, so
    the draws never depend on how the samples are then run). Drawn in rounds of as many as are
    still missing, so the samples drawn, skipped included, are those one at a time would give.

    A sampler that can draw several samples at once (``TaskSampler.draw``: their teacher answers
    generated together) serves a packed step; the others are called once a sample."""
    draw_many = getattr(sampler, "draw", None) if cfg.batched else None
    drawn: list[Sample] = []
    while len(drawn) < cfg.batch:
        need = cfg.batch - len(drawn)
        for sample, source in draw_many(rng, need) if draw_many is not None else [sampler(rng)]:
            if sample.n > cfg.max_tokens:
                progress.skipped += 1
                if progress.skipped > 100 * cfg.steps:
                    raise KVLinkError(
                        f"almost every example exceeds max_tokens={cfg.max_tokens}; "
                        "use fewer docs or --max-passage-chars"
                    )
                continue
            progress.trained_rows = max(progress.trained_rows, min(int(sample.segment.max()), cfg.max_docs))
            progress.source_counts[source] = progress.source_counts.get(source, 0) + 1
            drawn.append(sample)
    return drawn


# ---- the run -------------------------------------------------------------------------------
def _out_dir(handle: ModelHandle, out, force: bool, resume: bool, checkpoint_every: int) -> Path:
    """The adapter directory, checked now rather than after the training."""
    out_dir = Path(out).expanduser() if out is not None else default_adapter_dirs(handle)[0]
    if (out_dir / META_FILE).exists() and not force and not resume:
        more = ", or resume=True (--resume) to continue its run" if C.has_checkpoint(out_dir) else ""
        raise KVLinkError(f"{out_dir} already holds a KVLink adapter; pass force=True (--force) to overwrite it{more}")
    if checkpoint_every < 0:
        raise KVLinkError(f"checkpoint_every must be >= 0 (0 = only when stopping early), got {checkpoint_every}")
    from kvrag.outpaths import check_dir

    check_dir(out_dir, "adapter directory", KVLinkError)
    return out_dir


def _early_stop(step: int, cfg: TrainConfig, stop: _SignalStop, stop_at_step: int | None, t0: float) -> str | None:
    """Why the run stops after ``step`` steps though steps remain (None: it goes on)."""
    if step == cfg.steps:
        return None
    if stop_at_step is not None and step >= stop_at_step:
        return f"stopping at step {step} as asked; saving (resume to go on)"
    if stop.received is not None:
        name = signal.Signals(stop.received).name
        return f"{name} received: stopping after {step} steps; saving (resume to go on)"
    if cfg.max_seconds and time.perf_counter() - t0 > cfg.max_seconds:
        return f"time budget of {cfg.max_seconds:.0f} s reached after {step} steps; saving (resume to go on)"
    return None


def train_kvlink(
    handle: ModelHandle,
    cfg: TrainConfig,
    out: str | os.PathLike | None = None,
    *,
    items: Sequence[QAExample[str]] | None = None,
    command: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    force: bool = False,
    sampler: Sampler | None = None,
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
    counts, hashes) goes into ``kvlink.json``. Checkpoints (``CHECKPOINT_DIR`` in ``out``, see
    :mod:`kvrag.policies.kvlink.checkpoints`) are written every ``checkpoint_every`` steps and
    at the end (0: neither) and whenever the run stops early (``cfg.max_seconds``,
    ``stop_at_step``, or SIGTERM / SIGINT received while training in the main thread: the step
    finishes, then the run saves and returns); ``resume`` continues from the one in ``out``, and
    a resumed run computes what an uninterrupted one does. ``bar``: a tqdm progress bar with the
    loss. Returns the output directory, the per-step losses and the loaded adapter."""
    cfg.validate()
    say = progress or (lambda msg: log.info("%s", msg))
    out_dir = _out_dir(handle, out, force, resume, checkpoint_every)
    # The QA examples trained on and the data file's digest (None: a caller's sampler).
    data_record: dict = {"train_examples": None, "data_sha256": None}
    if sampler is None:
        sampler, data_record = _file_sampler(handle, cfg, items)
    # Checked before the model is copied: a mismatched adapter fails in seconds, not after it.
    start_from = start_adapter(handle, cfg) if cfg.init is not None else None
    init_meta = None if start_from is None else init_record(start_from)
    # What a resumed run must share with the checkpoint's: every option that changes a step,
    # the data (its digests) and the adapter it started from (its weights' digests).
    identity = {**C.resumable_config(cfg), "data_sha256": data_record["data_sha256"], "data": data_meta}
    if init_meta is not None:
        identity["init_digest"] = {k: init_meta[k] for k in ("links_sha256", "lora_digest")}
    ckpt = C.load_checkpoint(out_dir, identity) if resume else None
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    t = _trainable(handle, cfg, start_from)
    t0 = time.perf_counter()
    # A warm start's link rows were trained by its own run.
    done = C.Progress(trained_rows=0 if start_from is None else start_from.max_docs)
    if ckpt is not None:
        done = C.restore(ckpt, t.peft_model, t.links, t.opt, t.sched, rng)
        say(f"resuming from {out_dir / C.CHECKPOINT_DIR} at step {done.start}/{cfg.steps}")
    done.sittings.append({"command": list(command) if command is not None else None, "from_step": done.start})

    def checkpoint(step: int) -> None:
        done.sittings[-1].update(to_step=step, seconds=round(time.perf_counter() - t0, 1))
        C.save_checkpoint(out_dir, identity, C.training_state(step, done, t.peft_model, t.links, t.opt, t.sched, rng))

    # SIGTERM (`timeout`, a job scheduler) or Ctrl-C while training: finish the step, then stop
    # as the time budget does (checkpoint and adapter, resumable).
    with _SignalStop() as stop:
        pbar = None
        if bar:
            from tqdm import tqdm

            pbar = tqdm(total=cfg.steps, initial=done.start, unit="step", dynamic_ncols=True)
        for step in range(done.start, cfg.steps):
            t.opt.zero_grad(set_to_none=True)
            samples = _draw(sampler, rng, cfg, done)
            done.losses.append(_step(t, cfg, samples))
            if step == done.start:  # the step that pays one-time costs (kernel choice, allocator growth)
                done.sittings[-1]["first_step_seconds"] = round(time.perf_counter() - t0, 2)
            recent = done.losses[-cfg.log_every :]
            if pbar is not None:
                pbar.update(1)
                pbar.set_postfix(loss=f"{sum(recent) / len(recent):.4f}")
            elif (step + 1) % cfg.log_every == 0 or step == done.start or step + 1 == cfg.steps:
                say(
                    f"step {step + 1}/{cfg.steps}  loss {sum(recent) / len(recent):.4f}  "
                    f"{(time.perf_counter() - t0) / (step + 1 - done.start):.2f} s/step"
                )
            why = _early_stop(step + 1, cfg, stop, stop_at_step, t0)
            if why is not None:
                say(why)
                checkpoint(step + 1)
                break
            if checkpoint_every and (step + 1 == cfg.steps or (step + 1) % checkpoint_every == 0):
                checkpoint(step + 1)  # at the end too: resuming a finished run re-saves it, no error
        if pbar is not None:
            pbar.close()
        done.sittings[-1].update(to_step=len(done.losses), seconds=round(time.perf_counter() - t0, 1))
        meta = _meta(handle, cfg, done, data_record, init_meta, data_meta, command)
        save_adapter(out_dir, t.links.detach()[: max(1, done.trained_rows)], t.peft_model, meta)
        say(f"saved KVLink adapter to {out_dir}")
        return TrainResult(out_dir, done.losses, load_adapter(out_dir), meta)


def _meta(
    handle: ModelHandle,
    cfg: TrainConfig,
    done: C.Progress,
    data_record: dict,
    init_meta: dict | None,
    data_meta: dict | None,
    command: Sequence[str] | None,
) -> dict:
    """What ``kvlink.json`` records of the run."""
    return {
        "format": FORMAT_VERSION,
        "base_key": adapter_key(handle),
        "base_fingerprint": handle.fingerprint,
        "base_source": handle.source,
        "link_tokens": cfg.link_tokens,
        "max_docs": cfg.max_docs,
        "trained_rows": max(1, done.trained_rows),
        "lora": lora_record(cfg),
        "config": cfg.as_record(),
        "data_sha256": data_record["data_sha256"],
        "train_examples": data_record["train_examples"],
        "init": init_meta,
        "data": data_meta,
        "samples_by_source": done.source_counts,
        "command": list(command) if command is not None else None,
        "sittings": done.sittings,
        "steps": len(done.losses),
        "complete": len(done.losses) == cfg.steps,
        "losses": [round(x, 6) for x in done.losses],
        "train_seconds": round(sum(x.get("seconds", 0.0) for x in done.sittings), 1),  # every sitting
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def command_line() -> list[str]:
    """The command that is running (recorded in kvlink.json)."""
    launched = sys.argv[0] if sys.argv else ""
    # `kvrag ...` and `python -m kvrag ...` (argv[0] is then kvrag/__main__.py) are the same command.
    ours = launched.endswith("kvrag") or launched.endswith(os.path.join("kvrag", "__main__.py"))
    return ["kvrag", *sys.argv[1:]] if ours else list(sys.argv)
