#!/usr/bin/env bash
# Re-trains the KVLink adapter shipped for the default model (kvrag/assets/kvlink/<model key>/):
# writes its training data, then runs the exact `kvrag train kvlink` command recorded in the
# shipped kvlink.json (~55 min on 2 CPU cores). Output: $1 (default bench_out/kvlink_adapter/).
# The data file's sha256 equals the shipped kvlink.json's "data_sha256".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
OUT="${1:-bench_out/kvlink_adapter}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
# Training data: 480 synthetic items of seed 1000 (the benchmark uses seed 0, the tests seed 7),
# six passages of 200 tokens each, in the MuSiQue format.
.venv/bin/python - "$OUT/train.json" <<'PY'
import json, sys
from kvrag.bench import synthetic
from kvrag.model import default_tokenizer

tok = default_tokenizer()
items = synthetic.generate(480, 1000, count_tokens=lambda s: len(tok.encode(s, add_special_tokens=False)))
with open(sys.argv[1], "w") as f:
    json.dump(items, f)
PY
sha256sum "$OUT/train.json"
exec .venv/bin/kvrag train kvlink --data "$OUT/train.json" --lora-rank 8 --lr 0.0005 --objective distill \
    --docs 5 --max-passage-chars 1000 --link-lr 0.005 --steps 480 --max-minutes 62 --threads 2 --out "$OUT/adapter" --force \
    --log-every 10
