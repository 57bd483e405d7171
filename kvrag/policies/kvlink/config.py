"""The options of a KVLink training run (``TrainConfig``) and what follows from them alone: their
checks, the learning-rate schedule and the LoRA shape ``kvlink.json`` records."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvrag.checks import check_int
from kvrag.policies.kvlink.adapter import KVLinkError

OBJECTIVES = ("answer", "distill")
PASSAGE_ORDERS = ("shuffle", "source")


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

        def whole(name: str, lo: int, hi: int | None = None) -> None:
            """The field is an integer in [lo, hi], by kvrag's one integer rule (check_int)."""
            try:
                value = check_int(name, getattr(self, name), lo)
            except ValueError as e:
                raise KVLinkError(str(e)) from None
            need(hi is None or value <= hi, f"{name} must be in [{lo}, {hi}], got {value}")
            setattr(self, name, value)  # 2.0 counts as 2, and is stored as the int

        whole("steps", 1)
        whole("lora_rank", 0)
        need(self.lora_alpha is None or self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}")
        need(self.lora_rank == 0 or len(self.lora_targets) > 0, "lora_targets is empty")
        whole("link_tokens", 0, 64)
        need(
            self.lora_rank > 0 or self.link_tokens > 0,
            "nothing to train: lora_rank=0 and link_tokens=0 (train LoRA, link tokens, or both)",
        )
        whole("max_docs", 1)
        whole("docs", 1)
        whole("min_docs", 0)
        need(
            self.min_docs <= self.docs,
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
        whole("batch", 1)
        need(isinstance(self.batched, bool), f"batched must be True or False, got {self.batched!r}")
        need(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        need(self.max_tokens >= 16, f"max_tokens must be >= 16, got {self.max_tokens}")
        need(self.max_seconds >= 0, f"max_seconds must be >= 0, got {self.max_seconds}")
        need(self.init is None or str(self.init).strip() != "", "init must name an adapter directory or 'auto'")

    def as_record(self) -> dict:
        """The options as ``kvlink.json`` and a checkpoint record them (tuples as lists)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


def lr_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """The learning-rate factor of each step (``torch.optim.lr_scheduler.LambdaLR``)."""

    # Linear warm-up, then cosine decay to 10%: the usual fine-tuning schedule (the paper's
    # runs use cosine with warm-up too).
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / (cfg.warmup + 1)
        span = max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / span)))

    return f


def lora_record(cfg: TrainConfig) -> dict | None:
    """The LoRA shape ``kvlink.json`` records (None: links only)."""
    if cfg.lora_rank == 0:
        return None
    return {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha or 2 * cfg.lora_rank, "targets": list(cfg.lora_targets)}
