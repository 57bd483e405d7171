#!/usr/bin/env bash
# QA score where the model itself can answer: 48 synthetic single-hop items (6 passages x 200
# tokens, the fact in one passage), every policy against full_prefill, one timed run each.
# The default report's QA targets rest on 18 mixed items that SmolLM2-135M answers 4 of with full
# prefill, too few to tell 90% of its score from 25%; full prefill answers most single-hop items.
# Writes docs/bench/single_hop/benchmarks.md; ~30 min on 2 CPU cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/kvrag bench --synthetic 48 --synthetic-types single_hop --repeats 1 --scaling none \
    --sweep-policies none --check-items 0 --no-footprint \
    --out bench_out/single_hop --report docs/bench/single_hop/benchmarks.md "$@"
