"""The floor benchmark: each policy's TTFT beside the least a reuse path could take.

A fused prefill cannot beat, on the same machine and in the same run:

* ``read_s``: the chunk lookup of the prompt -- tokenizing, segmenting and reading its chunk
  entries from the tier they are served from (disk, or the in-memory hot tier);
* ``move_s``: moving those entries to the compute device and dtype (nothing for hot-tier
  entries, which are stored there already);
* ``forward_s``: transformers' own forward of the non-cached tokens over a pre-filled cache of
  the cached length (``kvrag.bench.ops.plain_forward``);
* ``recompute_s``, for a policy that recomputes cached tokens: its recomputed (token, layer)
  pairs at the per-pair cost of ``full_prefill`` measured in the same run
  (``recompute_fraction x cached tokens x full_prefill_s / prompt tokens``).

``floor_s`` is their sum; ``ttft_over_floor`` the policy's TTFT over it. Beside it, the
work-doing ops of one fused prefill and one decode step and those of the plain forward
(``kvrag.bench.ops``): on a GPU at these sizes each op is a kernel launch, and launches, not
arithmetic, set the time. TTFT here is the prefill call (lookup + fusion, logits of the first
token), synchronised on CUDA; the QA scenario's TTFT also samples the token.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvrag.bench.ops import plain_forward, prefilled_cache, query_ops
from kvrag.layout.state import CACHED, FusionStats, Piece

REFERENCE = "full_prefill"

#: Columns of floor.csv, in order.
FLOOR_FIELDS = [
    "device",
    "dataset",
    "label",
    "policy",
    "prompt_tokens",
    "cached_tokens",
    "computed_tokens",
    "chunks",
    "ttft_s",
    "floor_s",
    "ttft_over_floor",
    "read_s",
    "move_s",
    "forward_s",
    "recompute_s",
    "recompute_fraction",
    "full_prefill_s",
    "ops_prefill",
    "ops_decode",
    "ops_plain",
    "ops_ratio",
    "syncs_prefill",
    "syncs_decode",
    "error",
]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def floor_parts(rag, prompt, repeats: int, before_run: Callable[[], object] | None = None) -> dict:
    """Median seconds of the floor's parts for ``prompt`` on ``rag`` (a KVRag) and the prompt's
    token counts: {read_s, move_s, forward_s, prompt_tokens, cached_tokens}. ``prompt_tokens``
    is the tokenizer's count (a policy's inserted tokens come on top: ``measure_floor`` times
    the forward for each policy's own non-cached count). ``before_run``: called before each
    timed read (to drop the OS page cache, say)."""
    dev, dt = rag.arch.device, rag.arch.dtype
    text = rag.render(prompt)
    reads, moves = [], []
    pieces: list[Piece] = []
    for _ in range(repeats):
        if before_run is not None:
            before_run()
        read: list[list[Piece]] = []
        reads.append(_timed(lambda: read.append(rag.pieces(text)[0]), dev))  # noqa: B023 - run at once
        pieces = read[0]
        entries = [p.entry for p in pieces if p.kind == CACHED]
        moves.append(
            _timed(
                lambda: [  # noqa: B023 - run at once, in this iteration
                    (
                        e.keys.to(device=dev, dtype=dt, non_blocking=True),
                        e.values.to(device=dev, dtype=dt, non_blocking=True),
                    )
                    for e in (x.expanded(dev, dt) for x in entries)  # noqa: B023 - packed ones expand
                ],
                dev,
            )
        )
    n = sum(int(p.token_ids.numel()) for p in pieces)
    cached = sum(int(p.token_ids.numel()) for p in pieces if p.kind == CACHED)
    return {
        "read_s": statistics.median(reads),
        "move_s": statistics.median(moves),
        "prompt_tokens": n,
        "cached_tokens": cached,
    }


def forward_s(model, n_cached: int, n_new: int, repeats: int, device) -> float:
    """Median seconds of ``plain_forward`` (the cache is built outside the clock)."""
    ts = []
    for _ in range(repeats):
        cache = prefilled_cache(model, n_cached)
        ts.append(_timed(lambda: plain_forward(model, n_cached, n_new, cache), device))  # noqa: B023 - run at once
    return statistics.median(ts)


def measure_floor(
    rag_for,
    prompt,
    runs,
    repeats: int,
    dataset: str,
    device: str,
    cold: bool = True,
    before_run: Callable[[], object] | None = None,
    count_ops: bool = True,
) -> list[dict]:
    """One record per run (``full_prefill`` first, the throughput reference): TTFT, floor and
    op counts on one prompt. ``runs``: objects with ``policy``, ``params`` and ``label``;
    ``rag_for(run)``: the KVRag the run is measured on. Timed runs interleave the policies
    round by round, after one untimed run each. ``cold``: before each run, the policy forgets
    what it memoized across queries (as the QA scenario's cold path does), so a run costs what
    a chunk's first query costs. ``before_run``: called before each timed run and read, outside
    the clock (e.g. dropping the OS page cache, so each run reads the disk). ``count_ops``:
    False leaves the op columns empty (they do not depend on where chunks are served from)."""
    from kvrag.policies import policy_class

    base = rag_for(runs[0])
    parts = floor_parts(base, prompt, repeats, before_run)
    ttfts: dict[str, list[float]] = {r.label: [] for r in runs}
    stats: dict[str, FusionStats] = {}
    errors: dict[str, str] = {}
    for rnd in range(repeats + 1):
        for run in runs:
            if run.label in errors:
                continue
            rag = rag_for(run)
            if cold:
                policy_class(run.policy).forget()
            if before_run is not None:
                before_run()
            try:
                out: dict[str, Any] = {}
                t = _timed(lambda: out.setdefault("r", rag.prefill(prompt, run.policy, **run.params)), device)  # noqa: B023
            except Exception as e:  # noqa: BLE001 - a failing policy is a result
                errors[run.label] = f"{type(e).__name__}: {e}"
                continue
            stats[run.label] = out["r"].stats
            if rnd:  # round 0 warms up
                ttfts[run.label].append(t)
    ref = statistics.median(ttfts[runs[0].label]) if ttfts[runs[0].label] else None
    L = base.arch.n_layers
    records, forwards = [], {}
    for run in runs:
        rec = {
            "device": device,
            "scenario": "floor",
            "dataset": dataset,
            "label": run.label,
            "policy": run.policy,
            "full_prefill_s": ref,
            "error": errors.get(run.label),
        }
        records.append(rec)
        if run.label in errors:
            continue
        st = stats[run.label]
        rec.update(
            prompt_tokens=st.prompt_tokens,
            cached_tokens=st.cached_tokens,
            computed_tokens=st.computed_tokens,
            chunks=st.chunks_hit,
            recompute_fraction=st.recompute_fraction,
            ttft_s=statistics.median(ttfts[run.label]),
        )
        if run.policy == REFERENCE or not st.cached_tokens:
            continue
        rag = rag_for(run)
        n_new = st.prompt_tokens - st.cached_tokens
        key = (id(rag.handle.model), st.cached_tokens, n_new)  # one measurement per distinct forward
        if key not in forwards:
            forwards[key] = forward_s(rag.handle.model, st.cached_tokens, n_new, repeats, device)
        fwd = forwards[key]
        pairs = st.recompute_fraction * st.cached_tokens * L
        recompute = pairs * ref / (st.prompt_tokens * L) if ref else 0.0
        floor = parts["read_s"] + parts["move_s"] + fwd + recompute
        ops = None
        try:
            if count_ops:
                ops = query_ops(rag, prompt, run.policy, **run.params)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"op count: {type(e).__name__}: {e}"
        rec.update(
            read_s=parts["read_s"],
            move_s=parts["move_s"],
            forward_s=fwd,
            recompute_s=recompute,
            floor_s=floor,
            ttft_over_floor=rec["ttft_s"] / floor,
        )
        if ops is not None:
            rec.update(
                ops_prefill=ops["prefill"].total,
                ops_decode=ops["decode"].total,
                ops_plain=ops["plain"].total,
                ops_ratio=ops["prefill"].total / ops["plain"].total,
                syncs_prefill=ops["prefill"].syncs,
                syncs_decode=ops["decode"].syncs,
            )
    return records
