"""SamKV on the real SmolLM2 model."""

import pytest


@pytest.mark.real
def test_real_model_samkv(tmp_path):
    from kvrag.engine import KVRag
    from kvrag.layout.prompt import rag_messages

    passages = [
        "Mount Kilimanjaro is a dormant volcano in Tanzania. It has three volcanic cones: Kibo, "
        "Mawenzi and Shira. At 5,895 metres above sea level it is the highest mountain in Africa "
        "and the highest single free-standing mountain in the world. The first recorded ascent "
        "to the summit was made by Hans Meyer and Ludwig Purtscheller in 1889.",
        "The Nile is a major north-flowing river in northeastern Africa. It flows into the "
        "Mediterranean Sea. The Nile is among the longest rivers in the world, with a length of "
        "about 6,650 kilometres, and its drainage basin covers eleven countries.",
        "Lake Victoria is one of the African Great Lakes. With a surface area of about 59,947 "
        "square kilometres it is Africa's largest lake by area and the world's largest tropical "
        "lake. It is shared by Tanzania, Uganda and Kenya.",
    ]
    rag = KVRag(cache_dir=tmp_path / "kv", policy="samkv", block_size=4)
    rag.precompute(passages)
    msgs = rag_messages(passages, "What is the highest mountain in Africa?")
    kw = dict(max_new_tokens=8)
    full = rag.generate(msgs, policy="full_prefill", **kw)
    out = rag.generate(msgs, keep_ratio=0.3, **kw)
    assert out.text.strip()
    st = out.stats
    assert st.chunks_hit == 3 and st.cached_tokens > 0
    kept_cached = st.kept_tokens - st.computed_tokens - st.prefix_tokens
    assert 0 < kept_cached <= 0.3 * st.cached_tokens + 1
    assert st.policy_stats["samkv.kept_fraction"] <= 0.31
    # The exact limit reproduces full prefill's answer.
    exact = rag.generate(msgs, keep_ratio=1.0, recompute_ratio=1.0, adaptive_p=False, update="overwrite", **kw)
    assert exact.token_ids == full.token_ids
