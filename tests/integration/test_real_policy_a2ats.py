"""A2ATS on the real SmolLM2 model."""

import pytest

from kvrag.policies.a2ats import calibrate as cal

PASSAGES = [
    "The Nile is a major north-flowing river in northeastern Africa. It flows into the "
    "Mediterranean Sea and is about 6,650 km long.",
    "Mount Kilimanjaro is a dormant volcano in Tanzania. It is the highest mountain in Africa, "
    "rising about 5,895 metres above sea level.",
    "Lake Victoria is the largest lake in Africa by area. It is shared by Tanzania, Uganda and Kenya.",
]


@pytest.mark.real
def test_real_model_a2ats(tmp_path, isolated_home):
    from kvrag.engine import KVRag
    from kvrag.model import ModelHandle

    handle = ModelHandle.load()
    # A small, fast calibration (the CLI default is 8192 tokens x 512 codes).
    cb, _ = cal.calibrate(handle, n_tokens=2048, n_codes=128, iters=3)
    assert cb.codebook.shape == (30, 3, 128, 64)
    rag = KVRag(handle, cache_dir=tmp_path / "kv", policy="a2ats", window=16)  # stores codes (its own extras)
    rag.precompute(PASSAGES)
    messages = [
        {"role": "system", "content": "Answer the question using the passages. Be brief."},
        {"role": "user", "content": "\n\n".join(PASSAGES) + "\n\nQuestion: What is the highest mountain in Africa?"},
    ]
    kw = dict(max_new_tokens=12)
    full = rag.generate(messages, policy="full_prefill", **kw)
    out = rag.generate(messages, topk=0.05, **kw)
    assert out.text.strip() and out.stats.chunks_hit == 3 and out.stats.cached_tokens > 0
    ps = out.stats.policy_stats
    assert ps["a2ats.codes_reused"] == out.stats.cached_tokens * rag.arch.n_layers
    assert ps["a2ats.kv_read_fraction"] < 0.6
    # Exact limit: recompute everything, read every key == full prefill's answer.
    exact = rag.generate(messages, prefill="cacheblend", recompute_ratio=1.0, topk=1.0, **kw)
    assert exact.token_ids == full.token_ids
