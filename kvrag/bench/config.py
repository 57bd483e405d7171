"""What a benchmark run is configured by: ``BenchConfig`` (every option of ``kvrag bench``),
``Run`` (one policy configuration), the reference policy and the stop strings."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kvrag.defaults import DEFAULT_PREFIX_CACHE
from kvrag.qa import synthetic

log = logging.getLogger("kvrag.bench")

log = logging.getLogger("kvrag.bench")

REFERENCE = "full_prefill"
STOP = ("\n",)


@dataclass
class BenchConfig:
    """Everything a run needs; ``kvrag bench`` fills it from the command line."""

    out: Path
    data: str | None = None
    synthetic: int = 0  # synthetic QA items (0 = none)
    policies: list[str] = field(default_factory=list)  # [] = every registered policy
    params: dict[str, dict] = field(default_factory=dict)  # policy -> hyper-parameters
    limit: int | None = None
    passages: int | None = None
    passage_words: int | None = None  # truncate passages (quick mode)
    repeats: int = 3
    max_new_tokens: int = 32
    kl_positions: int = 16
    scaling: list[tuple[int, int]] = field(default_factory=list)  # (chunks, tokens per chunk)
    floor: list[tuple[int, int]] = field(default_factory=list)  # floor benchmark points, as scaling
    sweep_policies: list[str] = field(default_factory=list)
    sweep_ratios: list[float] = field(default_factory=list)
    sweep_limit: int = 0
    sweep_data: str = "synthetic"  # "synthetic" or "data"
    synthetic_passages: int = 6
    synthetic_passage_tokens: int = 200
    synthetic_types: list[str] = field(default_factory=lambda: list(synthetic.QUESTION_TYPES))
    check_items: int = 0  # single-hop items of the full_prefill answerability check
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    model: str | None = None
    dtype: str = "float32"
    storage_dtype: str = "float16"
    chunk_anchor: str = "auto"  # KVRag(chunk_anchor=...): "auto" or "none"
    # KVLink adapter of the trained ``kvlink`` runs: "default" (the adapter found for the model,
    # if any: what ``KVRag(policy="kvlink")`` runs), "links" (links-only adapters only), "auto"
    # (the adapter found; an error if none), a directory, or "none". A LoRA adapter changes the
    # model, so its runs get a KVRag of their own.
    kvlink_adapter: str | None = "default"
    hot_cache: int | str = 0  # KVRag(hot_cache=...): 0 = every run reads the disk (cold)
    prefix_cache: int = DEFAULT_PREFIX_CACHE  # KVRag(prefix_cache=...): 0 = fused prefills compute the prompt's head
    seed: int = 0
    footprint: bool = True
    warmup: bool = True
    cache_dir: str | None = None
    report: Path | None = None
    command: str = ""
    quick: bool = False
    # Keep the QA examples an interrupted run with this configuration finished (its journal in
    # ``out``) instead of running them again.
    resume: bool = False

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        # Counts that slice the data: a negative one would slice from the end, 0 would run
        # nothing. None (the default) means all.
        for name in ("limit", "passages", "passage_words"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 (or unset: all), got {v}")
        if self.synthetic < 0:
            raise ValueError(f"synthetic must be >= 0, got {self.synthetic}")
        if self.sweep_limit < 0:
            raise ValueError(f"sweep_limit must be >= 0 (0 = no sweep), got {self.sweep_limit}")
        # The synthetic generator's own limits (the synthetic set and the single-hop check).
        if self.synthetic_passages < synthetic.MIN_PASSAGES:
            raise ValueError(
                f"synthetic_passages must be >= {synthetic.MIN_PASSAGES} (facts + distractors), "
                f"got {self.synthetic_passages}"
            )
        if self.synthetic_passage_tokens < synthetic.MIN_PASSAGE_TOKENS:
            raise ValueError(
                f"synthetic_passage_tokens must be >= {synthetic.MIN_PASSAGE_TOKENS}, "
                f"got {self.synthetic_passage_tokens}"
            )
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.kl_positions < 1:
            raise ValueError(f"kl_positions must be >= 1, got {self.kl_positions}")
        for r in self.sweep_ratios:
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"sweep ratios must be in [0, 1], got {r}")
        for n, t in [*self.scaling, *self.floor]:
            if n < 1 or t < 32:
                raise ValueError(f"scaling point {n}x{t}: need >= 1 chunk of >= 32 tokens")
        bad = [t for t in self.synthetic_types if t not in synthetic.QUESTION_TYPES]
        if bad or not self.synthetic_types:
            raise ValueError(
                f"synthetic types must be some of {', '.join(synthetic.QUESTION_TYPES)}, got {self.synthetic_types!r}"
            )
        if self.check_items < 0:
            raise ValueError(f"check_items must be >= 0, got {self.check_items}")
        if self.sweep_data not in ("synthetic", "data"):
            raise ValueError(f"sweep_data must be 'synthetic' or 'data', got {self.sweep_data!r}")


def label_of(policy: str, params: dict) -> str:
    """Display name of a policy run: ``cacheblend`` or ``cacheblend@0.3`` for a swept ratio."""
    if set(params) == {"recompute_ratio"}:
        return f"{policy}@{params['recompute_ratio']:g}"
    if params:
        return policy + "(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"
    return policy


@dataclass
class Run:
    """One policy configuration to benchmark."""

    policy: str
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return label_of(self.policy, self.params)
