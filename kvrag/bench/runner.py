"""The benchmark runner: prompts, interleaved timed runs, quality metrics, records, summary.

Scenarios (each one a list of records, one per example x policy):

* ``qa``: a QA file in the format of ``../shared/data/musique_dev.json`` and/or the synthetic
  QA set. Per example, every policy (``full_prefill`` always included, as the reference) is
  timed in a rotated order, ``repeats`` times; the first round generates the answer, the
  others only the first token. Then, untimed, each policy teacher-forces the gold answer
  (log-likelihood) and ``full_prefill``'s answer (top-1 agreement, KL).
* ``scaling``: TTFT at controlled context lengths (``n`` chunks of exactly ``t`` tokens).
* ``sweep``: quality vs recompute ratio, for the policies that have a ``recompute_ratio``.

The prompt is CacheBlend's (fixed instruction, passages, question) as chat messages
(:func:`kvrag.query.prompt.rag_prompt`), rendered with the model's chat template (plain text for a
model without one); every passage is
precomputed as one chunk and appears verbatim in the prompt. Precompute is never part of TTFT
(its throughput is reported on its own). TTFT ratios are computed per example, within the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrag.bench import metrics as M
from kvrag.bench import synthetic
from kvrag.bench.config import REFERENCE, STOP, BenchConfig, Run
from kvrag.bench.examples import Example, examples_from_items, load_examples
from kvrag.bench.journal import JOURNAL_FORMAT, NOT_IN_JOURNAL_IDENTITY, journal_path, jsonable
from kvrag.bench.machine import git_commit, machine_info
from kvrag.bench.memory import PeakMemory, dir_bytes
from kvrag.bench.summary import median_of, summarize, throughput
from kvrag.policies import get_policy, policy_class, policy_names

log = logging.getLogger("kvrag.bench")

log = logging.getLogger("kvrag.bench")


def _rotate(xs: list, k: int) -> list:
    if not xs:
        return xs
    k %= len(xs)
    return xs[k:] + xs[:k]


class Bench:
    """Runs the scenarios of a ``BenchConfig`` and collects records.

    ``progress`` receives one line per step (the CLI prints it)."""

    def __init__(self, cfg: BenchConfig, progress: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.say = progress or (lambda s: log.info(s))
        names = cfg.policies or policy_names()
        unknown = [p for p in names + cfg.sweep_policies if p not in policy_names()]
        if unknown:
            raise ValueError(f"unknown policies: {', '.join(unknown)}; registered: {', '.join(policy_names())}")
        for p in cfg.params:
            if p not in policy_names():
                raise ValueError(f"--param for unknown policy {p!r}")
        # full_prefill is the reference of every ratio and fidelity number: always run, first.
        names = [REFERENCE] + [p for p in dict.fromkeys(names) if p != REFERENCE]
        self.runs = [Run(p, dict(cfg.params.get(p, {}))) for p in names]
        for r in self.runs:  # bad hyper-parameters fail now, not after an hour
            get_policy(r.policy, **r.params)
        self.sweep_policies = [p for p in dict.fromkeys(cfg.sweep_policies)]
        for p in self.sweep_policies:
            fields = {f.name for f in dataclasses.fields(policy_class(p).Params)}
            if "recompute_ratio" not in fields:
                raise ValueError(f"sweep policy {p!r} has no recompute_ratio parameter")
        if cfg.kvlink_adapter not in (None, "none", "default", "links", "auto"):
            from kvrag.policies.kvlink.adapter import load_adapter

            load_adapter(cfg.kvlink_adapter)  # a wrong path must not cost a model load either
        # Read and check the data file now: a typo must not cost a model load.
        self.data_examples = (
            load_examples(cfg.data, limit=cfg.limit, passages=cfg.passages, passage_words=cfg.passage_words)
            if cfg.data
            else None
        )
        self.records: list[dict] = []
        self.floor_records: list[dict] = []  # the floor scenario (kvrag.bench.floor): a table of its own
        self.precompute_log: list[dict] = []
        self.footprint: dict = {}
        self.check: dict = {}
        self.model_info: dict = {}
        # The KVRag of the trained kvlink runs when their adapter holds LoRA weights (a model
        # of its own, with its own chunk caches); None: every run uses the base KVRag.
        self.kvlink_rag = None

    def rag_for(self, run: Run, rag):
        """The KVRag ``run`` is measured on: trained ``kvlink`` runs on the LoRA-adapted model
        when there is one, everything else (``full_prefill``, the reference, included) on the
        base model ``rag``."""
        if self.kvlink_rag is not None and run.policy == "kvlink" and run.params.get("mode", "auto") != "untrained":
            return self.kvlink_rag
        return rag

    # -- datasets --
    def datasets(self, rag) -> list[tuple[str, list[Example]]]:
        cfg = self.cfg
        out = []
        if self.data_examples is not None:
            out.append((Path(cfg.data).stem, self.data_examples))
        if cfg.synthetic:
            items = synthetic.generate(
                cfg.synthetic,
                cfg.seed,
                types=cfg.synthetic_types,
                n_passages=cfg.synthetic_passages,
                passage_tokens=cfg.synthetic_passage_tokens,
                count_tokens=lambda s: len(rag.handle.encode(s)),
            )
            out.append(("synthetic", examples_from_items(items, source="synthetic")))
        return out

    def run_check(self, rag) -> None:
        """The synthetic generator's answerability check: ``full_prefill`` alone on
        ``check_items`` single-hop items (a seed of their own), answered = the gold answer is
        contained in the answer or matches it exactly. Untimed; the QA scenario's few
        single-hop items are too few to tell whether the model can do the task at all."""
        cfg = self.cfg
        seed = cfg.seed + 1
        items = synthetic.generate(
            cfg.check_items,
            seed,
            types=("single_hop",),
            n_passages=cfg.synthetic_passages,
            passage_tokens=cfg.synthetic_passage_tokens,
            count_tokens=lambda s: len(rag.handle.encode(s)),
        )
        answered = 0
        for i, ex in enumerate(examples_from_items(items, source="check"), 1):
            out = rag.generate(self.messages(ex, rag), policy=REFERENCE, max_new_tokens=cfg.max_new_tokens, stop=STOP)
            answer = out.text.strip()
            answered += bool(M.best_acc(answer, ex.answers) or M.best_em(answer, ex.answers))
            if i % 8 == 0 or i == len(items):
                self.say(f"  single-hop check {i}/{len(items)}: {answered} answered")
        self.check = {
            "device": self.device,
            "items": len(items),
            "answered": answered,
            "seed": seed,
            "passages": cfg.synthetic_passages,
            "passage_tokens": cfg.synthetic_passage_tokens,
        }

    # -- one prompt --
    def messages(self, ex: Example, rag) -> list[dict] | str:
        """The example's RAG prompt (``kvrag.query.prompt.rag_prompt``: chat messages, or plain text
        for a model without a chat template)."""
        from kvrag.query.prompt import rag_prompt

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

    def _base_record(self, scenario, dataset, ex: Example, run: Run) -> dict:
        return {
            "device": self.device,
            "scenario": scenario,
            "dataset": dataset,
            "example_id": ex.id,
            "qtype": ex.qtype,
            "policy": run.policy,
            "label": run.label,
            "params": run.params,
            "recompute_ratio_param": run.params.get("recompute_ratio"),
            "gold": ex.answers,
            "error": None,
        }

    def _timed(self, rag, msgs, run: Run, max_new: int) -> tuple[Any, PeakMemory]:
        with PeakMemory(self.device) as mem:
            out = self.rag_for(run, rag).generate(
                msgs, policy=run.policy, max_new_tokens=max_new, stop=STOP, **run.params
            )
        return out, mem

    def time_policies(
        self, rag, scenario, dataset, ex: Example, runs: list[Run], index: int, repeats: int, max_new: int
    ) -> dict[str, dict]:
        """Timed, interleaved runs of every policy on one example: {label: record}."""
        msgs = self.messages(ex, rag)
        recs = {r.label: self._base_record(scenario, dataset, ex, r) for r in runs}
        ttfts: dict[str, list[float]] = {r.label: [] for r in runs}
        if self.cfg.hot_cache:
            # With a hot tier, every timed run finds the example's chunks in memory: without this
            # the first run of round 0 would read them from disk for all the others.
            for r in {id(r): r for r in (self.rag_for(run, rag) for run in runs)}.values():
                r.pieces(r.render(msgs))
        for rnd in range(repeats):
            # Rotate the order per example and per round, so drift (thermal, other load)
            # hits every policy alike.
            for run in _rotate(list(runs), index + rnd):
                rec = recs[run.label]
                if rec["error"]:
                    continue
                if not self.cfg.hot_cache:
                    # Cold path: nothing of an earlier run in memory, the policy's per-chunk
                    # query-time memos (SamKV) included: the TTFT of a chunk's first query.
                    policy_class(run.policy).forget()
                try:
                    out, mem = self._timed(rag, msgs, run, max_new if rnd == 0 else 1)
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
        for rec in recs.values():
            ok = ref and ref["ttft_s"] and rec["ttft_s"]
            rec["speedup"] = ref["ttft_s"] / rec["ttft_s"] if ok else None
            if ref and not ref["error"] and not rec["error"]:
                rec["fidelity_f1"] = M.token_f1(rec["answer"], ref["answer"])
                rec["fidelity_em"] = M.exact_match(rec["answer"], ref["answer"])
            if not rec["error"]:
                rec["gold_f1"] = M.best_f1(rec["answer"], ex.answers)
                rec["gold_em"] = M.best_em(rec["answer"], ex.answers)
                rec["gold_acc"] = M.best_acc(rec["answer"], ex.answers)
        return recs

    def quality(self, rag, ex: Example, recs: dict[str, dict], runs: list[Run]) -> None:
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

    def _done(self, recs: dict[str, dict]) -> None:
        for rec in recs.values():
            self.records.append(rec)

    # -- the QA journal --
    def _journal_identity(self, dataset: str) -> dict:
        cfg = {k: v for k, v in dataclasses.asdict(self.cfg).items() if k not in NOT_IN_JOURNAL_IDENTITY}
        ident = {
            "format": JOURNAL_FORMAT,
            "device": self.device,
            "dataset": dataset,
            "model": self.model_info.get("fingerprint"),
            "kvlink_adapter": self.model_info.get("kvlink_adapter"),
            "runs": [r.label for r in self.runs],
            "config": jsonable(cfg),
        }
        return json.loads(json.dumps(ident, default=str))  # as it reads back: tuples are lists

    def open_journal(self, dataset: str) -> tuple[dict[str, list[dict]], Path]:
        """({example key: its records} already finished, the journal path). Without ``resume``
        the journal starts anew; with it, a journal of another configuration is an error and
        a line torn by the interruption is dropped."""
        path = journal_path(self.cfg.out, self.device, dataset)
        ident = self._journal_identity(dataset)
        done: dict[str, list[dict]] = {}
        kept: list[str] = []
        if self.cfg.resume and path.is_file():
            lines = path.read_text(encoding="utf-8").splitlines()
            try:
                head = json.loads(lines[0])["journal"] if lines else None
            except (json.JSONDecodeError, KeyError, TypeError):
                head = None
            if head != ident:
                differ = sorted(
                    k
                    for k in ident["config"]
                    if not isinstance(head, dict) or (head.get("config") or {}).get(k) != ident["config"][k]
                )
                differ += [
                    k for k in ident if k != "config" and (not isinstance(head, dict) or head.get(k) != ident[k])
                ]
                raise ValueError(
                    f"--resume: {path} was written by another run configuration (differs in: "
                    f"{', '.join(differ) or 'its header'}); use another --out, or run without --resume"
                )
            for line in lines[1:]:
                try:
                    row = json.loads(line)
                    done[str(row["key"])] = list(row["records"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    break  # the line the interrupted run was writing, and nothing after it
                kept.append(line)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join([json.dumps({"journal": ident})] + kept) + "\n", encoding="utf-8")
        return done, path

    @staticmethod
    def _journal_key(i: int, ex: Example) -> str:
        return f"{i}:{ex.id}"

    # -- scenarios --
    def run_qa(self, rag, dataset: str, examples: list[Example]) -> None:
        done, journal = self.open_journal(dataset)
        kept = sum(self._journal_key(i, ex) in done for i, ex in enumerate(examples))
        self.say(
            f"[{self.device}] qa/{dataset}: {len(examples)} examples x {len(self.runs)} policies"
            + (f" ({kept} kept from {journal})" if kept else "")
        )
        for i, ex in enumerate(examples):
            key = self._journal_key(i, ex)
            if key in done:
                self.records.extend(done[key])
                continue
            # Each example's chunks just before it runs: the store then needs to hold one
            # example's chunks (all of them at once would outgrow its size limit on a long run,
            # and the LRU would evict the first examples' chunks before they are timed).
            self.precompute(rag, ex.passages, f"qa/{dataset}")
            t0 = time.perf_counter()
            recs = self.time_policies(rag, "qa", dataset, ex, self.runs, i, self.cfg.repeats, self.cfg.max_new_tokens)
            self.quality(rag, ex, recs, self.runs)
            self._done(recs)
            with journal.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "records": list(recs.values())}, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())
            fp = recs[REFERENCE]
            self.say(
                f"  {dataset} {i + 1}/{len(examples)} ({fp.get('prompt_tokens')} tok, "
                f"{time.perf_counter() - t0:.0f}s): "
                + "  ".join(f"{r['label']} {r['ttft_s'] or float('nan'):.2f}s" for r in recs.values())
            )

    def run_scaling(self, rag) -> None:
        cfg = self.cfg
        self.say(f"[{self.device}] scaling: {', '.join(f'{n}x{t}' for n, t in cfg.scaling)}")
        enc = rag.handle.encode
        dec = lambda ids: rag.tokenizer.decode(ids)  # noqa: E731
        for i, (n, t) in enumerate(cfg.scaling):
            item = synthetic.exact_length_item(n, t, enc, dec, seed=cfg.seed)
            ex = examples_from_items([item], source="scaling")[0]
            self.precompute(rag, ex.passages, "scaling")
            recs = self.time_policies(rag, "scaling", f"{n}x{t}", ex, self.runs, i, cfg.repeats, cfg.max_new_tokens)
            for rec in recs.values():
                rec.update(chunks=n, chunk_tokens=t)
            self._done(recs)
            self.say(
                f"  {n}x{t} ({recs[REFERENCE].get('prompt_tokens')} tok): "
                + "  ".join(f"{r['label']} {r['ttft_s'] or float('nan'):.2f}s" for r in recs.values())
            )

    def run_floor(self, rag) -> None:
        """TTFT beside its floor and op counts (``kvrag.bench.floor``) at each floor point."""
        from kvrag.bench.floor import measure_floor

        cfg = self.cfg
        self.say(f"[{self.device}] floor: {', '.join(f'{n}x{t}' for n, t in cfg.floor)}")
        for n, t in cfg.floor:
            item = synthetic.exact_length_item(n, t, rag.handle.encode, rag.tokenizer.decode, seed=cfg.seed)
            ex = examples_from_items([item], source="floor")[0]
            self.precompute(rag, ex.passages, "floor")
            recs = measure_floor(
                lambda run: self.rag_for(run, rag),
                self.messages(ex, rag),
                self.runs,
                cfg.repeats,
                f"{n}x{t}",
                self.device,
                cold=not cfg.hot_cache,
            )
            self.floor_records += recs
            self.say(
                f"  {n}x{t} ({recs[0].get('prompt_tokens')} tok): "
                + "  ".join(
                    f"{r['label']} {r.get('ttft_s') or float('nan'):.3f}s"
                    + (
                        f" (floor {r['floor_s']:.3f}s, ops {r.get('ops_prefill')}/{r.get('ops_plain')})"
                        if r.get("floor_s")
                        else ""
                    )
                    for r in recs
                )
            )

    def run_sweep(self, rag, datasets: dict[str, list[Example]]) -> None:
        cfg = self.cfg
        name = (
            "synthetic"
            if cfg.sweep_data == "synthetic" and "synthetic" in datasets
            else next((k for k in datasets if k != "synthetic"), None) or next(iter(datasets), None)
        )
        if name is None:
            return
        examples = datasets[name][: cfg.sweep_limit]
        runs = [Run(REFERENCE)] + [
            Run(p, {**cfg.params.get(p, {}), "recompute_ratio": r})
            for p in self.sweep_policies
            for r in cfg.sweep_ratios
        ]
        self.say(f"[{self.device}] sweep on {name}: {len(examples)} examples x {len(runs) - 1} (policy, ratio)")
        for i, ex in enumerate(examples):
            self.precompute(rag, ex.passages, f"sweep/{name}", runs)
            t0 = time.perf_counter()
            recs = self.time_policies(rag, "sweep", name, ex, runs, i, 1, cfg.max_new_tokens)
            self.quality(rag, ex, recs, runs)
            self._done(recs)
            self.say(f"  sweep {i + 1}/{len(examples)} ({time.perf_counter() - t0:.0f}s)")

    def measure_footprint(self, rag, texts: list[str]) -> None:
        """Disk bytes per 1k tokens of stored K/V in fp32 and fp16, against 2*L*Hkv*D*bytes."""
        from kvrag.engine import KVRag

        cfg = rag.handle.model.config
        layers = cfg.num_hidden_layers
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        tokens = sum(len(rag.chunk_ids(t)) for t in texts)
        out = {"tokens": tokens, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
        for dt, nbytes in (("float32", 4), ("float16", 2)):
            with tempfile.TemporaryDirectory(prefix="kvrag-footprint-") as d:
                r = KVRag(rag.handle, cache_dir=d, storage_dtype=dt, chunk_anchor=rag.anchor)
                empty = dir_bytes(d)
                r.precompute(texts)
                used = dir_bytes(d) - empty
                blob = r.store.stats()["bytes"]
            bound = 2 * layers * kv_heads * head_dim * nbytes * 1000
            out[dt] = {
                "bytes_per_1k": used / tokens * 1000,
                "blob_bytes_per_1k": blob / tokens * 1000,
                "bound_per_1k": bound,
                "ratio": used / tokens * 1000 / bound,
            }
        self.footprint = out

    def warm_up(self, rag, ex: Example) -> None:
        """One untimed run of every policy on a short prompt: one-off costs (lazy init,
        allocator growth, kernel choice) must not land on the first timed policy."""
        short = Example(ex.id + "-warmup", ex.question, ex.answers, ex.passages[:2])
        self.precompute(rag, short.passages, "warmup")
        self.precompute_log = [p for p in self.precompute_log if p["scenario"] != "warmup"]
        for run in self.runs:
            try:
                self.rag_for(run, rag).generate(
                    self.messages(short, rag), policy=run.policy, max_new_tokens=2, stop=STOP, **run.params
                )
            except Exception as e:  # noqa: BLE001 - the timed run records it
                log.debug("warm-up of %s failed: %s", run.label, e)

    def _ensure_a2ats_codebooks(self, rag) -> None:
        """A2ATS needs codebooks fitted offline for the model (``kvrag calibrate a2ats``); on a
        fresh machine fit them once here, untimed, rather than report a2ats as an error."""
        from kvrag.policies.a2ats import calibrate as cal
        from kvrag.policies.a2ats import codebook as books

        if not any(r.policy == "a2ats" and "codebook" not in r.params for r in self.runs):
            return
        if books.find_codebooks(rag.arch) is not None:
            return
        self.say("fitting A2ATS codebooks for this model (once; untimed; `kvrag calibrate a2ats`) ...")
        t0 = time.perf_counter()
        _, path = cal.calibrate(rag.handle)
        self.model_info["a2ats_calibration"] = {"path": str(path), "seconds": time.perf_counter() - t0}

    def _make_rags(self, handle, cache_dir: Path):
        """The base KVRag, and (when the configured KVLink adapter holds LoRA weights) the
        adapted one of the trained ``kvlink`` runs, in ``self.kvlink_rag``."""
        from kvrag.engine import KVRag
        from kvrag.policies.kvlink.adapter import KVLinkError, default_adapter, find_adapter, load_adapter

        cfg = self.cfg
        kw = dict(storage_dtype=cfg.storage_dtype, chunk_anchor=cfg.chunk_anchor, hot_cache=cfg.hot_cache)
        adapter = cfg.kvlink_adapter
        ad = None
        if adapter == "default":
            ad = default_adapter(handle, allow_lora=True)
        elif adapter not in (None, "none", "links"):
            path = find_adapter(handle) if adapter == "auto" else adapter
            if path is None:
                raise KVLinkError(
                    "--kvlink-adapter auto: no KVLink adapter for this model; train one with `kvrag train kvlink`"
                )
            ad = load_adapter(path)
        if ad is None:
            base_adapter, lora = ("links" if adapter == "links" else None), None
        else:
            # A links-only adapter leaves the weights (and full_prefill) alone: it can ride on
            # the base KVRag. LoRA weights would change the reference too.
            base_adapter, lora = (None, ad) if ad.has_lora else (ad, None)
        rag = KVRag(
            handle,
            cache_dir=cache_dir,
            kvlink_adapter=base_adapter,
            ingest_policies=[r.policy for r in self.runs],
            **kw,
        )
        self.kvlink_rag = None
        if lora is not None and any(r.policy == "kvlink" for r in self.runs):
            # Same store directory: the adapted model's fingerprint keeps its chunks apart.
            self.kvlink_rag = KVRag(handle, cache_dir=cache_dir, kvlink_adapter=lora, ingest_policies=["kvlink"], **kw)
        return rag

    def _add_untrained_kvlink(self, rag) -> None:
        """With a KVLink adapter loaded, ``kvlink`` runs trained; add its untrained variant
        (on the base model) beside it so the report shows what the training bought."""
        from kvrag.policies.kvlink.policy import ADAPTER_ATTR

        adapter = getattr((self.kvlink_rag or rag).handle.model, ADAPTER_ATTR, None)
        if adapter is None:
            return
        self.model_info["kvlink_adapter"] = {
            "path": str(adapter.path),
            "link_tokens": adapter.link_tokens,
            "lora": adapter.has_lora,
            "steps": adapter.meta.get("steps"),
            "command": adapter.meta.get("command"),
        }
        untrained = Run("kvlink", {"mode": "untrained"})
        if any(r.policy == "kvlink" and not r.params for r in self.runs) and all(
            r.label != untrained.label for r in self.runs
        ):
            self.runs.append(untrained)

    def run(self) -> dict:
        """Every scenario on every device; returns the result (records, summary, meta)."""
        from kvrag.model import ModelHandle

        cfg = self.cfg
        t_start = time.perf_counter()
        meta = {
            "machine": machine_info(cfg.devices),
            "command": cfg.command,
            "git_commit": git_commit(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "config": jsonable(dataclasses.asdict(cfg)),
        }
        for device in cfg.devices:
            self.device = device
            self.say(f"loading model on {device} ...")
            handle = ModelHandle.load(cfg.model, dtype=cfg.dtype, device=device)
            mc = handle.model.config
            self.model_info = {
                "name": getattr(mc, "_name_or_path", "") or cfg.model or "SmolLM2-135M-Instruct (default)",
                "fingerprint": handle.fingerprint[:16],
                "layers": mc.num_hidden_layers,
                "kv_heads": getattr(mc, "num_key_value_heads", None),
                "dtype": cfg.dtype,
                "storage_dtype": cfg.storage_dtype,
                "chunk_anchor": handle.anchor_ids() if cfg.chunk_anchor == "auto" else [],
            }
            tmp = None
            cache_dir = cfg.cache_dir
            if cache_dir is None:
                tmp = tempfile.TemporaryDirectory(prefix="kvrag-bench-")
                cache_dir = tmp.name
            try:
                rag = self._make_rags(handle, Path(cache_dir) / device.replace(":", "_"))
                self._add_untrained_kvlink(rag)
                self._ensure_a2ats_codebooks(rag)
                datasets = dict(self.datasets(rag))
                first = next((exs[0] for exs in datasets.values() if exs), None)
                if cfg.warmup:
                    warm = first or examples_from_items([synthetic.generate(1, cfg.seed)[0]], source="warmup")[0]
                    self.warm_up(rag, warm)
                # A scenario that fails is reported, not allowed to throw away the others' results.
                steps = [(f"qa/{name}", lambda n=name, e=exs: self.run_qa(rag, n, e)) for name, exs in datasets.items()]
                if cfg.synthetic and cfg.check_items and device == cfg.devices[0]:
                    steps.append(("single-hop check", lambda: self.run_check(rag)))
                if cfg.scaling:
                    steps.append(("scaling", lambda: self.run_scaling(rag)))
                if cfg.floor:
                    steps.append(("floor", lambda: self.run_floor(rag)))
                if self.sweep_policies and cfg.sweep_ratios and cfg.sweep_limit:
                    steps.append(("sweep", lambda: self.run_sweep(rag, datasets)))
                if cfg.footprint and first is not None and device == cfg.devices[0]:
                    steps.append(("footprint", lambda: self.measure_footprint(rag, first.passages[:3])))
                for what, step in steps:
                    try:
                        step()
                    except Exception as e:  # noqa: BLE001
                        msg = f"[{device}] {what} failed: {type(e).__name__}: {e}"
                        self.say(msg)
                        log.debug("%s\n%s", msg, traceback.format_exc())
                        meta.setdefault("errors", []).append(msg)
            finally:
                if tmp is not None:
                    tmp.cleanup()
        meta["wall_s"] = time.perf_counter() - t_start
        meta["model"] = self.model_info
        return {
            "records": self.records,
            "meta": meta,
            "precompute": self.precompute_log,
            "floor": self.floor_records,
            "footprint": self.footprint,
            "single_hop_check": self.check,
            "summary": summarize(self.records),
            "throughput": throughput(self.records, self.precompute_log),
        }
