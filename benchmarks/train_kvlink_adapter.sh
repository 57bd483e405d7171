#!/usr/bin/env bash
# Re-trains a KVLink adapter shipped in kvrag/assets/kvlink/<model key>/: writes its training
# data, then runs `kvrag train kvlink` with the options recorded in the shipped kvlink.json.
# The data file's sha256 equals the shipped kvlink.json's "data_sha256".
#
# Usage: benchmarks/train_kvlink_adapter.sh [OUT] [MODEL]
#   MODEL smollm2 (default): 480 synthetic items of seed 1000 (the benchmark uses seed 0, the
#     tests seed 7), six passages of 200 tokens, five per prompt, shuffled (~55 min on 2 CPU cores).
#   MODEL gemma3-270m: 480 items of seed 1000 with ten passages of 200 (Gemma) tokens, 4-10 per
#     prompt (ten-passage ones exceed --max-tokens and are drawn again), in the item's order so
#     that a passage continuing the one before it stays readable (~61 min on 2 CPU cores; it
#     checkpoints every 20 steps, and its kvrag command with --resume in place of --force
#     continues a sitting cut short).
#   MODEL gemma3-270m-long: not shipped; 220 more steps from the shipped Gemma adapter (--init
#     auto) on 480 items of seed 1001 with twelve passages, 4-12 per prompt, up to 3,072 tokens
#     (~45 min; docs/bench/yardstick_gemma3_long_kvlink12 measures it).
# OUT defaults to bench_out/kvlink_adapter/ (smollm2), bench_out/kvlink_gemma/ (gemma3-270m) or
# bench_out/kvlink_gemma_long/ (gemma3-270m-long).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODEL="${2:-smollm2}"
case "$MODEL" in
smollm2)
    OUT="${1:-bench_out/kvlink_adapter}"
    SEED=1000 PASSAGES=6 STEPS=480
    TRAIN=(--docs 5 --max-passage-chars 1000 --max-minutes 62 --log-every 10)
    ;;
gemma3-270m)
    OUT="${1:-bench_out/kvlink_gemma}"
    SEED=1000 PASSAGES=10 STEPS=480
    TRAIN=(--model gemma3-270m --min-docs 4 --docs 10 --max-docs 10 --passage-order source --max-minutes 75
        --checkpoint-every 20 --log-every 5)
    ;;
gemma3-270m-long)
    OUT="${1:-bench_out/kvlink_gemma_long}"
    SEED=1001 PASSAGES=12 STEPS=220
    TRAIN=(--model gemma3-270m --init auto --min-docs 4 --docs 12 --max-docs 12 --max-tokens 3072
        --passage-order source --max-minutes 60 --checkpoint-every 10 --seed 1)
    ;;
*)
    echo "MODEL must be smollm2, gemma3-270m or gemma3-270m-long, got '$MODEL'" >&2
    exit 2
    ;;
esac
bash scripts/setup.sh
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
.venv/bin/python - "$OUT/train.json" "${MODEL%-long}" "$PASSAGES" "$SEED" <<'PY'
import json, sys
from kvrag.qa import synthetic
from kvrag.model import default_tokenizer

out, model, passages, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tok = default_tokenizer(model=model)
count = lambda s: len(tok.encode(s, add_special_tokens=False))
items = synthetic.generate(480, seed, n_passages=passages, passage_tokens=200, count_tokens=count)
with open(out, "w") as f:
    json.dump(items, f)
PY
sha256sum "$OUT/train.json"
# The recorded commands: the options both share, then each model's own (TRAIN).
exec .venv/bin/kvrag train kvlink --data "$OUT/train.json" --lora-rank 8 --lr 0.0005 --objective distill \
    --link-lr 0.005 --steps "$STEPS" --threads 2 "${TRAIN[@]}" --out "$OUT/adapter" --force
