"""The markdown report of a benchmark run (``docs/benchmarks.md`` for the default run): how it
was run, the targets marked PASS/FAIL, the results per device with their plots, the precompute
throughput and KV footprint, and what each metric means."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvrag.bench.config import REFERENCE
from kvrag.bench.tables import by_type_table, floor_section, fmt, fmt_ms, md_table, policy_table
from kvrag.bench.targets import qa_datasets, summary_row


def render_markdown(result: dict, files: dict, report_path: Path, assets: Path) -> str:
    meta, summary, records = result["meta"], result["summary"], result["records"]
    m, cfg = meta["machine"], meta["config"]
    rel = lambda p: os.path.relpath(assets / Path(p).name, report_path.parent)  # noqa: E731
    L = []
    L.append("# kvrag benchmarks\n")
    L.append("*Written by `kvrag bench`; rerun the command below to regenerate this page, its plots and CSVs.*\n")
    L.append("## How this was run\n")
    L.append("```\n" + meta["command"] + "\n```\n")
    L.append(
        f"- started {meta['started']}, wall time **{meta['wall_s'] / 60:.1f} min**"
        f" (git commit `{(meta.get('git_commit') or 'unknown')[:12]}`)"
    )
    L.append(
        f"- machine: {m['cpu']}, {m['cores']} cores available, torch threads {m['torch_threads']}, "
        f"{m.get('memory_gib')} GiB RAM; {m['platform']}; Python {m['python']}, torch {m['torch']}, "
        f"transformers {m['transformers']}" + (f"; GPU {m['gpu']}" if m.get("gpu") else "")
    )
    mi = meta.get("model", {})
    L.append(
        f"- model: {mi.get('name')} (fingerprint `{mi.get('fingerprint')}`, {mi.get('layers')} layers, "
        f"{mi.get('kv_heads')} KV heads), compute {mi.get('dtype')}, KV stored as {mi.get('storage_dtype')}"
    )
    L.append(
        f"- devices: {', '.join(cfg['devices'])}; greedy decoding, at most {cfg['max_new_tokens']} new tokens, "
        f"stop at newline; TTFT repeats per example: {cfg['repeats']} (rotated policy order, after one untimed "
        "warm-up run of every policy)"
    )
    anchor = mi.get("chunk_anchor")
    behind = (
        f"behind the anchor token(s) {anchor} (the model's attention sink, dropped after)"
        if anchor
        else "alone from position 0 (no anchor)"
    )
    L.append(
        "- prompt: the model's chat template, system = fixed instruction, user = passages + question "
        "(`kvrag.layout.prompt.rag_prompt`; the same as plain text for a model without a chat template); "
        f"each passage precomputed as one chunk, {behind}, before timing\n"
    )
    ad = mi.get("kvlink_adapter")
    if ad:
        L.append(
            f"- `kvlink` runs **trained** with the KVLink adapter `{ad.get('path')}` ({ad.get('link_tokens')} link "
            f"tokens, {ad.get('steps')} training steps, "
            + (
                "LoRA weights: a model of its own with its own chunk caches; the reference and every other "
                "policy run on the base model"
                if ad.get("lora")
                else "link embeddings only, base weights"
            )
            + "); `kvlink(mode=untrained)` beside it is the same policy without the adapter\n"
        )
    for err in meta.get("errors", []):
        L.append(f"- **scenario failed**: {err}")

    L.append("## Targets\n")
    target_rows = [
        [
            t["where"],
            f"`{t['policy']}`",
            t["metric"],
            t["target"],
            # 3 significant digits: a value just inside a threshold must not print as on it
            (fmt(t["measured"], ".1%") if "gap" in t["metric"] else fmt(t["measured"], ".3g"))
            + (f" ({t['detail']})" if t.get("detail") else ""),
            fmt(t.get("prompt_tokens"), ".0f"),
            f"**{t['status']}**",
        ]
        for t in result["targets"]
    ]
    L.append(md_table(["where", "policy", "metric", "target", "measured", "prompt tokens", "status"], target_rows))
    L.append(
        "\nSpeed-ups are the median over examples of full_prefill's TTFT divided by the policy's, both "
        'measured on the same prompt in the same run. "LL gap" is |mean gold log-likelihood per token − '
        "full_prefill's| / |full_prefill's|. Targets are stated for 2 CPU cores; "
        f"this run had {m['cores']} cores.\n"
    )

    for device in cfg["devices"]:
        tag = device.replace(":", "")
        L.append(f"## Results on {device}\n")
        for ds in qa_datasets(summary, device):
            rows = [r for r in summary if r["device"] == device and r["scenario"] == "qa" and r["dataset"] == ds]
            L.append(
                f"### QA: {ds} ({rows[0]['n']} examples, ~{fmt(rows[0].get('prompt_tokens'), '.0f')} prompt tokens)\n"
            )
            L.append(policy_table(rows) + "\n")
            bt = by_type_table(records, device, ds)
            if bt:
                L.append(
                    "By question type (cross_passage needs a passage's subject named in *another* passage, "
                    "the case reuse loses):\n"
                )
                L.append(bt + "\n")
                single_hop = [
                    r
                    for r in records
                    if r["device"] == device
                    and r["dataset"] == ds
                    and r["scenario"] == "qa"
                    and r["policy"] == REFERENCE
                    and r["qtype"] == "single_hop"
                    and not r.get("error")
                ]
                if single_hop:
                    ok = sum(r.get("gold_acc") == 1.0 or r["gold_em"] == 1.0 for r in single_hop)
                    L.append(
                        f"`full_prefill` answers **{ok}/{len(single_hop)}** of these single-hop items "
                        "(gold answer contained in its answer).\n"
                    )
                chk = result.get("single_hop_check") or {}
                if ds == "synthetic" and chk.get("device") == device and chk.get("items"):
                    L.append(
                        f"Check of the generator: `full_prefill` answers **{chk['answered']}/{chk['items']}** "
                        f"({chk['answered'] / chk['items']:.0%}) single-hop items of their own seed "
                        f"({chk['seed']}; {chk['passages']} passages x {chk['passage_tokens']} tokens, gold answer "
                        "contained in its answer).\n"
                    )
            key = f"plot_qa_{ds}_{tag}"
            if key in files:
                L.append(f"![speed vs fidelity, {ds}]({rel(files[key])})\n")
        sc = [r for r in summary if r["device"] == device and r["scenario"] == "scaling"]
        if sc:
            L.append("### TTFT vs context length\n")
            L.append("Synthetic passages of exactly the stated token length (tokenized alone), one question.\n")
            pts = list(dict.fromkeys(r["dataset"] for r in sc))
            labels = list(dict.fromkeys(r["label"] for r in sc))
            heads = ["policy"] + [
                f"{p} ({fmt(summary_row(summary, device, 'scaling', p, REFERENCE)['prompt_tokens'], '.0f')} tok)"
                if summary_row(summary, device, "scaling", p, REFERENCE)
                else p
                for p in pts
            ]
            body = []
            for lab in labels:
                cells = [f"`{lab}`"]
                for p in pts:
                    r = summary_row(summary, device, "scaling", p, lab)
                    cells.append(
                        "–"
                        if not r or not r.get("ttft_s")
                        else f"{fmt_ms(r['ttft_s'])} ms ({fmt(r.get('speedup'), '.1f')}x)"
                    )
                body.append(cells)
            L.append(md_table(heads, body) + "\n")
            if f"plot_scaling_{tag}" in files:
                L.append(f"![TTFT vs context length]({rel(files[f'plot_scaling_{tag}'])})\n")
        fl = [r for r in result.get("floor") or [] if r["device"] == device]
        if fl:
            L.append(floor_section(fl))
        sw = [r for r in summary if r["device"] == device and r["scenario"] == "sweep"]
        if sw:
            L.append(f"### Quality vs recompute ratio ({sw[0]['dataset']}, {sw[0]['n']} examples)\n")
            L.append(policy_table(sw) + "\n")
            if f"plot_sweep_{tag}" in files:
                L.append(f"![quality vs recompute ratio]({rel(files[f'plot_sweep_{tag}'])})\n")

    L.append("## Precompute throughput and KV footprint\n")
    for d, t in result.get("throughput", {}).items():
        L.append(
            f"- {d}: precompute {fmt(t.get('precompute_tok_per_s'), '.0f')} tokens/s "
            f"({t['precompute_tokens']} tokens in {t['precompute_s']:.1f} s, chunks packed, ingest extras "
            f"included) vs plain prefill {fmt(t.get('prefill_tok_per_s'), '.0f')} tokens/s "
            f"(full_prefill TTFT on the QA prompts): ratio {fmt(t.get('ratio'))}"
        )
    fp = result.get("footprint") or {}
    if fp:
        L.append(
            f"\nKV on disk per 1k tokens (measured on {fp['tokens']} tokens of passages; bound = "
            f"2 × {fp['layers']} layers × {fp['kv_heads']} KV heads × {fp['head_dim']} dims × bytes × 1000):\n"
        )
        footprint_rows = [
            [
                dt,
                f"{fp[dt]['bytes_per_1k'] / 2**20:.2f} MiB",
                f"{fp[dt]['blob_bytes_per_1k'] / 2**20:.2f} MiB",
                f"{fp[dt]['bound_per_1k'] / 2**20:.2f} MiB",
                f"{fp[dt]['ratio']:.3f}",
            ]
            for dt in ("float32", "float16")
            if dt in fp
        ]
        L.append(
            md_table(
                [
                    "storage dtype",
                    "directory bytes / 1k tok",
                    "blob bytes / 1k tok",
                    "bound / 1k tok",
                    "measured / bound",
                ],
                footprint_rows,
            )
            + "\n"
        )

    L.append("## Metrics\n")
    L.append(
        "- **TTFT**: from the `generate` call to the first sampled token (segmentation, cache loads, fused "
        "prefill); median over repeats, *spread* = (max − min) / median over repeats (median over examples)."
    )
    L.append("- **ms/token**: decode time after the first token / (new tokens − 1).")
    L.append(
        "- **gold F1 / EM**: SQuAD/LongBench normalisation (lower-case, no punctuation, no articles), token F1, "
        "max over gold answers. **gold acc**: 1 if a gold answer occurs in the answer as whole words (the "
        "accuracy of *Lost in the Middle*), the QA score of the QA targets, since SmolLM2 answers in whole "
        "sentences. **fidelity F1 / EM**: the same as gold F1 / EM, against full_prefill's answer on the same prompt."
    )
    L.append(
        "- **gold NLL/tok**: −mean log-probability per token of the first gold answer, teacher-forced after the "
        "prompt (`KVRag.continuation_logits`); **ΔNLL** vs full_prefill on the same example."
    )
    L.append(
        f"- **top-1 / KL**: full_prefill's answer is teacher-forced under every policy; over its first "
        f"{cfg['kl_positions']} positions, the share of positions with the same argmax and the mean "
        "KL(full_prefill ‖ policy) in nats."
    )
    L.append(
        "- **cached / recomputed / kept**: FusionStats means: tokens served from cache, cached tokens still "
        "computed at the last layer, tokens kept in the final KV cache; *recomp. frac* = computed (token, layer) "
        "pairs of cached tokens over all of them. **peak MB**: process RSS peak during a run (CPU), "
        "`torch.cuda.max_memory_allocated` (CUDA)."
    )
    L.append(
        "\nRaw data: `results.json` (one record per example × policy), `summary.csv`, `records.csv`, "
        "`scaling.csv`, `sweep.csv`, `floor.csv` in the output directory.\n"
    )
    return "\n".join(L)


def write_report(result: dict, files: dict, report_path: Path) -> Path:
    """Markdown report at ``report_path``; plots/CSVs are copied next to it (``<stem>/``)
    when it lives outside the output directory, so the page's links work where it is."""
    report_path = Path(report_path)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    out_dir = Path(files["results"]).parent
    if report_path.parent.resolve() == out_dir.resolve():
        assets = out_dir
    else:
        assets = report_path.parent / "bench"
        assets.mkdir(parents=True, exist_ok=True)
        for k, p in files.items():
            if k.startswith("plot_") or k.endswith("_csv"):
                shutil.copy2(p, assets / Path(p).name)
    report_path.write_text(render_markdown(result, files, report_path, assets), encoding="utf-8")
    return report_path
