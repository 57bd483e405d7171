"""A3 and EPIC on the real SmolLM2 model."""

import pytest

PASSAGES = [
    "The Nile is a major north-flowing river in northeastern Africa. It flows into the "
    "Mediterranean Sea and is about 6,650 km long.",
    "Mount Kilimanjaro is a dormant volcano in Tanzania. It is the highest mountain in Africa, "
    "rising about 5,895 metres above sea level.",
    "Lake Victoria is the largest lake in Africa by area. It is shared by Tanzania, Uganda and Kenya.",
]


@pytest.mark.real
def test_real_model_a3_and_epic(tmp_path):
    from kvrag.engine import KVRag

    rag = KVRag(cache_dir=tmp_path / "kv", policy="a3")
    rag.precompute(PASSAGES)
    messages = [
        {"role": "system", "content": "Answer the question using the passages. Be brief."},
        {"role": "user", "content": "\n\n".join(PASSAGES) + "\n\nQuestion: What is the highest mountain in Africa?"},
    ]
    kw = dict(max_new_tokens=8)
    full = rag.generate(messages, policy="full_prefill", **kw)
    a3 = rag.generate(messages, **kw)
    assert a3.text.strip()
    assert a3.stats.chunks_hit == 3 and a3.stats.cached_tokens > 0
    assert 0 < a3.stats.recompute_fraction < 1
    assert a3.prompt_ids == full.prompt_ids
    # The exact limits reproduce full prefill's answer.
    assert rag.generate(messages, recompute_ratio=1.0, **kw).token_ids == full.token_ids
    assert rag.generate(messages, policy="epic", k_head=10_000, **kw).token_ids == full.token_ids
    # Passages here are ~30 tokens: the default k_head=32 would recompute almost all of them.
    epic = rag.generate(messages, policy="epic", k_head=8, **kw)
    assert epic.text.strip()
    assert epic.stats.recompute_fraction == pytest.approx(8 * 3 / epic.stats.cached_tokens)
    budget = len(full.prompt_ids) // 2
    ev = rag.generate(messages, evict_budget=budget, **kw)
    assert ev.stats.kept_tokens == budget and ev.text.strip()
