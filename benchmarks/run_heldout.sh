#!/usr/bin/env bash
# The held-out QA measurement: every reuse policy, and kvlink with an adapter, on the
# 100 MuSiQue items of ../shared/data (a source the adapter being judged was NOT trained on:
# train it without --musique / --qa on that file), 7 passages each (~3.9k prompt tokens),
# gold-answer containment, gold log-likelihood and KL to full_prefill, one timed run each.
# Resumable: rerun the same command after an interruption (the journal in OUT keeps every
# finished example, and OUT/kv the chunks precomputed). ~35 s an example on 2 CPU cores.
#
# Usage: benchmarks/run_heldout.sh OUT [ADAPTER] [extra kvrag bench options]
#   ADAPTER: default (the shipped adapter), none, or an adapter directory (kvrag tune --out).
# Env: KVRAG_HELDOUT_DATA (another QA file, e.g. benchmarks/cloze_set.py output), _LIMIT, _POLICIES.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${1:?usage: run_heldout.sh OUT [ADAPTER] [options]}"
ADAPTER="${2:-default}"
shift $(( $# >= 2 ? 2 : 1 ))
DATA="${KVRAG_HELDOUT_DATA:-../shared/data/musique_dev.json}"
bash scripts/setup.sh
exec env HF_HUB_OFFLINE=1 .venv/bin/kvrag bench --data "$DATA" --passages 7 --limit "${KVRAG_HELDOUT_LIMIT:-100}" \
    --policies "${KVRAG_HELDOUT_POLICIES:-full_prefill,naive_reuse,epic,cacheblend,samkv,kvlink}" \
    --kvlink-adapter "$ADAPTER" --repeats 1 --max-new-tokens 24 --scaling none --sweep-policies none \
    --check-items 0 --no-footprint --resume --cache-dir "$OUT/kv" --out "$OUT" "$@"
