"""The benchmark driver: ``Bench`` checks a ``BenchConfig``, loads the model on each device, builds
the KVRags, and runs the scenarios (``kvrag.bench.scenarios``) one after the other; a scenario
that fails is reported without losing the others' records. Timed runs and quality metrics are
``kvrag.bench.measure``'s.

Scenarios (each one a list of records, one per example x policy):

* ``qa``: a QA file in the format of ``../shared/data/musique_dev.json`` and/or the synthetic
  QA set. Per example, every policy (``full_prefill`` always included, as the reference) is
  timed in a rotated order, ``repeats`` times; the first round generates the answer, the
  others only the first token. Then, untimed, each policy teacher-forces the gold answer
  (log-likelihood) and ``full_prefill``'s answer (top-1 agreement, KL).
* ``scaling``: TTFT at controlled context lengths (``n`` chunks of exactly ``t`` tokens).
* ``floor``: TTFT beside its floor and op counts (``kvrag.bench.floor``).
* ``sweep``: quality vs recompute ratio, for the policies that have a ``recompute_ratio``.

The prompt is CacheBlend's (fixed instruction, passages, question) as chat messages
(:func:`kvrag.layout.prompt.rag_prompt`), rendered with the model's chat template (plain text for a
model without one); every passage is
precomputed as one chunk and appears verbatim in the prompt. Precompute is never part of TTFT
(its throughput is reported on its own). TTFT ratios are computed per example, within the run.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from kvrag.bench.config import REFERENCE, STOP, BenchConfig, Run
from kvrag.bench.examples import examples_from_items, load_examples
from kvrag.bench.journal import jsonable
from kvrag.bench.machine import git_commit, machine_info
from kvrag.bench.measure import Measure
from kvrag.bench.rags import add_untrained_kvlink, ensure_a2ats_codebooks, make_rags
from kvrag.bench.scenarios import check, floor, footprint, qa, scaling, sweep
from kvrag.bench.summary import summarize, throughput
from kvrag.policies import get_policy, policy_class, policy_names
from kvrag.qa import synthetic
from kvrag.qa.example import QAExample

log = logging.getLogger("kvrag.bench")


class Bench(Measure):
    """Runs the scenarios of a ``BenchConfig`` and collects records.

    ``progress`` receives one line per step (the CLI prints it)."""

    def __init__(self, cfg: BenchConfig, progress: Callable[[str], None] | None = None):
        names = cfg.policies or policy_names()
        unknown = [p for p in names + cfg.sweep_policies if p not in policy_names()]
        if unknown:
            raise ValueError(f"unknown policies: {', '.join(unknown)}; registered: {', '.join(policy_names())}")
        for p in cfg.params:
            if p not in policy_names():
                raise ValueError(f"--param for unknown policy {p!r}")
        # full_prefill is the reference of every ratio and fidelity number: always run, first.
        names = [REFERENCE] + [p for p in dict.fromkeys(names) if p != REFERENCE]
        super().__init__(cfg, [Run(p, dict(cfg.params.get(p, {}))) for p in names], progress)
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

    def datasets(self, rag) -> list[tuple[str, list[QAExample[str]]]]:
        """(name, examples) of the QA sets to run: the data file's, then the synthetic set's."""
        cfg = self.cfg
        out = []
        if cfg.data and self.data_examples is not None:  # (read from cfg.data at construction)
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

    def warm_up(self, rag, ex: QAExample[str]) -> None:
        """One untimed run of every policy on a short prompt: one-off costs (lazy init,
        allocator growth, kernel choice) must not land on the first timed policy."""
        short = QAExample(ex.question, ex.answers, ex.passages[:2], ex.id + "-warmup")
        self.precompute(rag, short.passages, "warmup")
        self.precompute_log = [p for p in self.precompute_log if p["scenario"] != "warmup"]
        for run in self.runs:
            try:
                self.rag_for(run, rag).generate(
                    self.messages(short, rag), policy=run.policy, max_new_tokens=2, stop=STOP, **run.params
                )
            except Exception as e:  # noqa: BLE001 - the timed run records it
                log.debug("warm-up of %s failed: %s", run.label, e)

    # -- the scenarios (kvrag.bench.scenarios), run by ``run`` --
    def run_qa(self, rag, dataset: str, examples: list[QAExample[str]]) -> None:
        qa.run_qa(self, rag, dataset, examples)

    def run_scaling(self, rag) -> None:
        scaling.run_scaling(self, rag)

    def run_floor(self, rag) -> None:
        floor.run_floor(self, rag)

    def run_sweep(self, rag, datasets: dict[str, list[QAExample[str]]]) -> None:
        sweep.run_sweep(self, rag, datasets, self.sweep_policies)

    def run_check(self, rag) -> None:
        check.run_check(self, rag)

    def measure_footprint(self, rag, texts: list[str]) -> None:
        footprint.measure_footprint(self, rag, texts)

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
                # The swept policies choose the models too (make_rags reads only the policy
                # names): a trained kvlink swept alone still runs on its adapted model.
                swept = [Run(p) for p in self.sweep_policies]
                rag, self.kvlink_rag = make_rags(
                    cfg, handle, Path(cache_dir) / device.replace(":", "_"), self.runs + swept
                )
                adapter = add_untrained_kvlink(self.kvlink_rag or rag, self.runs)
                if adapter is not None:
                    self.model_info["kvlink_adapter"] = adapter
                calibration = ensure_a2ats_codebooks(rag, self.runs, self.say)
                if calibration is not None:
                    self.model_info["a2ats_calibration"] = calibration
                datasets = dict(self.datasets(rag))
                first = next((exs[0] for exs in datasets.values() if exs), None)
                if cfg.warmup:
                    warm = first or examples_from_items([synthetic.generate(1, cfg.seed)[0]], source="warmup")[0]
                    self.warm_up(rag, warm)
                # A scenario that fails is reported, not allowed to throw away the others' results.
                steps: list[tuple[str, Callable[[], None]]] = [
                    (f"qa/{name}", functools.partial(self.run_qa, rag, name, exs)) for name, exs in datasets.items()
                ]
                if cfg.synthetic and cfg.check_items and device == cfg.devices[0]:
                    steps.append(("single-hop check", functools.partial(self.run_check, rag)))
                if cfg.scaling:
                    steps.append(("scaling", functools.partial(self.run_scaling, rag)))
                if cfg.floor:
                    steps.append(("floor", functools.partial(self.run_floor, rag)))
                if self.sweep_policies and cfg.sweep_ratios and cfg.sweep_limit:
                    steps.append(("sweep", functools.partial(self.run_sweep, rag, datasets)))
                if cfg.footprint and first is not None and device == cfg.devices[0]:
                    steps.append(("footprint", functools.partial(self.measure_footprint, rag, first.passages[:3])))
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
