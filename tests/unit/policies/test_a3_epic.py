"""A3 and EPIC policies on tiny random-weight models of every supported family.

Where a test needs "the right answer" it recomputes it independently: HF's own eager attention
weights (``output_attentions``) of the full prompt are the reference for what the question
attends to, and HF's own forward is the reference for logits and caches.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers.fusion import CONFIGS, assert_matches_hf_cache, hf_logits, pieces_for, rand_ids, tiny

from kvrag.arch import Arch
from kvrag.layout.state import Layout
from kvrag.policies import get_policy
from kvrag.policies.base import top_k_indices
from kvrag.query.decode import HFStepper, output_cache
from kvrag.query.fusion import FusionEngine

PREFIX, CHUNKS, QUESTION = 5, (20, 17, 15), 6


def build(model_type="llama", seed=0, chunks=CHUNKS, query_tokens=None):
    """A tiny model and a layout ``plain prefix | cached chunks | plain question``."""
    model = tiny(model_type, seed=seed)
    arch = Arch(model)
    g = torch.Generator().manual_seed(100 + seed)
    segs = [(rand_ids(PREFIX, g), False)] + [(rand_ids(c, g), True) for c in chunks] + [(rand_ids(QUESTION, g), False)]
    ids = [t for s, _ in segs for t in s]
    layout = Layout.build(pieces_for(arch, segs), query_tokens)
    return model, arch, layout, ids


def hf_attentions(model, ids):
    """Softmax attention weights of the full prompt per layer: [L][H, N, N] (eager kernel,
    which is the only one that returns them)."""
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True, use_cache=True)
    finally:
        model.set_attn_implementation(prev)
    return [a[0].float() for a in out.attentions], output_cache(out)


def hf_query_keys(model, ids, layer):
    """HF's own post-RoPE query [H, N, D] and key [Hkv, N, D] states entering ``layer``'s
    attention on the full prompt, its boolean mask [N, N] (causal, sliding window) and its
    scaling: captured from the attention call (with eager-style masks)."""
    import sys

    from transformers import AttentionInterface, AttentionMaskInterface

    prev = model.config._attn_implementation
    got = {}

    def capture(module, query, key, value, attention_mask, scaling=None, **kw):
        if module.layer_idx == layer:
            got.update(q=query[0].float(), k=key[0].float(), mask=attention_mask, scaling=scaling)
        # The model's own kernel (eager where it soft-caps: Gemma 2), so the layers below
        # ``layer`` compute what the model computes.
        attend = (
            AttentionInterface._global_mapping.get(prev) or sys.modules[type(module).__module__].eager_attention_forward
        )
        return attend(module, query, key, value, attention_mask, scaling=scaling, **kw)

    AttentionInterface.register("kvrag_capture", capture)
    AttentionMaskInterface.register("kvrag_capture", AttentionMaskInterface._global_mapping["eager"])
    model.set_attn_implementation("kvrag_capture")
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        model.set_attn_implementation(prev)
    n = len(ids)
    mask = got["mask"]
    if mask is None:
        mask = torch.ones(n, n, dtype=torch.bool).tril()
    else:
        mask = mask[0, 0, :, :n]
        mask = mask if mask.dtype == torch.bool else mask == 0
    return got["q"], got["k"], mask, got["scaling"]


def recomputed(res, layout, L):
    """bool [N]: cached tokens computed at every layer (from the engine's per-token counts)."""
    return layout.cached & (res.state.layer_counts == L)


# ---- A3: selection ------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize("pool,query_tokens", [(1, None), (5, None), (1, 3)])
def test_a3_default_scores_with_one_softmax_over_concatenated_heads(model_type, pool, query_tokens):
    # Paper eq. 3: s(d_i) = sum_j softmax(q_j K_true^T / sqrt(h))|d_i with full-width q_j and K
    # rows (h = hidden size): one softmax per question row over the heads' summed dot products,
    # as the reference code's compute_attention_sum_wo_head (KV heads repeated for GQA, scale
    # 1/sqrt(H*D)). Reference: HF's own layer-1 query/key states of the full prompt.
    model, arch, layout, ids = build(model_type, query_tokens=query_tokens)
    n, L = layout.n, arch.n_layers
    pol = get_policy("a3", recompute_ratio=0.2, pool_kernel=pool)
    assert pol.params.head_reduce == "concat"
    res = FusionEngine(arch).prefill(layout, pol, keep_state=True)

    q, k, mask, scaling = hf_query_keys(model, ids, 1)
    H, _, D = q.shape
    q_rows = torch.arange(n - (query_tokens or QUESTION), n)
    k = k.repeat_interleave(H // k.shape[0], dim=0)
    logits = torch.einsum("hqd,hnd->qn", q[:, q_rows], k) * scaling / H**0.5
    score = torch.softmax(logits.masked_fill(~mask[q_rows], float("-inf")), dim=-1).sum(0)
    if pool > 1:
        score = F.avg_pool1d(score[None, None], pool, stride=1, padding=pool // 2)[0, 0]
    cand = layout.cached.clone()
    cand[q_rows] = False
    p = int(0.2 * n)
    expected = torch.zeros(n, dtype=torch.bool)
    expected[top_k_indices(score.masked_fill(~cand, float("-inf")), p)] = True  # the tie rule: earlier wins
    torch.testing.assert_close(res.state.scratch["a3.scores"].cpu(), score, atol=1e-4, rtol=1e-4)
    assert torch.equal(recomputed(res, layout, L), expected)


@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize(
    "head_reduce,pool,query_tokens",
    [
        ("sum", 1, None),
        ("max", 1, None),
        ("sum", 5, None),
        ("mean", 1, 3),
    ],
)
def test_a3_recomputes_what_the_question_attends_to(model_type, head_reduce, pool, query_tokens):
    model, arch, layout, ids = build(model_type, query_tokens=query_tokens)
    n, L = layout.n, arch.n_layers
    pol = get_policy("a3", recompute_ratio=0.2, head_reduce=head_reduce, pool_kernel=pool)
    res = FusionEngine(arch).prefill(layout, pol, keep_state=True)

    # Independent scores: HF's own layer-1 attention of the question rows over the prompt.
    attn, _ = hf_attentions(model, ids)
    q_rows = torch.arange(n - (query_tokens or QUESTION), n)
    assert torch.equal(layout.query, q_rows)
    per_head = attn[1][:, q_rows].sum(1)  # [H, N]
    score = {"sum": per_head.sum(0), "mean": per_head.mean(0), "max": per_head.amax(0)}[head_reduce]
    if pool > 1:
        score = F.avg_pool1d(score[None, None], pool, stride=1, padding=pool // 2)[0, 0]
    cand = layout.cached.clone()
    cand[q_rows] = False

    chosen = recomputed(res, layout, L)
    p = int(0.2 * n)  # paper: p = r * n, n = input length
    assert int(chosen.sum()) == p
    expected = torch.zeros(n, dtype=torch.bool)
    expected[top_k_indices(score.masked_fill(~cand, float("-inf")), p)] = True  # the tie rule: earlier wins
    assert torch.equal(chosen, expected)
    # Cached tokens left out were computed at layers 0..score_layer only.
    counts = res.state.layer_counts
    assert torch.all(counts[layout.cached & ~chosen] == 2)
    assert torch.all(counts[~layout.cached] == L)
    assert res.stats.recomputed_tokens == p
    n_cached = int(layout.cached.sum())
    assert res.stats.recompute_fraction == pytest.approx((2 * n_cached + (L - 2) * p) / (L * n_cached))


@pytest.mark.parametrize("base", ["input", "context", "cached"])
def test_a3_ratio_base(base):
    model, arch, layout, _ = build()
    res = FusionEngine(arch).prefill(layout, get_policy("a3", recompute_ratio=0.3, ratio_base=base), keep_state=True)
    n, n_cached = layout.n, int(layout.cached.sum())
    want = {"input": n, "context": n - QUESTION, "cached": n_cached}[base]
    assert int(recomputed(res, layout, arch.n_layers).sum()) == int(0.3 * want)


def test_a3_later_score_layer_computes_everything_until_then():
    model, arch, layout, _ = build()
    res = FusionEngine(arch).prefill(layout, get_policy("a3", recompute_ratio=0.1, score_layer=2), keep_state=True)
    counts = res.state.layer_counts[layout.cached]
    assert set(counts.unique().tolist()) == {3, arch.n_layers}


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_a3_ratio_one_equals_full_prefill(model_type):
    model, arch, layout, ids = build(model_type)
    res = FusionEngine(arch).prefill(layout, get_policy("a3", recompute_ratio=1.0))
    torch.testing.assert_close(res.logits, hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert res.stats.recompute_fraction == 1.0
    assert res.stats.recomputed_tokens == sum(CHUNKS)
    with torch.no_grad():
        cache = output_cache(model(torch.tensor([ids]), use_cache=True))
    assert_matches_hf_cache(res.K, res.V, cache)


def test_a3_beats_naive_reuse_on_logits():
    # Recomputing the question-relevant 30% must move the logits toward full prefill.
    errs = {"a3": [], "naive_reuse": []}
    for seed in range(3):
        model, arch, layout, ids = build(seed=seed)
        ref = hf_logits(model, ids)
        eng = FusionEngine(arch)
        errs["a3"].append((eng.prefill(layout, get_policy("a3", recompute_ratio=0.3)).logits - ref).norm())
        errs["naive_reuse"].append((eng.prefill(layout, get_policy("naive_reuse")).logits - ref).norm())
    assert sum(errs["a3"]) < sum(errs["naive_reuse"])


# ---- A3: eviction extension ---------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a3_eviction_keeps_budget_system_prompt_and_question(model_type):
    model, arch, layout, ids = build(model_type)
    n, L, C = layout.n, arch.n_layers, 30
    # ratio 1.0 makes the fused K/V exact, so HF's own attention is the reference for votes.
    pol = get_policy("a3", recompute_ratio=1.0, evict_budget=C)
    res = FusionEngine(arch).prefill(layout, pol)
    torch.testing.assert_close(
        res.logits, hf_logits(model, ids), atol=1e-4, rtol=1e-4
    )  # eviction is after the first token
    assert res.stats.kept_tokens == C
    assert res.positions.shape == (L, arch.n_kv_heads, C)
    attn, cache = hf_attentions(model, ids)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:PREFIX] = True
    protected[n - QUESTION :] = True
    group = arch.n_heads // arch.n_kv_heads
    for layer in range(L):
        assert res.K[layer].shape == (arch.n_kv_heads, C, arch.head_dim) == res.V[layer].shape
        votes = attn[layer][:, n - QUESTION :].sum(1).view(arch.n_kv_heads, group, n).sum(1)
        votes = F.avg_pool1d(votes[:, None], 5, stride=1, padding=2)[:, 0]
        for h in range(arch.n_kv_heads):
            kept = res.positions[layer, h]
            assert kept.unique().numel() == C
            assert protected[kept].sum() == int(protected.sum())  # S and Q always kept
            free = top_k_indices(votes[h].masked_fill(protected, float("-inf")), C - int(protected.sum()))
            assert set(kept[~protected[kept]].tolist()) == set(free.tolist())
            # The kept slots hold exactly those tokens' K/V.
            torch.testing.assert_close(res.K[layer][h], cache.layers[layer].keys[0, h, kept], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(res.V[layer][h], cache.layers[layer].values[0, h, kept], atol=1e-4, rtol=1e-4)
    # The shrunken cache decodes.
    step = HFStepper(model, res.K, res.V, res.next_position)
    out = step.step([int(res.logits.argmax())])
    assert out.shape[0] == 1 and torch.isfinite(out).all()
    assert step.cache.get_seq_length() == C + 1


def test_a3_eviction_with_partial_recompute_and_large_budget():
    model, arch, layout, _ = build()
    eng = FusionEngine(arch)
    res = eng.prefill(layout, get_policy("a3", evict_budget=20))
    assert res.stats.kept_tokens == 20 and all(k.shape[1] == 20 for k in res.K)
    # A budget at or above the prompt length evicts nothing.
    res = eng.prefill(layout, get_policy("a3", evict_budget=layout.n))
    assert res.stats.kept_tokens == layout.n and res.positions.shape == (layout.n,)


def test_a3_eviction_budget_below_protected_tokens_raises():
    model, arch, layout, _ = build()
    with pytest.raises(ValueError, match="evict_budget=10 is smaller than the system prompt"):
        FusionEngine(arch).prefill(layout, get_policy("a3", evict_budget=PREFIX + QUESTION - 1))


# ---- EPIC ---------------------------------------------------------------------------------
def test_epic_recomputes_exactly_head_and_tail_of_each_chunk():
    model, arch, layout, _ = build()
    k_head, k_tail, L = 4, 2, arch.n_layers
    res = FusionEngine(arch).prefill(layout, get_policy("epic", k_head=k_head, k_tail=k_tail), keep_state=True)
    want = torch.zeros(layout.n, dtype=torch.bool)
    start = PREFIX
    for c in CHUNKS:
        want[start : start + k_head] = True
        want[start + c - k_tail : start + c] = True
        start += c
    counts = res.state.layer_counts
    assert torch.equal(recomputed(res, layout, L), want)
    assert torch.all(counts[layout.cached & ~want] == 0)  # no check layer: the rest never computed
    assert torch.all(counts[~layout.cached] == L)
    n_cached = sum(CHUNKS)
    assert res.stats.recompute_fraction == pytest.approx((k_head + k_tail) * len(CHUNKS) / n_cached)
    assert res.stats.recomputed_tokens == (k_head + k_tail) * len(CHUNKS)


def test_epic_short_chunk_counts_each_token_once():
    model, arch, layout, _ = build(chunks=(20, 3))
    res = FusionEngine(arch).prefill(layout, get_policy("epic", k_head=4, k_tail=2))
    assert res.stats.recomputed_tokens == 6 + 3


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_epic_whole_chunks_equal_full_prefill(model_type):
    model, arch, layout, ids = build(model_type)
    res = FusionEngine(arch).prefill(layout, get_policy("epic", k_head=max(CHUNKS)))
    torch.testing.assert_close(res.logits, hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert res.stats.recompute_fraction == 1.0


def test_epic_zero_tokens_is_naive_reuse():
    model, arch, layout, _ = build()
    eng = FusionEngine(arch)
    a = eng.prefill(layout, get_policy("epic", k_head=0, k_tail=0))
    b = eng.prefill(layout, get_policy("naive_reuse"))
    assert torch.equal(a.logits, b.logits) and a.stats.recompute_fraction == 0.0


# ---- parameters ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params,match",
    [
        (dict(recompute_ratio=1.5), "recompute_ratio"),
        (dict(score_layer=-1), "score_layer"),
        (dict(score_layer=1.5), "score_layer"),
        (dict(ratio_base="tokens"), "ratio_base"),
        (dict(head_reduce="avg"), "head_reduce"),
        (dict(pool_kernel=4), "pool_kernel"),
        (dict(evict_pool_kernel=0), "evict_pool_kernel"),
        (dict(evict_budget=0), "evict_budget"),
        (dict(evict_budget=2.5), "evict_budget"),
        (dict(check_layers=(1,)), "no parameter"),
    ],
)
def test_a3_bad_params(params, match):
    with pytest.raises(ValueError, match=match):
        get_policy("a3", **params)


def test_a3_score_layer_beyond_model_raises():
    model, arch, layout, _ = build()
    with pytest.raises(ValueError, match="score_layer=4 but the model has only 4 layers"):
        FusionEngine(arch).prefill(layout, get_policy("a3", score_layer=4))


@pytest.mark.parametrize(
    "params,match",
    [
        (dict(k_head=-1), "k_head"),
        (dict(k_tail=1.5), "k_tail"),
        (dict(k_head="32"), "k_head"),
        (dict(recompute_ratio=0.1), "no parameter"),
    ],
)
def test_epic_bad_params(params, match):
    with pytest.raises(ValueError, match=match):
        get_policy("epic", **params)


# ---- the real default model ---------------------------------------------------------------
