"""The serving scheduler on the real SmolLM2-135M-Instruct (marked ``real``): concurrent chat
requests under several policies, decoded in one batched step, answer what ``KVRag.generate``
answers alone."""

import json
from importlib import resources

import pytest

from kvrag.engine import KVRag
from kvrag.layout.prompt import rag_messages
from kvrag.serve import scheduler as sched_mod
from kvrag.serve.scheduler import GenerationRequest, Scheduler

pytestmark = pytest.mark.real


def test_concurrent_chat_requests_equal_generate(tmp_path, monkeypatch):
    corpus = json.loads(resources.files("kvrag.data").joinpath("demo_corpus.json").read_text())
    docs, questions = corpus["documents"], corpus["questions"]
    rag = KVRag(cache_dir=tmp_path / "kv")
    rag.precompute(docs[:4])
    policies = ["full_prefill", "cacheblend", "epic", "naive_reuse", "a3", "kvlink"]
    reqs = [
        GenerationRequest.of(
            rag_messages(docs[: 1 + i % 4], questions[i % len(questions)]), max_new_tokens=16, policy=p
        )
        for i, p in enumerate(policies)
    ]
    refs = [rag.generate(r.prompt, policy=r.policy, max_new_tokens=16) for r in reqs]
    sizes = []
    real_step = sched_mod.decode_step

    def spy(arch, caches, tokens, arena=None, compiled=None):
        sizes.append(len(caches))
        return real_step(arch, caches, tokens, arena, compiled)

    monkeypatch.setattr(sched_mod, "decode_step", spy)
    with Scheduler(rag, max_concurrency=8) as sched:
        fins = [t.result(timeout=600) for t in [sched.submit(r) for r in reqs]]
    assert max(sizes) == len(reqs)
    for r, ref, fin in zip(reqs, refs, fins):
        assert fin.error is None, r.policy
        assert fin.token_ids == ref.token_ids, r.policy
        assert fin.text == ref.text and fin.cached_tokens == ref.stats.read_tokens, r.policy
