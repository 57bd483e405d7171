"""Benchmark and evaluation: ``kvrag bench``.

* :mod:`kvrag.bench.config` – ``BenchConfig``, ``Run``; :mod:`kvrag.bench.examples` – the QA examples;
* :mod:`kvrag.bench.runner` – ``Bench``: the scenarios, interleaved timed runs, records;
* :mod:`kvrag.bench.memory`, :mod:`kvrag.bench.machine` – peak memory, where a run ran;
* :mod:`kvrag.bench.journal` – the QA scenario's resume journal;
* :mod:`kvrag.bench.summary` – per-policy summary rows, precompute throughput;
* :mod:`kvrag.bench.metrics` – answer F1/EM, fidelity, teacher-forced log-likelihood, top-1/KL;
* :mod:`kvrag.bench.synthetic` – seeded synthetic multi-document QA;
* :mod:`kvrag.bench.report` – CSV, plots, the markdown report with PASS/FAIL targets.
"""
