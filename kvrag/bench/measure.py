"""What every scenario measures with: interleaved timed runs of the policies on one example,
their teacher-forced quality, and the records they fill.

A ``Measure`` holds the runs (policy + parameters, ``full_prefill`` first), the device being
measured, the KVRags the runs are measured on, and the records collected so far; the scenarios
(``kvrag.bench.scenarios``) call it, ``kvrag.bench.runner.Bench`` (the driver) is one.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvrag.bench import metrics as M
from kvrag.bench.config import REFERENCE, STOP, BenchConfig, Run
from kvrag.bench.memory import PeakMemory
from kvrag.bench.summary import median_of
from kvrag.policies import policy_class
from kvrag.qa.example import QAExample

if TYPE_CHECKING:
    from kvrag.engine import Generation, KVRag

log = logging.getLogger("kvrag.bench")


def rotate(xs: list, k: int) -> list:
    """``xs`` rotated left by ``k`` (modulo its length)."""
    if not xs:
        return xs
    k %= len(xs)
    return xs[k:] + xs[:k]


class Measure:
    """The runs, the device and the records of a benchmark (see the module docstring).
    ``say`` receives one line per step (the CLI prints it)."""

    def __init__(self, cfg: BenchConfig, runs: list[Run], progress: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.say: Callable[[str], None] = progress or (lambda s: log.info(s))
        self.runs = runs
        self.device: str  # the device being measured: Bench.run sets it, per device
        self.records: list[dict] = []
        self.floor_records: list[dict] = []  # the floor scenario (kvrag.bench.floor): a table of its own
        self.precompute_log: list[dict] = []
        self.footprint: dict = {}
        self.check: dict = {}
        self.model_info: dict = {}
        # The KVRag of the trained kvlink runs when their adapter holds LoRA weights (a model
        # of its own, with its own chunk caches); None: every run uses the base KVRag.
        self.kvlink_rag: KVRag | None = None

    def rag_for(self, run: Run, rag):
        """The KVRag ``run`` is measured on: trained ``kvlink`` runs on the LoRA-adapted model
        when there is one, everything else (``full_prefill``, the reference, included) on the
        base model ``rag``."""
        if self.kvlink_rag is not None and run.policy == "kvlink" and run.params.get("mode", "auto") != "untrained":
            return self.kvlink_rag
        return rag

    def messages(self, ex: QAExample[str], rag) -> list[dict] | str:
        """The example's RAG prompt (``kvrag.layout.prompt.rag_prompt``: chat messages, or plain text
        for a model without a chat template)."""
        from kvrag.layout.prompt import rag_prompt

        return rag_prompt(rag.tokenizer, ex.passages, ex.question)

    def precompute(self, rag, texts: list[str], scenario: str, runs: list[Run] | None = None) -> None:
        """Precompute ``texts`` on every KVRag that ``runs`` (default: all) are measured on."""
        rags = {id(r): r for r in (self.rag_for(run, rag) for run in (runs or self.runs))}
        for r in rags.values():
            todo = [t for t in dict.fromkeys(texts) if not r.is_cached(t)]
            if not todo:
                continue
            tokens = sum(len(r.chunk_ids(t)) for t in todo)
            t0 = time.perf_counter()
            r.precompute(todo)
            dt = time.perf_counter() - t0
            # A store too small for what was just stored evicts it (LRU) at once, and every
            # "reuse" run would silently measure a full prefill instead.
            gone = sum(not r.is_cached(t) for t in todo)
            if gone:
                raise RuntimeError(
                    f"{gone} of the {len(todo)} chunks just precomputed are not in the KV store any "
                    f"more: its size limit ({r.store.stats().get('size_limit')} bytes) evicted them; "
                    "use a store with a larger limit (kvrag cache gc --size-limit on --cache-dir)"
                )
            self.precompute_log.append(
                {"device": self.device, "scenario": scenario, "chunks": len(todo), "tokens": tokens, "seconds": dt}
            )

    def base_record(self, scenario: str, dataset: str, ex: QAExample[str], run: Run) -> dict:
        """The fields of a record every scenario fills the same way (no measurement yet)."""
        return {
            "device": self.device,
            "scenario": scenario,
            "dataset": dataset,
            "example_id": ex.id,
            "qtype": ex.type,
            "policy": run.policy,
            "label": run.label,
            "params": run.params,
            "recompute_ratio_param": run.params.get("recompute_ratio"),
            "gold": ex.answers,
            "error": None,
        }

    def timed_run(self, rag, msgs, run: Run, max_new: int) -> tuple[Generation, PeakMemory]:
        """One generation of ``run`` on ``msgs`` and the peak memory it took."""
        with PeakMemory(self.device) as mem:
            out = self.rag_for(run, rag).generate(
                msgs, policy=run.policy, max_new_tokens=max_new, stop=STOP, **run.params
            )
        return out, mem

    def time_policies(
        self, rag, scenario, dataset, ex: QAExample[str], runs: list[Run], index: int, repeats: int, max_new: int
    ) -> dict[str, dict]:
        """Timed, interleaved runs of every policy on one example: {label: record}."""
        msgs = self.messages(ex, rag)
        recs = {r.label: self.base_record(scenario, dataset, ex, r) for r in runs}
        ttfts: dict[str, list[float]] = {r.label: [] for r in runs}
        if self.cfg.hot_cache:
            # With a hot tier, every timed run finds the example's chunks in memory: without this
            # the first run of round 0 would read them from disk for all the others.
            for r in {id(r): r for r in (self.rag_for(run, rag) for run in runs)}.values():
                r.pieces(r.render(msgs))
        for rnd in range(repeats):
            # Rotate the order per example and per round, so drift (thermal, other load)
            # hits every policy alike.
            for run in rotate(list(runs), index + rnd):
                rec = recs[run.label]
                if rec["error"]:
                    continue
                if not self.cfg.hot_cache:
                    # Cold path: nothing of an earlier run in memory, the policy's per-chunk
                    # query-time memos (SamKV) included: the TTFT of a chunk's first query.
                    policy_class(run.policy).forget()
                try:
                    out, mem = self.timed_run(rag, msgs, run, max_new if rnd == 0 else 1)
                except Exception as e:  # noqa: BLE001 - a failing policy is a result, not a crash
                    rec["error"] = f"{type(e).__name__}: {e}"
                    log.debug("policy %s failed on %s:\n%s", run.label, ex.id, traceback.format_exc())
                    self.say(f"    {run.label}: ERROR {rec['error']}")
                    continue
                s = out.stats
                ttfts[run.label].append(s.ttft_s)
                rec["peak_mem_mb"] = max(rec.get("peak_mem_mb", 0.0), mem.peak_mb)
                rec["peak_mem_delta_mb"] = max(rec.get("peak_mem_delta_mb", 0.0), mem.delta_mb)
                if rnd == 0:
                    rec.update(
                        answer=out.text.strip(),
                        answer_token_ids=list(out.token_ids),
                        new_tokens=s.new_tokens,
                        tpot_s=(s.decode_s / (s.new_tokens - 1)) if s.new_tokens > 1 else None,
                        prompt_tokens=s.prompt_tokens,
                        cached_tokens=s.cached_tokens,
                        prefix_tokens=s.prefix_tokens,
                        recomputed_tokens=s.recomputed_tokens,
                        computed_tokens=s.computed_tokens,
                        kept_tokens=s.kept_tokens,
                        inserted_tokens=s.inserted_tokens,
                        recompute_fraction=s.recompute_fraction,
                        bytes_loaded=s.bytes_loaded,
                        chunks_hit=s.chunks_hit,
                        chunks_missed=s.chunks_missed,
                        chunks_hot=s.chunks_hot,
                        load_s=s.load_s,
                        prefill_s=s.prefill_s,
                        policy_stats={k: v for k, v in dict(s.policy_stats).items() if isinstance(v, (int, float))},
                    )
                    # Share of the prompt's KV the decoder reads per generated token: what it
                    # keeps (SamKV, A3 eviction), or what A2ATS' top-k retrieval reads.
                    # (prompt_tokens already counts inserted tokens such as KVLink's links.)
                    rec["kept_fraction"] = s.kept_tokens / s.prompt_tokens if s.prompt_tokens else None
                    rec["kv_read_fraction"] = rec["policy_stats"].get("a2ats.kv_read_fraction", rec["kept_fraction"])
                    if run.policy == REFERENCE:
                        # The exact token ids the model saw: lets a test replay them through
                        # plain transformers generation.
                        rec["prompt_ids"] = list(out.prompt_ids)
        for run in runs:
            rec, xs = recs[run.label], ttfts[run.label]
            rec["ttft_runs"] = xs
            rec["ttft_s"] = median_of(xs)
            rec["ttft_min"] = min(xs) if xs else None
            rec["ttft_max"] = max(xs) if xs else None
        ref = recs.get(REFERENCE)
        ref_ttft = ref["ttft_s"] if ref is not None else None
        for rec in recs.values():
            rec["speedup"] = ref_ttft / rec["ttft_s"] if ref_ttft and rec["ttft_s"] else None
            if ref and not ref["error"] and not rec["error"]:
                rec["fidelity_f1"] = M.token_f1(rec["answer"], ref["answer"])
                rec["fidelity_em"] = M.exact_match(rec["answer"], ref["answer"])
            if not rec["error"]:
                rec["gold_f1"] = M.best_f1(rec["answer"], ex.answers)
                rec["gold_em"] = M.best_em(rec["answer"], ex.answers)
                rec["gold_acc"] = M.best_acc(rec["answer"], ex.answers)
        return recs

    def quality(self, rag, ex: QAExample[str], recs: dict[str, dict], runs: list[Run]) -> None:
        """Teacher-forced metrics (untimed): gold answer log-likelihood, and top-1 / KL of the
        next-token distribution vs ``full_prefill`` over its answer's first positions."""
        fp = recs.get(REFERENCE)
        if fp is None or fp["error"]:
            return
        msgs = self.messages(ex, rag)
        gold_ids = rag.handle.encode(ex.answers[0])
        # Rows 0..n-1 of continuation_logits predict the reference answer's tokens 0..n-1.
        ans_ids = fp["answer_token_ids"][: self.cfg.kl_positions]
        ref_logits = ref_ll = None
        order = [r for r in runs if r.policy == REFERENCE] + [r for r in runs if r.policy != REFERENCE]
        for run in order:
            rec = recs[run.label]
            if rec["error"]:
                continue
            try:
                # One prefill, both continuations (the decoder rewinds between them).
                conts = [ans_ids[:-1]] + ([gold_ids] if gold_ids else [])
                outs, _ = self.rag_for(run, rag).continuations_logits(msgs, conts, policy=run.policy, **run.params)
                rows = outs[0][: len(ans_ids)]
                if gold_ids:
                    rec["gold_ll"] = M.mean_logprob(outs[1], gold_ids)
                    rec["gold_nll"] = -rec["gold_ll"]
                    rec["gold_tokens"] = len(gold_ids)
            except Exception as e:  # noqa: BLE001 - a failing policy is a result, not a crash
                rec["error"] = f"{type(e).__name__}: {e} (teacher forcing)"
                self.say(f"    {run.label}: ERROR {rec['error']}")
                continue
            if run.policy == REFERENCE:
                ref_logits, ref_ll = rows, rec.get("gold_ll")
            if ref_logits is not None:
                rec["top1_agreement"], rec["kl"] = M.next_token_agreement(ref_logits, rows)
                rec["kl_positions"] = len(ans_ids)
            if ref_ll is not None and rec.get("gold_ll") is not None:
                rec["gold_nll_delta"] = rec["gold_nll"] + ref_ll
                rec["gold_ll_rel_gap"] = M.relative_gap(rec["gold_ll"], ref_ll)

    def keep(self, recs: dict[str, dict]) -> None:
        """Add a scenario's finished records (one per run) to the result."""
        self.records.extend(recs.values())
