#!/usr/bin/env bash
# The default benchmark report, on this machine: docs/benchmarks.md (numbers, targets, machine,
# exact command) with its plots and CSVs under docs/bench/; raw records in bench_out/default/.
# ~25-35 min on 2 CPU cores. Extra arguments go to `kvrag bench` (e.g. --limit 20, --device auto).
# KVRAG_BENCH_DATA: a QA file in the format of musique_dev.json (default: the shared MuSiQue dev set).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
DATA="${KVRAG_BENCH_DATA:-../shared/data/musique_dev.json}"
# 5 MuSiQue questions x 10 passages (~6.2k prompt tokens: the issue's "~6k" point), 18 synthetic
# items (6 of each question type; 6 passages x 200 tokens), TTFT at 1k/2k/4k/6k tokens (4x256 .. 12x512 chunks) and the
# recompute-ratio sweep of cacheblend and a3: every policy side by side, full_prefill as reference.
exec .venv/bin/kvrag bench --data "$DATA" --limit 5 --synthetic 18 \
    --out bench_out/default --report docs/benchmarks.md "$@"
