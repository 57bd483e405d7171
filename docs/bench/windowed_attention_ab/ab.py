"""A/B/C in one process on long-yardstick items, Gemma 3 270M: 'start' = 9550817 (attention
check over every key, windowed layers read keys from 0), 'bad199b' (check reads the keys its
rows see; windowed groups = the causal plan's groups starting at their window), 'now' (rows cut
into groups where they span a window)."""
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import kvrag.policies.cacheblend as cb
from kvrag import KVRag
from kvrag.bench.examples import load_examples
from kvrag.layout.prompt import rag_prompt
from kvrag.query.fusion import _Rows

torch.set_num_threads(2)
REPO = str(pathlib.Path(__file__).resolve().parents[3])
TMP = tempfile.mkdtemp(prefix="kvrag-ab-")
src = subprocess.check_output(["git", "-C", REPO, "show", "9550817:kvrag/policies/cacheblend.py"], text=True)
ns = {"torch": torch, "SCORE_BUDGET": cb.SCORE_BUDGET}
exec(src[src.index("def attention_deviation(") : src.index("@register")], ns)
old_fusion = pathlib.Path(TMP) / "fusion_bad199b.py"
old_fusion.write_text(subprocess.check_output(["git", "-C", REPO, "show", "bad199b:kvrag/query/fusion.py"], text=True))
spec = importlib.util.spec_from_file_location("fusion_bad199b", old_fusion)
old = importlib.util.module_from_spec(spec); sys.modules["fusion_bad199b"] = old; spec.loader.exec_module(old)
new_dev, new_win = cb.attention_deviation, _Rows.windowed
VARIANTS = {"start": (ns["attention_deviation"], lambda self, a, w: None), "bad199b": (new_dev, old._Rows.windowed), "now": (new_dev, new_win)}
def setv(v):
    cb.attention_deviation, _Rows.windowed = VARIANTS[v]
settings = {"kvlink@0.1 att": dict(policy="kvlink", recompute_ratio=0.1, deviation="attention"),
            "kvlink@0.05 att": dict(policy="kvlink", recompute_ratio=0.05, deviation="attention"),
            "links alone": dict(policy="kvlink"), "epic": dict(policy="epic"), "naive_reuse": dict(policy="naive_reuse")}
data, n_items, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
exs = load_examples(data)[:n_items]
rag = KVRag("gemma3-270m", cache_dir=f"{TMP}/kv", hot_cache=0)
T = {f"{s} {v}": [] for s in settings for v in VARIANTS}; T["full_prefill"] = []
for ex in exs:
    rag.precompute(ex.passages)
    msgs = rag_prompt(rag.tokenizer, ex.passages, ex.question)
    t = time.perf_counter(); rag.prefill(msgs, policy="full_prefill"); T["full_prefill"].append(time.perf_counter() - t)
    diffs = {}
    for s, kw in settings.items():
        per = {v: [] for v in VARIANTS}; lg = {}
        order = list(VARIANTS)
        for rep in range(reps):
            for v in (order if rep % 2 == 0 else order[::-1]):
                setv(v)
                t = time.perf_counter(); out = rag.prefill(msgs, **kw); per[v].append(time.perf_counter() - t)
                lg[v] = out.logits
        for v in per:
            T[f"{s} {v}"].append(statistics.median(per[v]))
        diffs[s] = max(float((lg["start"] - lg[v]).abs().max()) for v in VARIANTS)
        diffs[s + " argmax same"] = len({int(x.argmax()) for x in lg.values()}) == 1
    print(json.dumps({"id": ex.id, "full": round(T["full_prefill"][-1], 3), **{k: round(v[-1], 3) for k, v in T.items() if k != "full_prefill"}, "maxdiff": diffs}), flush=True)
print("MEDIAN TTFT s", json.dumps({k: round(statistics.median(v), 3) for k, v in T.items()}))
print("SPEEDUP vs full (median per item)", json.dumps({k: round(statistics.median(f / x for f, x in zip(T["full_prefill"], v)), 2) for k, v in T.items()}))
