"""The benchmark's scenarios, one per module; each fills a ``kvrag.bench.measure.Measure``'s
records (``kvrag.bench.runner.Bench`` runs them in turn):

* :mod:`.qa` – the QA sets: timed policies, teacher-forced quality, resumable via its journal;
* :mod:`.scaling` – TTFT at controlled context lengths (``n`` chunks of exactly ``t`` tokens);
* :mod:`.floor` – TTFT beside its floor and op counts (``kvrag.bench.floor``);
* :mod:`.sweep` – quality vs recompute ratio;
* :mod:`.check` – the synthetic generator's single-hop answerability check;
* :mod:`.footprint` – disk bytes per 1k stored tokens against the K/V bound.
"""
