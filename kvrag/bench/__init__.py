"""Benchmark and evaluation: ``kvrag bench``.

* :mod:`kvrag.bench.config` – ``BenchConfig``, ``Run``; :mod:`kvrag.bench.examples` – the QA examples
  (:mod:`kvrag.qa`'s, their passages as the prompt shows them);
* :mod:`kvrag.bench.runner` – ``Bench``: the driver (config checks, model per device, scenarios in turn);
* :mod:`kvrag.bench.measure` – ``Measure``: interleaved timed runs, teacher-forced quality, records;
* :mod:`kvrag.bench.scenarios` – one module per scenario (qa, scaling, floor, sweep, check, footprint);
* :mod:`kvrag.bench.rags` – the KVRags a run measures on (base, KVLink LoRA-adapted);
* :mod:`kvrag.bench.memory`, :mod:`kvrag.bench.machine` – peak memory, where a run ran;
* :mod:`kvrag.bench.journal` – the QA scenario's resume journal;
* :mod:`kvrag.bench.summary` – per-policy summary rows, precompute throughput;
* :mod:`kvrag.bench.metrics` – answer F1/EM, fidelity, teacher-forced log-likelihood, top-1/KL;
* :mod:`kvrag.bench.targets` – the targets, judged PASS/FAIL against a run; :mod:`kvrag.bench.outputs` –
  results.json, CSV files, plots (:mod:`kvrag.bench.plots`); :mod:`kvrag.bench.report` – the markdown report
  (its tables: :mod:`kvrag.bench.tables`);
* :mod:`kvrag.bench.ops`, :mod:`kvrag.bench.floor` – op counts, the TTFT floor.
"""
