#!/usr/bin/env bash
# The accuracy yardstick: every reuse policy on the cross-passage items of
# benchmarks/yardstick_set.py (fixed seed) with Gemma 3 270M, whose own full prefill answers
# about half of them (SmolLM2 answers none of the other held-out sets, so accuracy relative to
# full prefill can only be read here). Gold-answer containment, gold NLL and KL to
# full_prefill, one timed run each (TTFT is only indicative unless the machine is quiet).
# Resumable: rerun the same command after an interruption (the journal in OUT keeps every
# finished example, WORK the items and the precomputed chunks); raise KVRAG_YARDSTICK_LIMIT to
# extend, or lower it to the examples done to write the report of what the journal holds.
# ~2-3 min an example on 2 loaded CPU cores, ~20 s on a quiet one.
#
# Usage: benchmarks/run_yardstick.sh OUT [extra kvrag bench options]
# Env: KVRAG_YARDSTICK_WORK (default bench_out/yardstick: items + KV store, not committed),
#      KVRAG_YARDSTICK_LIMIT (default 100), KVRAG_YARDSTICK_POLICIES (a2ats needs
#      `kvrag calibrate a2ats --model gemma3-270m` first), KVRAG_PYTHON (default .venv/bin/python),
#      KVRAG_YARDSTICK_PASSAGES / KVRAG_YARDSTICK_PASSAGE_WORDS (default 4 / 90: ~630 prompt
#      tokens; 12 / 180 give ~3k, where reuse's speed-up is larger; use a WORK of its own:
#      the data file, and so the dataset name, is then yardstick_<passages>x<words>).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${1:?usage: run_yardstick.sh OUT [options]}"
shift
PY="${KVRAG_PYTHON:-.venv/bin/python}"
WORK="${KVRAG_YARDSTICK_WORK:-bench_out/yardstick}"
mkdir -p "$OUT" "$WORK"
PASSAGES="${KVRAG_YARDSTICK_PASSAGES:-4}"
WORDS="${KVRAG_YARDSTICK_PASSAGE_WORDS:-90}"
# The file's name is the run's dataset name: another shape is another item set.
DATA="$WORK/yardstick.json"
if [ "$PASSAGES/$WORDS" != "4/90" ]; then DATA="$WORK/yardstick_${PASSAGES}x${WORDS}.json"; fi
"$PY" benchmarks/yardstick_set.py "$DATA" --n 120 --seed 38 --passages "$PASSAGES" --passage-words "$WORDS" >/dev/null
exec env HF_HUB_OFFLINE=1 "$PY" -m kvrag bench --data "$DATA" --model gemma3-270m \
    --limit "${KVRAG_YARDSTICK_LIMIT:-100}" \
    --policies "${KVRAG_YARDSTICK_POLICIES:-full_prefill,prophetkv,cacheblend,a3,epic,naive_reuse,kvlink,samkv}" \
    --param cacheblend.recompute_ratio=0.2 --param a3.recompute_ratio=0.2 \
    --repeats 1 --max-new-tokens 8 --kl-positions 8 --scaling none --sweep-policies none \
    --check-items 0 --no-footprint --no-warmup --resume --cache-dir "$WORK/kv" --out "$OUT" "$@"
