"""Every policy's TTFT beside its floor, by where the chunks are served from, at model shapes
too large to save and load inside a short device lease.

The model is a random-weight Llama of Llama-3-8B's shape (32 layers, 8 KV heads of 128) or
Llama-3.2-1B's (16 layers, 8 KV heads of 64), bfloat16, with SmolLM2's tokenizer, built where
it runs (``torch.device`` context: its weights are allocated and initialised there, never on
the CPU first). Random weights make the timing real and the answers meaningless.

Tiers (where a chunk's K/V waits between queries):

* ``device``: the hot tier on the compute device (``KVRag(hot_tier="device")``);
* ``host``: the hot tier in page-locked host RAM, copied to the GPU at each query
  (``KVRag(hot_tier="host")``);
* ``disk``: the store on local disk, every run reading it cold: the OS page cache is dropped
  before each timed run (``/proc/sys/vm/drop_caches`` as root, else ``posix_fadvise`` of the
  store's files; the ``page_cache`` column says which worked).

Each (shape, point, tier) is ``kvrag.bench.floor.measure_floor``: ``full_prefill`` first, the
policies interleaved round by round, TTFT beside the floor (chunk reads + move to the device +
``transformers``' forward of the non-cached tokens + recompute at ``full_prefill``'s rate), and
the work-doing ops and host syncs of one fused prefill and one decode step (once per point).
``--compile`` is ``KVRag(compile=...)`` (``auto``: on a GPU, the fused prefill's computed rows
and the decode step compiled, their graphs built in the untimed first round); the ``compile``
column says whether the prefill's were. ``--storage-dtype`` stores the chunks in another format
than the compute dtype (a packed one, ``int8``/``int4``: read as codes and scales, expanded on
the device as placed); the ``storage`` column says which. Every record is appended to
``OUT/floor.csv`` as it is measured and ``OUT/floor.md`` is
rewritten, so a run cut off keeps what it measured; ``--deadline-s`` skips what would start
after it. ``OUT/profile_<shape>.txt``: the device-time profile of a fused prefill per policy.

    python benchmarks/gpu_floor.py OUT --shapes llama8b,llama1b --points 32x512,16x512,64x512,8x512
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrag import KVRag  # noqa: E402
from kvrag.arch import GQA_MASKED  # noqa: E402
from kvrag.bench.config import Run  # noqa: E402
from kvrag.bench.examples import examples_from_items  # noqa: E402
from kvrag.bench.floor import FLOOR_FIELDS, measure_floor  # noqa: E402
from kvrag.defaults import COMPILE_CHOICES, STORAGE_DTYPES  # noqa: E402
from kvrag.layout.prompt import rag_prompt  # noqa: E402
from kvrag.model import ModelHandle  # noqa: E402
from kvrag.qa import synthetic  # noqa: E402
from kvrag.testing import TINY_DIMS, smollm2_tokenizer  # noqa: E402

SHAPES = {
    "llama8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
    ),
    "llama1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
    ),
    # A rehearsal of this script on a CPU: the tests' tiny model.
    "tiny": dict(TINY_DIMS, rope_theta=10000.0),
}
TIERS = ("device", "host", "disk")
#: cacheblend at the 15% recompute its paper's speed figures use.
POLICIES = "naive_reuse,cacheblend@0.15,a3,epic,kvlink,samkv,a2ats,prophetkv"
FIELDS = ["shape", "storage", "compile", "tier", "page_cache", "params", *FLOOR_FIELDS]


def build(shape: str, device: str, dtype: torch.dtype) -> ModelHandle:
    """A random-weight Llama of ``shape`` made on ``device`` in ``dtype``."""
    tok = smollm2_tokenizer()
    dims = dict(SHAPES[shape])
    theta = dims.pop("rope_theta")
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        **dims,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return ModelHandle(model, tok, weight_digest=f"random-llama-{shape}-seed0")


def drop_page_cache(store_dir: Path) -> str:
    """Evict the store's files from the OS page cache: "dropped" (all of it, as root),
    "fadvise" (the store's files, per file) or "kept" (neither worked: reads are warm)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError:
        pass
    if not hasattr(os, "posix_fadvise"):
        return "kept"
    for root, _, files in os.walk(store_dir):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def compiled_rows(rag: KVRag) -> str:
    """Whether ``rag``'s fused prefill compiles the computed rows of the policies that
    compute fixed rows: "on", "off" or "failed: <why>" (the eager loop then ran)."""
    rows = rag.fusion.compiled
    if rows is None:
        return "off"
    return "on" if rows.failed is None else f"failed: {rows.failed}"


def runs_of(spec: str) -> list[Run]:
    """``policy[@ratio],...`` -> runs, ``full_prefill`` (the reference) first."""
    runs = [Run("full_prefill")]
    for name in filter(None, (s.strip() for s in spec.split(","))):
        policy, _, ratio = name.partition("@")
        if name == "full_prefill":
            continue  # the reference, already first
        runs.append(Run(policy, {"recompute_ratio": float(ratio)} if ratio else {}))
    return runs


def point(s: str) -> tuple[int, int]:
    n, _, t = s.partition("x")
    return int(n), int(t)


def table(records: list[dict]) -> str:
    """One markdown table per shape: a row per (point, tier), a column per policy with its
    TTFT, speed-up over full_prefill and TTFT over floor."""
    out = []
    for shape, storage in dict.fromkeys((r["shape"], r.get("storage")) for r in records):
        rows = [r for r in records if (r["shape"], r.get("storage")) == (shape, storage)]
        labels = list(dict.fromkeys(r["label"] for r in rows))
        out += [
            f"### {shape}" + (f", chunks stored as {storage}" if storage else ""),
            "",
            "| point | prompt tokens | tier | " + " | ".join(labels) + " |",
            "|---" * (3 + len(labels)) + "|",
        ]
        for key in dict.fromkeys((r["dataset"], r["tier"]) for r in rows):
            group = {r["label"]: r for r in rows if (r["dataset"], r["tier"]) == key}
            ref = group.get("full_prefill", {}).get("ttft_s")
            cells = []
            for lab in labels:
                r = group.get(lab)
                if r is None or r.get("ttft_s") is None:
                    cells.append("error" if r and r.get("error") else "")
                    continue
                cell = f"{r['ttft_s']:.3f} s"
                if ref and lab != "full_prefill":
                    cell += f" ({ref / r['ttft_s']:.2f}x"
                    cell += f", {r['ttft_over_floor']:.2f} floor)" if r.get("ttft_over_floor") else ")"
                cells.append(cell)
            toks = next((r.get("prompt_tokens") for r in group.values() if r.get("prompt_tokens")), "")
            tier = key[1] + (f" ({group['full_prefill']['page_cache']})" if key[1] == "disk" else "")
            out.append(f"| {key[0]} | {toks} | {tier} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def profile(rag: KVRag, prompt, runs: list[Run], path: Path, device: str) -> None:
    """The costliest ops of one fused prefill per policy (device time on CUDA), into ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with open(path, "w") as f:
        for run in runs:
            rag.prefill(prompt, run.policy, **run.params)  # warm
            with torch_profile(activities=acts) as p:
                rag.prefill(prompt, run.policy, **run.params)
                if cuda:
                    torch.cuda.synchronize()
            key = "device_time_total" if cuda else "cpu_time_total"
            f.write(f"## {run.label}\n{p.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=55)}\n")


class Sweep:
    """The records of one run of this script, the CSV and table they are written to as they
    come, and the clock its deadlines are read against."""

    def __init__(self, args, runs: list[Run], tiers: list[str]):
        self.args, self.runs, self.tiers = args, runs, tiers
        self.t0 = time.monotonic()
        self.deadlines = [float(d) for d in args.deadline_s.split(",")]
        self.deadline = self.deadlines[0]
        self.profile_point = args.profile_point or args.points.split(",")[0]
        self.profiled = False  # one profile a run: of the first shape that reaches the point
        self.csv = args.out / "floor.csv"
        self.records: list[dict] = []
        if self.csv.exists():  # a second run into the same folder adds to it
            with open(self.csv) as f:
                self.records = list(csv.DictReader(f))
            for r in self.records:
                for k in ("ttft_s", "ttft_over_floor"):
                    r[k] = float(r[k]) if r.get(k) else None

    def late(self, what: str) -> bool:
        if time.monotonic() - self.t0 > self.deadline:
            print(f"deadline: {what} skipped", flush=True)
            return True
        return False

    def keep(self, recs: list[dict]) -> None:
        self.records += recs
        new = not self.csv.exists()
        with open(self.csv, "a", newline="") as f:
            w = csv.DictWriter(f, FIELDS, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerows(recs)
        (self.args.out / "floor.md").write_text(table(self.records))

    def shape(self, shape: str) -> None:
        args = self.args
        tb = time.monotonic()
        handle = build(shape, args.device, getattr(torch, args.dtype))
        n_params = sum(p.numel() for p in handle.model.parameters())
        if args.gqa_masked != "auto":
            handle.arch.gqa_masked = args.gqa_masked
        print(
            f"{shape}: {n_params / 1e9:.2f} B parameters built in {time.monotonic() - tb:.1f} s, "
            f"grouped heads under a mask: {args.gqa_masked}",
            flush=True,
        )
        policies = [r.policy for r in self.runs]
        rags = {
            tier: KVRag(
                handle,
                cache_dir=args.out / f"kv_{shape}",
                policy="full_prefill",
                kvlink_adapter=None,
                ingest_policies=policies,
                storage_dtype=args.storage_dtype or args.dtype,
                compile=args.compile,
                hot_cache=0 if tier == "disk" else "auto",
                hot_tier="host" if tier == "host" else "device",
                size_limit=48 << 30,
            )
            for tier in self.tiers
        }
        if "a2ats" in policies:
            from kvrag.policies.a2ats import calibrate as cal

            tc = time.monotonic()
            cal.calibrate(handle, n_tokens=4096)
            print(f"  a2ats codebooks fitted in {time.monotonic() - tc:.1f} s (untimed)", flush=True)
        for n, t in (point(p) for p in args.points.split(",")):
            if self.late(f"{shape} {n}x{t}"):
                continue
            item = synthetic.exact_length_item(n, t, handle.encode, handle.tokenizer.decode, seed=0)
            ex = examples_from_items([item], source="floor")[0]
            prompt = rag_prompt(handle.tokenizer, ex.passages, ex.question)
            tp = time.monotonic()
            for rag in rags.values():
                rag.precompute(ex.passages)
            print(f"  {n}x{t}: {n} chunks precomputed in {time.monotonic() - tp:.1f} s", flush=True)
            for t_i, tier in enumerate(self.tiers):
                if self.late(f"{shape} {n}x{t} {tier}"):
                    continue
                try:
                    self.tier(shape, n, t, tier, rags[tier], prompt, count_ops=t_i == 0)
                except Exception as e:  # noqa: BLE001 - out of memory at one point, say: go on
                    print(f"    {tier}: FAILED {type(e).__name__}: {e}", flush=True)
            if not self.profiled and f"{n}x{t}" == self.profile_point and "device" in rags and not self.late("profile"):
                self.profiled = True
                try:
                    profile(rags["device"], prompt, self.runs[:3], args.out / f"profile_{shape}.txt", args.device)
                except Exception as e:  # noqa: BLE001 - the figures above matter more than the profile
                    print(f"  profile failed: {type(e).__name__}: {e}", flush=True)

    def tier(self, shape: str, n: int, t: int, tier: str, rag: KVRag, prompt, count_ops: bool) -> None:
        cache_state = {"page_cache": "warm"}
        before = None
        if tier == "disk":

            def before():
                cache_state["page_cache"] = drop_page_cache(rag.cache_dir)

        else:
            rag.pieces(rag.render(prompt))  # the chunks enter the hot tier, untimed
        tt = time.monotonic()
        runs = self.runs
        recs = measure_floor(
            lambda run: rag,
            prompt,
            runs,
            self.args.repeats,
            f"{n}x{t}",
            self.args.device,
            cold=tier == "disk",
            before_run=before,
            count_ops=count_ops,
        )
        for r in recs:
            params = next(run.params for run in runs if run.label == r["label"])
            r.update(
                shape=shape,
                storage=self.args.storage_dtype or self.args.dtype,
                compile=compiled_rows(rag),
                tier=tier,
                page_cache=cache_state["page_cache"],
                params=params,
            )
            # A run that found fewer chunks than the prompt holds measured something else.
            if r.get("chunks") is not None and r["policy"] != "full_prefill" and int(r["chunks"]) < n:
                r["error"] = (r.get("error") or "") + f" only {r['chunks']} of {n} chunks served"
        self.keep(recs)
        ref = recs[0].get("ttft_s")
        print(
            f"    {tier:6s} ({time.monotonic() - tt:.0f} s): "
            + "  ".join(
                f"{r['label']} {r['ttft_s']:.3f}s"
                + (f" {ref / r['ttft_s']:.1f}x" if ref and r["label"] != "full_prefill" else "")
                + (f" /floor {r['ttft_over_floor']:.2f}" if r.get("ttft_over_floor") else "")
                + (f" ERR {r['error']}" if r.get("error") else "")
                if r.get("ttft_s")
                else f"{r['label']} ERR {r.get('error')}"
                for r in recs
            ),
            flush=True,
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shapes", default="llama8b,llama1b")
    ap.add_argument("--points", default="32x512,16x512,64x512,8x512", help="chunks x tokens per chunk, in order")
    ap.add_argument("--tiers", default=",".join(TIERS))
    ap.add_argument("--policies", default=POLICIES, help="policy[@recompute_ratio],... (full_prefill comes first)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=os.environ.get("KVRAG_DEVICE", "cuda"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--compile",
        default="auto",
        choices=COMPILE_CHOICES,
        help="KVRag(compile=...): the fused prefill's computed rows and the decode step compiled (auto: on a GPU)",
    )
    ap.add_argument(
        "--storage-dtype",
        default=None,
        choices=STORAGE_DTYPES,
        help="the format chunks are stored in (default: the compute dtype)",
    )
    ap.add_argument(
        "--deadline-s",
        default="inf",
        help="start nothing after this many seconds from the start; a comma list: one per shape (the last repeats)",
    )
    ap.add_argument(
        "--gqa-masked",
        default="auto",
        choices=("auto", *GQA_MASKED),
        help="how masked attention meets grouped-query heads (kvrag.arch.Arch.gqa_masked; auto: the engine's choice)",
    )
    ap.add_argument(
        "--profile-point", default=None, help="the point profiled (device tier, first shape run; default: the first)"
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tiers = [t for t in args.tiers.split(",") if t]
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        raise SystemExit(f"unknown tier(s) {bad}: choose from {', '.join(TIERS)}")
    sweep = Sweep(args, runs_of(args.policies), tiers)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}", flush=True)
    if args.device.startswith("cuda"):
        print(torch.cuda.get_device_name(0), flush=True)
    for s_i, shape in enumerate(args.shapes.split(",")):
        sweep.deadline = sweep.deadlines[min(s_i, len(sweep.deadlines) - 1)]
        if sweep.late(shape):
            continue
        try:
            sweep.shape(shape)
        except Exception as e:  # noqa: BLE001 - the next shape may still fit
            print(f"{shape}: FAILED {type(e).__name__}: {e}", flush=True)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"done in {time.monotonic() - sweep.t0:.0f} s", flush=True)
    print(table(sweep.records))


if __name__ == "__main__":
    main()
