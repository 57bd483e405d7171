"""Full prefill two ways: the model's own forward (kvrag's ``full_prefill``, the baseline every
speed-up is measured against) and kvrag's layer loop with every token computed (the fusion
engine over a prompt with nothing cached, which on a sliding-window layer reads only the keys
each row group's window holds). Both give the same next token; the forward reads every key
on a windowed layer, masked. The ratio says how much a baseline that windows its attention
would shrink the reported speed-ups.

    .venv/bin/python benchmarks/full_prefill_loop_ab.py bench_out/yardstick_long/yardstick_12x180.json \\
        --model gemma3-270m --limit 3

Per item: both logits' largest difference, whether the next token agrees, and the median of
``--rounds`` timings of each (the order alternating), then the median ratio over the items.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from kvrag import KVRag
from kvrag.bench.examples import load_examples
from kvrag.layout.prompt import rag_prompt
from kvrag.layout.state import Layout, Piece
from kvrag.policies import get_policy


def seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="a QA file kvrag bench reads (e.g. the yardstick's)")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as store:
        rag = KVRag(args.model, cache_dir=store, hot_cache=0, policy="full_prefill")
        # With nothing cached every token is computed at every layer: no reuse, only the loop.
        every_token = get_policy("naive_reuse")
        ratios = []
        for ex in load_examples(args.data, limit=args.limit):
            text = rag.render(rag_prompt(rag.tokenizer, ex.passages, ex.question))
            own = rag.prefill(text, "full_prefill")
            layout = Layout.build([Piece(torch.tensor(own.prompt_ids))])

            def forward(text=text):
                return rag.prefill(text, "full_prefill").logits

            def loop(layout=layout):
                return rag.fusion.prefill(layout, every_token).logits

            a, b = forward(), loop()
            times: dict = {forward: [], loop: []}
            for r in range(args.rounds):
                for fn in (forward, loop) if r % 2 == 0 else (loop, forward):
                    times[fn].append(seconds(fn))
            t_own, t_loop = statistics.median(times[forward]), statistics.median(times[loop])
            ratios.append(t_own / t_loop)
            print(
                f"{len(own.prompt_ids)} tokens: own forward {t_own:.2f} s, layer loop {t_loop:.2f} s "
                f"({t_own / t_loop:.2f}x); logits differ by {float((a - b).abs().max()):.1e}, "
                f"same next token: {int(a.argmax()) == int(b.argmax())}",
                flush=True,
            )
        print(f"median: the layer loop is {statistics.median(ratios):.2f}x the model's own forward")


if __name__ == "__main__":
    main()
