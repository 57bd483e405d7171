"""Benchmark and evaluation: ``kvrag bench`` (issue 5).

* :mod:`kvrag.bench.metrics` – answer F1/EM, fidelity, teacher-forced log-likelihood, top-1/KL;
* :mod:`kvrag.bench.synthetic` – seeded synthetic multi-document QA;
* :mod:`kvrag.bench.runner` – prompts, interleaved timed runs, records, summary;
* :mod:`kvrag.bench.report` – CSV, plots, the markdown report with PASS/FAIL targets.
"""
