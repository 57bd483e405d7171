"""Fusion-engine invariants on tiny random-weight models of every supported family."""

from unittest.mock import patch

import pytest
import torch
from helpers.fusion import CONFIGS, assert_matches_hf_cache, hf_logits, pieces_for, rand_ids, tiny

from kvrag.arch import Arch
from kvrag.chunk import compute_chunk_kv
from kvrag.layout.state import Layout
from kvrag.policies import get_policy
from kvrag.query.decode import output_cache
from kvrag.query.fusion import FusionEngine


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_rerotated_key_equals_key_at_position(model_type):
    model = tiny(model_type)
    arch = Arch(model)
    g = torch.Generator().manual_seed(1)
    ids = rand_ids(12, g)
    # The same chunk computed after a 7-token prefix vs alone: layer-0 keys depend only on the
    # token, so re-rotating the position-free key by 7 must give the key at position 7+i.
    prefix = rand_ids(7, g)
    with torch.no_grad():
        out = model(torch.tensor([prefix + ids]), use_cache=True)
    k_true = output_cache(out).layers[0].keys[0][:, -12:]  # [Hkv, T, D] (or a window's last rows)
    k_pre, _ = compute_chunk_kv(arch, [ids])[0]
    k_rot = arch.rotate(k_pre[0], torch.arange(7, 19), layer=0)
    torch.testing.assert_close(k_rot[:, -k_true.shape[1] :], k_true, atol=1e-5, rtol=1e-5)
    # Undoing the rotation recovers the position-free key.
    torch.testing.assert_close(arch.unrotate(k_rot, torch.arange(7, 19), 0), k_pre[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_chunk_rows_placed_layer_by_layer_or_all_at_once_are_the_same(model_type):
    """``cached_kv``'s two placements (a CPU's layer by layer, a GPU's all layers at once) write
    the same rotated keys and values into the stored rows, bit for bit: RoPE per layer kind
    (Gemma 3), NoPE layers (SmolLM3) and partial rotary (Phi-4-mini) included."""
    arch = Arch(tiny(model_type))
    g = torch.Generator().manual_seed(3)
    segs = [(rand_ids(4, g), False), (rand_ids(9, g), True), (rand_ids(2, g), False), (rand_ids(7, g), True)]
    layout = Layout.build(pieces_for(arch, segs + [(rand_ids(3, g), False)]))
    cos, sin = arch.cos_sin(layout.positions)
    engine = FusionEngine(arch)
    placed = []
    for layerwise in (True, False):
        engine.layerwise = layerwise
        K, V, _ = engine.cached_kv(layout, cos, sin)
        placed.append([t[:, layout.stored] for t in K + V])
    assert len(placed[0]) == 2 * arch.n_layers and placed[0][0].shape[1] == 16
    assert all(torch.equal(a, b) for a, b in zip(*placed))
    # And each layer's keys are the chunk's own, rotated to where the prompt holds them (by the
    # prompt's tables: a length-dependent RoPE has other frequencies in a shorter sequence).
    k_pre, _ = compute_chunk_kv(arch, [segs[1][0]])[0]
    want = arch.rotate(k_pre[-1], None, (cos[4:13], sin[4:13]), layer=arch.n_layers - 1)
    torch.testing.assert_close(placed[0][arch.n_layers - 1][:, :9], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_shifted_query_equals_query_at_the_shifted_position(model_type):
    """``arch.shift`` moves an already rotated query by an offset: the same as computing it
    there (RoPE composition, attention factor once; the identity on NoPE layers), all with
    the tables of one 64-token prompt (a length-dependent RoPE has other frequencies at 8)."""
    model = tiny(model_type)
    arch = Arch(model)
    hidden = torch.randn(5, arch.hidden_size, generator=torch.Generator().manual_seed(9))
    at = lambda p: arch.cos_sin(torch.arange(p, p + 5), length=64)  # noqa: E731
    for layer in range(arch.n_layers):
        q3, _, _, _ = arch.qkv(layer, hidden, at(3))
        q40, _, _, _ = arch.qkv(layer, hidden, at(40))
        moved = arch.shift(q3, arch.cos_sin(torch.tensor([37]), length=64), layer)
        torch.testing.assert_close(moved, q40, atol=1e-4, rtol=1e-4)
        # Undoing the rotation of rows of that prompt, and of rows decoded one by one (each
        # rotated in a sequence ending at itself), recovers the same position-free query.
        q_pre = arch.unrotate(q40, torch.arange(40, 45), layer, length=64)
        one_by_one = torch.stack(
            [arch.qkv(layer, hidden[i : i + 1], arch.cos_sin(torch.tensor([40 + i])))[0][:, 0] for i in range(5)], dim=1
        )
        torch.testing.assert_close(
            arch.unrotate(one_by_one, torch.arange(40, 45), layer, length=torch.arange(41, 46)),
            q_pre,
            atol=1e-4,
            rtol=1e-4,
        )


def test_a_chunk_gets_the_same_kv_whatever_it_is_packed_with():
    """A length-dependent RoPE (LongRoPE) picks its frequencies from the sequence length: a
    short chunk packed with a long one must still get exactly what it gets alone."""
    arch = Arch(tiny("llama-longrope"))
    assert arch.length_dependent_rope
    g = torch.Generator().manual_seed(2)
    short, long_ = rand_ids(9, g), rand_ids(40, g)
    k_alone, v_alone = compute_chunk_kv(arch, [short], anchor=[1])[0]
    k_packed, v_packed = compute_chunk_kv(arch, [short, long_], anchor=[1])[0]
    torch.testing.assert_close(k_packed, k_alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_packed, v_alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_chunk_prefill_matches_model(model_type):
    model = tiny(model_type)
    arch = Arch(model)
    g = torch.Generator().manual_seed(2)
    a, b = rand_ids(9, g), rand_ids(14, g)
    packed = compute_chunk_kv(arch, [a, b])
    for ids, (k_pre, v) in zip([a, b], packed):
        with torch.no_grad():
            cache = output_cache(model(torch.tensor([ids]), use_cache=True))
        for layer in range(arch.n_layers):
            k_rot = arch.rotate(k_pre[layer], torch.arange(len(ids)), layer=layer)
            # A sliding-window layer's HF cache holds only its last window - 1 rows.
            kept = cache.layers[layer].keys.shape[2]
            torch.testing.assert_close(v[layer][:, -kept:], cache.layers[layer].values[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(k_rot[:, -kept:], cache.layers[layer].keys[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_chunk_prefill_behind_anchor_matches_model(model_type):
    """With an anchor, each packed chunk's K/V are the model's own for ``anchor + chunk`` read
    alone, minus the anchor rows (values at positions len(anchor).., keys position-free)."""
    model = tiny(model_type)
    arch = Arch(model)
    g = torch.Generator().manual_seed(4)
    anchor, a, b = rand_ids(2, g), rand_ids(9, g), rand_ids(14, g)
    packed = compute_chunk_kv(arch, [a, b], anchor)
    plain = compute_chunk_kv(arch, [a])[0]
    for ids, (k_pre, v) in zip([a, b], packed):
        assert k_pre.shape[2] == v.shape[2] == len(ids)
        with torch.no_grad():
            cache = output_cache(model(torch.tensor([anchor + ids]), use_cache=True))
        pos = torch.arange(2, 2 + len(ids))
        for layer in range(arch.n_layers):
            k_rot = arch.rotate(k_pre[layer], pos, layer=layer)
            kept = min(len(ids), cache.layers[layer].keys.shape[2])  # sliding layers: the last rows
            torch.testing.assert_close(
                v[layer][:, -kept:], cache.layers[layer].values[0][:, -kept:], atol=1e-5, rtol=1e-4
            )
            torch.testing.assert_close(k_rot[:, -kept:], cache.layers[layer].keys[0][:, -kept:], atol=1e-5, rtol=1e-4)
    # The anchor changes what the chunk's deeper layers hold (layer 0 keys depend on the token only).
    torch.testing.assert_close(packed[0][0][0], plain[0][0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(packed[0][1][-1], plain[1][-1], atol=1e-3)


@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize("params", [{}, {"deviation": "attention"}], ids=["value", "attention"])
def test_ratio_one_equals_full_prefill(model_type, params):
    model = tiny(model_type)
    arch = Arch(model)
    g = torch.Generator().manual_seed(3)
    segs = [(rand_ids(5, g), False), (rand_ids(20, g), True), (rand_ids(17, g), True), (rand_ids(6, g), False)]
    all_ids = [t for s, _ in segs for t in s]
    layout = Layout.build(pieces_for(arch, segs))
    res = FusionEngine(arch).prefill(layout, get_policy("cacheblend", recompute_ratio=1.0, **params))
    torch.testing.assert_close(res.logits, hf_logits(model, all_ids), atol=1e-4, rtol=1e-4)
    assert res.stats.recompute_fraction == 1.0
    assert res.stats.recomputed_tokens == 37
    # The fused cache equals the model's own cache at every layer.
    with torch.no_grad():
        cache = output_cache(model(torch.tensor([all_ids]), use_cache=True))
    assert_matches_hf_cache(res.K, res.V, cache)


def test_naive_reuse_is_exact_for_a_single_leading_chunk():
    # A chunk at the very start is encoded exactly as in the full prompt (nothing precedes it),
    # so naive reuse must equal full prefill there — and differ once a chunk follows another.
    model = tiny("llama")
    arch = Arch(model)
    g = torch.Generator().manual_seed(4)
    c1, c2, q = rand_ids(16, g), rand_ids(16, g), rand_ids(5, g)
    eng, naive = FusionEngine(arch), get_policy("naive_reuse")
    res = eng.prefill(Layout.build(pieces_for(arch, [(c1, True), (q, False)])), naive)
    torch.testing.assert_close(res.logits, hf_logits(model, c1 + q), atol=1e-4, rtol=1e-4)
    assert res.stats.recomputed_tokens == 0 and res.stats.computed_tokens == 5
    res2 = eng.prefill(Layout.build(pieces_for(arch, [(c1, True), (c2, True), (q, False)])), naive)
    assert not torch.allclose(res2.logits, hf_logits(model, c1 + c2 + q), atol=1e-3)


def test_cacheblend_selects_highest_value_deviation():
    model = tiny("llama")
    arch = Arch(model)
    g = torch.Generator().manual_seed(5)
    segs = [(rand_ids(4, g), False), (rand_ids(30, g), True), (rand_ids(30, g), True), (rand_ids(5, g), False)]
    layout = Layout.build(pieces_for(arch, segs))
    pol = get_policy("cacheblend", recompute_ratio=0.2)
    captured = {}
    orig = pol.select

    def spy(layer, state, q, k, v):
        out = orig(layer, state, q, k, v)
        if layer == 1:
            dev = ((v - state.V[1][:, state.active]) ** 2).sum(dim=(0, 2))
            captured["dev"], captured["active"], captured["sel"] = dev, state.active.clone(), out
        return out

    pol.select = spy
    res = FusionEngine(arch).prefill(layout, pol)
    cached = layout.cached[captured["active"]]
    chosen = captured["active"][captured["sel"]]
    chosen_cached = chosen[layout.cached[chosen]]
    assert chosen_cached.numel() == int(60 * 0.2)
    # Every chosen cached token deviates at least as much as every cached token left out.
    dev = captured["dev"]
    in_sel = torch.zeros_like(cached)
    in_sel[captured["sel"]] = True
    assert dev[cached & in_sel].min() >= dev[cached & ~in_sel].max()
    assert res.stats.recomputed_tokens == 12
    # Layers 0-1 compute all 60 cached tokens, layers 2-3 only 12: (2*60 + 2*12) / (4*60).
    assert res.stats.recompute_fraction == pytest.approx((2 * 60 + 2 * 12) / 240)


def layer0_deviation_reference(arch, layout) -> torch.Tensor:
    """float64 [C]: per cached token, sum over heads and dims of the squared difference of its
    layer-0 attention output over every earlier token and over its own segment plus token 0,
    from explicit per-row softmaxes (the code under test batches and masks instead)."""
    with torch.no_grad():
        hidden = arch.embed(layout.token_ids)
        q, k, v, _ = arch.qkv(0, hidden, arch.cos_sin(layout.positions))
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    out = []
    for i in layout.cached.nonzero().squeeze(1).tolist():
        own = [j for j in range(i + 1) if j == 0 or layout.segment[j] == layout.segment[i]]
        o = []
        for keys in (list(range(i + 1)), own):
            w = torch.softmax((q[:, i : i + 1].double() @ k[:, keys].transpose(1, 2)) * arch.scaling, dim=-1)
            o.append((w @ v[:, keys]).flatten())
        out.append(((o[0] - o[1]) ** 2).sum())
    return torch.stack(out)


def test_cacheblend_attention_deviation_ranks_before_layer_0_attention():
    """deviation="attention": cached tokens ranked at layer 0 by how much their attention output
    changes between the whole prompt and their own passage; only the chosen ones run on."""
    model = tiny("llama")
    arch = Arch(model)
    g = torch.Generator().manual_seed(5)
    segs = [(rand_ids(30, g), True), (rand_ids(4, g), False), (rand_ids(30, g), True), (rand_ids(5, g), False)]
    layout = Layout.build(pieces_for(arch, segs))
    pol = get_policy("cacheblend", recompute_ratio=0.2, deviation="attention")
    captured = {}
    orig = pol.select

    def spy(layer, state, q, k, v):
        out = orig(layer, state, q, k, v)
        captured.setdefault(layer, out)
        return out

    pol.select = spy
    res = FusionEngine(arch).prefill(layout, pol, keep_state=True)
    L = arch.n_layers
    assert captured[0] is not None and all(captured[layer] is None for layer in range(1, L))
    ref = layer0_deviation_reference(arch, layout)
    # The leading passage has nothing before it but itself: it deviates by exactly nothing.
    assert ref[:30].abs().max() < 1e-12 and ref[30:].min() > 0
    chosen = captured[0]  # token indices at layer 0
    assert chosen.numel() == int(60 * 0.2) == res.stats.recomputed_tokens
    rank = {int(t): j for j, t in enumerate(layout.cached.nonzero().squeeze(1))}
    in_sel = torch.zeros(60, dtype=torch.bool)
    in_sel[[rank[int(t)] for t in chosen]] = True
    assert ref[in_sel].min() >= ref[~in_sel].max()
    # The policy names cached tokens only; the engine keeps every non-cached one computed at
    # every layer, and the cached ones left out stop after layer 0's projections.
    assert bool(layout.cached[chosen].all())
    counts = res.state.layer_counts
    assert bool((counts[~layout.cached] == L).all())
    assert sorted(counts[layout.cached].unique().tolist()) == [1, L]
    assert res.stats.recompute_fraction == pytest.approx((60 + (L - 1) * 12) / (L * 60))
    # Nothing to recompute: naive reuse's answer (the cached rows' layer-0 K/V are rewritten
    # from the same projections).
    none = FusionEngine(arch).prefill(layout, get_policy("cacheblend", recompute_ratio=0.0, deviation="attention"))
    naive = FusionEngine(arch).prefill(layout, get_policy("naive_reuse"))
    torch.testing.assert_close(none.logits, naive.logits, atol=1e-5, rtol=1e-5)
    assert none.stats.recomputed_tokens == 0


@pytest.mark.parametrize("name", ["llama", "mistral-window", "gemma3", "gemma2"])
def test_cacheblend_attention_deviation_reads_only_the_keys_its_rows_see(name, monkeypatch):
    """The attention check in row blocks reads no key after a block's last row and, under a
    sliding window, none before its first row's window but the sink: the scores (and so the
    selection) equal those of one block over every key."""
    from kvrag.policies import cacheblend

    arch = Arch(tiny(name))
    g = torch.Generator().manual_seed(7)
    segs = [(rand_ids(30, g), True), (rand_ids(4, g), False), (rand_ids(30, g), True), (rand_ids(5, g), False)]
    layout = Layout.build(pieces_for(arch, segs))
    n, rows = layout.n, 9
    pol = get_policy("cacheblend", recompute_ratio=0.2, deviation="attention")
    got: dict[str, torch.Tensor] = {}
    keys_read: list[int] = []
    real_attention = arch.attention

    def counting(q, k, v, mask, *a, **kw):
        keys_read.append(k.shape[1])
        return real_attention(q, k, v, mask, *a, **kw)

    def spy(layer, state, q, k, v):
        if layer == 0:
            got["one block"] = cacheblend.attention_deviation(state, q, k, v)
            with monkeypatch.context() as mp:
                mp.setattr(cacheblend, "SCORE_BUDGET", 2 * q.shape[0] * n * rows)
                mp.setattr(arch, "attention", counting)
                got["blocks"] = cacheblend.attention_deviation(state, q, k, v)
        return None

    pol.select = spy
    FusionEngine(arch).prefill(layout, pol)
    ends = [min(n, lo + rows) for lo in range(0, n, rows)]
    window = arch.windows[0]
    if window is None:  # causal: a block reads the prefix up to its last row
        assert keys_read == ends
    else:  # the sink and the window of the block's first row onwards
        assert len(keys_read) == len(ends) and max(keys_read) <= 1 + rows + window - 1 < n
    torch.testing.assert_close(got["blocks"], got["one block"], rtol=1e-4, atol=1e-6 * float(got["one block"].max()))
    cached = layout.cached.nonzero().squeeze(1)
    k_keep = int(cached.numel() * 0.2)
    assert set(got["blocks"][cached].topk(k_keep).indices.tolist()) == set(
        got["one block"][cached].topk(k_keep).indices.tolist()
    )


@pytest.mark.parametrize("name", ["mistral-window", "gemma3"])
@pytest.mark.parametrize("policy,params", [("naive_reuse", {}), ("epic", {}), ("cacheblend", {"recompute_ratio": 0.3})])
def test_windowed_layers_attend_from_each_groups_window(name, policy, params, monkeypatch):
    """On a sliding-window layer the active rows are cut where they span a window, and each
    group reads keys from the first one inside its first row's window, not from key 0: the
    same logits and K/V as one causal plan over every key up to its rows."""
    from kvrag.query.fusion import _Rows

    arch = Arch(tiny(name))
    g = torch.Generator().manual_seed(11)
    segs = [(rand_ids(120, g), True), (rand_ids(120, g), True), (rand_ids(6, g), False)]
    layout = Layout.build(pieces_for(arch, segs))
    first_keys: list[int] = []
    real = arch._sdpa_planned

    def spy(q, keys, values, mask, plan):
        first_keys.extend(k0 for _, _, k0, _ in plan)
        return real(q, keys, values, mask, plan)

    monkeypatch.setattr(arch, "_sdpa_planned", spy)
    got = FusionEngine(arch).prefill(layout, get_policy(policy, **params))
    assert max(first_keys) > 0
    if policy == "naive_reuse":  # only the question's rows run: they skip both passages but a window
        assert max(first_keys) >= layout.n - 6 - arch.windows[0]
    if policy == "epic":  # the second passage's first tokens are a group of their own
        assert any(120 - arch.windows[0] <= k0 <= 120 for k0 in first_keys)
    monkeypatch.setattr(_Rows, "windowed", lambda self, active, window: None)
    ref = FusionEngine(arch).prefill(layout, get_policy(policy, **params))
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(got.K + got.V, ref.K + ref.V):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cacheblend_gradual_filtering_shrinks():
    model = tiny("llama")
    arch = Arch(model)
    g = torch.Generator().manual_seed(6)
    segs = [(rand_ids(40, g), True), (rand_ids(40, g), True), (rand_ids(5, g), False)]
    layout = Layout.build(pieces_for(arch, segs))
    pol = get_policy("cacheblend", recompute_ratio=0.1, check_layers=(1, 2), layer_ratios=(0.3, 0.1))
    sizes = {}
    orig = pol.select

    def spy(layer, state, q, k, v):
        out = orig(layer, state, q, k, v)
        sizes[layer] = int(layout.cached[state.active[out] if out is not None else state.active].sum())
        return out

    pol.select = spy
    FusionEngine(arch).prefill(layout, pol)
    assert sizes[1] == 24 and sizes[2] == 8 and sizes[3] == 8
    # A check layer the model does not have is named, not silently ignored.
    with pytest.raises(ValueError, match="check_layers"):
        FusionEngine(arch).prefill(layout, get_policy("cacheblend", check_layers=(arch.n_layers,)))


def test_bad_policy_params():
    with pytest.raises(ValueError, match="recompute_ratio"):
        get_policy("cacheblend", recompute_ratio=1.5)
    with pytest.raises(ValueError, match="no parameter"):
        get_policy("naive_reuse", recompute_ratio=0.1)
    with pytest.raises(ValueError, match="unknown policy"):
        get_policy("nope")


@pytest.mark.parametrize(
    "policy,params,match",
    [
        # Wrong types fail at construction, naming the parameter -- not later, deep in a prefill,
        # as a TypeError (a string ratio), nor silently (a string read as a sequence of layers).
        ("cacheblend", dict(check_layers=1), "check_layers"),
        ("cacheblend", dict(check_layers="12"), "check_layers"),
        ("cacheblend", dict(layer_ratios=(float("nan"),)), "layer_ratios"),
        ("cacheblend", dict(deviation="keys"), "deviation"),
        ("cacheblend", dict(deviation="attention", check_layers=(2,)), "check_layers"),
        ("cacheblend", dict(deviation="attention", layer_ratios=(0.1,)), "layer_ratios"),
        ("samkv", dict(keep_ratio="0.5"), "keep_ratio"),
        ("samkv", dict(keep_ratio=True), "keep_ratio"),
        ("samkv", dict(theta="0.5"), "theta"),
        ("samkv", dict(adaptive_p="no"), "adaptive_p"),
        ("samkv", dict(stable_layers="12"), "stable_layers"),
        ("samkv", dict(block_size=2.5), "block_size"),
        ("epic", dict(k_head=float("inf")), "k_head"),
        ("a3", dict(score_layer=float("inf")), "score_layer"),
        ("a3", dict(pool_kernel="3"), "pool_kernel"),
        ("a2ats", dict(topk="0.5"), "topk"),
        ("a2ats", dict(topk=float("nan")), "topk"),
        ("a2ats", dict(prefill="cacheblend", recompute_ratio=True), "recompute_ratio"),
        ("a2ats", dict(sink=1.5), "sink"),
    ],
)
def test_policy_params_of_the_wrong_type_are_named(policy, params, match):
    with pytest.raises(ValueError, match=match):
        get_policy(policy, **params)


def test_policy_params_that_are_whole_numbers_are_accepted_as_ints():
    assert get_policy("epic", k_head=8.0).params.k_head == 8
    assert get_policy("cacheblend", check_layers=[1, 2], layer_ratios=[0.5, 0.2]).params.check_layers == (1, 2)
    assert get_policy("samkv", stable_layers=[-1, -2], keep_ratio=1).params.stable_layers == (-1, -2)


@pytest.mark.parametrize("policy", ["cacheblend", "a3"])
def test_grouped_partial_attention_equals_one_masked_call(policy):
    """Partial layers attend in row groups, each against the key prefix it can see; that must
    be exactly the single masked attention it replaces (same logits, same fused K/V)."""
    arch = Arch(tiny("llama"))
    g = torch.Generator().manual_seed(11)
    segs = [(rand_ids(8, g), False), (rand_ids(200, g), True), (rand_ids(200, g), True), (rand_ids(12, g), False)]
    layout = Layout.build(pieces_for(arch, segs))
    pol = get_policy(policy, recompute_ratio=0.5)  # ~200 active rows: several groups
    grouped = FusionEngine(arch).prefill(layout, pol)
    arch.ATTN_GROUPS = 1  # instance attribute: this Arch only
    single = FusionEngine(arch).prefill(layout, pol)
    assert 0 < grouped.stats.recomputed_tokens < layout.n
    torch.testing.assert_close(grouped.logits, single.logits, atol=1e-5, rtol=1e-5)
    for kg, ks in zip(grouped.K, single.K):
        torch.testing.assert_close(kg, ks, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["expand", "fold"])
@pytest.mark.parametrize("ratio", [0.1, 0.5])  # partial: the prefill's attention is masked
def test_masked_attention_with_grouped_heads_expanded_or_folded_is_the_same(ratio, mode):
    """On CUDA a masked attention with grouped-query heads either expands K/V to every query
    head or folds each KV head's query heads into rows of one head (else SDPA falls back to
    its math kernel); forced here on the CPU, the chunk K/V, the fused prefill and the scores
    must be what the GQA call gives."""
    arch = Arch(tiny("llama"))
    assert arch.n_heads != arch.n_kv_heads and arch.gqa_masked is None
    g = torch.Generator().manual_seed(12)
    segs = [(rand_ids(8, g), False), (rand_ids(150, g), True), (rand_ids(150, g), True), (rand_ids(12, g), False)]
    layout = Layout.build(pieces_for(arch, segs))
    pol = get_policy("cacheblend", recompute_ratio=ratio)
    chunks = [rand_ids(20, g), rand_ids(30, g)]
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((attn_mask is not None, kw["enable_gqa"], q.shape[1], k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    with patch("kvrag.arch.F.scaled_dot_product_attention", spy):
        ref, ref_kv = FusionEngine(arch).prefill(layout, pol), compute_chunk_kv(arch, chunks)
    # On the CPU (auto) the kernel takes the grouped heads as they are.
    assert all(gqa for masked, gqa, _, _ in calls if masked)
    calls.clear()
    arch.gqa_masked = mode
    with patch("kvrag.arch.F.scaled_dot_product_attention", spy):
        out = FusionEngine(arch).prefill(layout, pol)
        n_prefill = len(calls)
        kv = compute_chunk_kv(arch, chunks)
    # Both the fused prefill and the chunk precompute made masked calls, and every masked call
    # ran without enable_gqa: on K/V with one head per query head, or on the folded heads.
    masked = [c for c in calls if c[0]]
    assert any(c[0] for c in calls[:n_prefill]) and any(c[0] for c in calls[n_prefill:])
    heads = (arch.n_heads, arch.n_heads) if mode == "expand" else (arch.n_kv_heads, arch.n_kv_heads)
    assert all(not gqa and (qh, kh) == heads for _, gqa, qh, kh in masked)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    for ko, kr in zip(out.K, ref.K):
        torch.testing.assert_close(ko, kr, atol=1e-5, rtol=1e-5)
    for (k1, v1), (k2, v2) in zip(kv, ref_kv):
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)


def test_folded_grouped_heads_take_a_per_head_mask():
    """A mask per query head [H, A, N] folds with the heads: each head keeps its own mask."""
    arch = Arch(tiny("llama"))
    g = torch.Generator().manual_seed(3)
    H, hkv, D = arch.n_heads, arch.n_kv_heads, arch.head_dim
    q, k, v = (torch.randn(h, n, D, generator=g) for h, n in ((H, 7), (hkv, 30), (hkv, 30)))
    mask = torch.rand(H, 7, 30, generator=g) > 0.4
    mask[..., 0] = True  # every row sees a key
    ref = arch._sdpa(q, k, v, mask)
    arch.gqa_masked = "fold"
    torch.testing.assert_close(arch._sdpa(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)
    arch.gqa_masked = "both"
    with pytest.raises(ValueError, match="gqa_masked must be one of"):
        arch._sdpa(q, k, v, mask)


def test_decode_cache_holds_the_fused_kv_without_copying_and_continues_exactly():
    """HFStepper's cache takes the fused K/V tensors themselves (no TTFT copy), and decoding
    from it gives the model's own logits for the continuation."""
    from kvrag.query.decode import HFStepper

    model = tiny()
    arch = Arch(model)
    ids = rand_ids(40, torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(torch.tensor([ids[:-2]]), use_cache=True)
    past = output_cache(out)
    K = [past.layers[i].keys[0].clone() for i in range(arch.n_layers)]
    V = [past.layers[i].values[0].clone() for i in range(arch.n_layers)]
    step = HFStepper(model, K, V, next_position=len(ids) - 2)
    assert all(step.cache.layers[i].keys.data_ptr() == K[i].data_ptr() for i in range(arch.n_layers))
    assert step.cache.get_seq_length() == len(ids) - 2
    got = step.step(ids[-2:])
    torch.testing.assert_close(got[-1], hf_logits(model, ids), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], hf_logits(model, ids[:-1]), rtol=1e-4, atol=1e-4)
