"""ProphetKV on tiny random-weight models of every supported family.

References are computed independently of the policy: HF's own eager attention weights of the
full prompt give what the question attends to at each layer (stage 1 computes every token, so
its attention there is the full prefill's), and HF's own forward gives logits and caches."""

import os

import pytest
import torch
from helpers.corpus import DOCS, prompt_for
from helpers.fusion import CONFIGS, assert_matches_hf_cache, hf_logits, pieces_for, rand_ids, tiny

from kvrag.arch import Arch
from kvrag.bench.ops import count_ops, plain_forward_ops
from kvrag.layout.state import Layout
from kvrag.policies import get_policy, policy_names
from kvrag.policies.prophetkv import default_score_layers, ranked_top
from kvrag.query.decode import output_cache
from kvrag.query.fusion import FusionEngine

PREFIX, CHUNKS, QUESTION = 5, (20, 17, 15), 6


def build(model_type="llama", seed=0, chunks=CHUNKS, question=QUESTION):
    """A tiny model and a layout ``plain prefix | cached chunks | plain question``."""
    model = tiny(model_type, seed=seed)
    arch = Arch(model)
    g = torch.Generator().manual_seed(100 + seed)
    segs = [(rand_ids(PREFIX, g), False)] + [(rand_ids(c, g), True) for c in chunks] + [(rand_ids(question, g), False)]
    ids = [t for s, _ in segs for t in s]
    return model, arch, Layout.build(pieces_for(arch, segs)), ids


def hf_attentions(model, ids):
    """Softmax attention weights of the full prompt per layer: [L][H, N, N] (eager kernel)."""
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True)
    finally:
        model.set_attn_implementation(prev)
    return [a[0].float() for a in out.attentions]


def recomputed(res, layout, L):
    """bool [N]: cached tokens computed at every layer."""
    return layout.cached & (res.state.layer_counts == L)


@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize("fusion", ["mean", "max"])
def test_recomputes_what_the_question_attends_to_fused_over_the_score_layers(model_type, fusion):
    model, arch, layout, ids = build(model_type)
    n, L = layout.n, arch.n_layers
    qs = n - QUESTION
    pol = get_policy("prophetkv", recompute_ratio=0.25, score_layers=(1, 2), fusion=fusion)
    res = FusionEngine(arch).prefill(layout, pol, keep_state=True)

    # Reference: the full prompt's attention of the question rows, renormalized over the
    # context (a softmax over a subset of keys is the full softmax rescaled on that subset).
    attn = hf_attentions(model, ids)
    per_layer = []
    for layer in (1, 2):
        a = attn[layer][:, qs:, :qs]  # [H, Q, C]
        per_layer.append((a / a.sum(-1, keepdim=True)).sum(dim=(0, 1)))
    want = sum(per_layer) if fusion == "mean" else torch.maximum(*per_layer)
    torch.testing.assert_close(res.state.scratch["prophetkv.score"].cpu(), want, atol=1e-4, rtol=1e-4)

    n_cached = int(layout.cached.sum())
    k = int(0.25 * n_cached)
    # Best first; equal scores (tokens outside every question row's sliding window score 0)
    # go to the earlier position.
    ranked = sorted(layout.cached[:qs].nonzero().squeeze(1).tolist(), key=lambda j: (-float(want[j]), j))
    expected = torch.zeros(n, dtype=torch.bool)
    expected[ranked[:k]] = True
    chosen = recomputed(res, layout, L)
    assert torch.equal(chosen, expected)
    # Stage 1 computed every cached token through layer 2; the others stopped there.
    counts = res.state.layer_counts
    assert torch.all(counts[layout.cached & ~chosen] == 3)
    assert torch.all(counts[~layout.cached] == L)
    assert res.stats.recomputed_tokens == k
    assert res.stats.recompute_fraction == pytest.approx((3 * n_cached + (L - 3) * k) / (L * n_cached))


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_default_score_layers_see_the_whole_context(model_type):
    """Left to its default, ProphetKV scores at layers 1-2 where both attend to every earlier
    token, and otherwise at the first global layer after layer 0 (a local layer would give
    every token beyond its window a score of 0); a model with only local layers keeps 1-2."""
    model, arch, layout, ids = build(model_type)
    windows = arch.windows
    layers = default_score_layers(arch)
    if windows[1] is None and windows[2] is None:
        assert layers == (1, 2)
    elif any(w is None for w in windows[1:]):
        (g,) = layers
        assert windows[g] is None and all(w is not None for w in windows[1:g]) and g > 0
    else:
        assert layers == (1, 2)
    # The prefill ranks by the question's attention at exactly those layers.
    qs = layout.n - QUESTION
    res = FusionEngine(arch).prefill(layout, get_policy("prophetkv", recompute_ratio=0.25), keep_state=True)
    attn = hf_attentions(model, ids)
    want = sum((a := attn[layer][:, qs:, :qs]) / a.sum(-1, keepdim=True) for layer in layers).sum(dim=(0, 1))
    torch.testing.assert_close(res.state.scratch["prophetkv.score"].cpu(), want, atol=1e-4, rtol=1e-4)
    assert torch.all(res.state.layer_counts[layout.cached] >= layers[-1] + 1)


def test_the_default_layer_choice_per_layer_pattern():
    """Layers 1-2 both global: (1, 2); layer 1 or 2 local: the first global layer (Gemma 3's
    pattern puts it at 5); no global layer at all: (1, 2)."""
    choices = {m: default_score_layers(build(m)[1]) for m in ("llama", "qwen2-window", "gemma3", "gemma3-global-first")}
    assert choices == {"llama": (1, 2), "qwen2-window": (1,), "gemma3": (1,), "gemma3-global-first": (3,)}
    assert default_score_layers(build("mistral-window")[1]) == (1, 2)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_ratio_one_equals_full_prefill(model_type):
    model, arch, layout, ids = build(model_type)
    res = FusionEngine(arch).prefill(layout, get_policy("prophetkv", recompute_ratio=1.0))
    torch.testing.assert_close(res.logits, hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert res.stats.recompute_fraction == 1.0
    assert res.stats.recomputed_tokens == sum(CHUNKS)
    with torch.no_grad():
        cache = output_cache(model(torch.tensor([ids]), use_cache=True))
    assert_matches_hf_cache(res.K, res.V, cache)


def test_ties_within_the_tolerance_go_to_the_earlier_position():
    s = torch.tensor([0.1, 0.5 + 3e-7, 0.5, 0.5 + 4e-6, 0.2, 0.5])
    # 0.5 and 0.5 + 3e-7 (and the later 0.5) sit on the same 1e-6 grid step: earliest first.
    assert ranked_top(s, 1, 1e-6).tolist() == [3]  # a gap above the tolerance still wins
    assert ranked_top(s, 3, 1e-6).tolist() == [3, 1, 2]
    assert ranked_top(s, 4, 1e-6).tolist() == [3, 1, 2, 5]
    # A finer grid separates them again.
    assert ranked_top(s, 2, 1e-8).tolist() == [3, 1]
    assert ranked_top(s, 0, 1e-6).numel() == 0
    assert ranked_top(s, 99, 1e-6).numel() == s.numel()


def test_tied_scores_in_a_prefill_keep_the_earliest_cached_tokens():
    # A tolerance of the question's whole attention puts every score on one grid step: all
    # cached tokens tie, and the earliest ones are recomputed.
    model, arch, layout, _ = build()
    pol = get_policy("prophetkv", recompute_ratio=0.2, tie_tolerance=1.0)
    res = FusionEngine(arch).prefill(layout, pol, keep_state=True)
    chosen = recomputed(res, layout, arch.n_layers).nonzero().squeeze(1)
    first = layout.cached.nonzero().squeeze(1)[: chosen.numel()]
    assert torch.equal(chosen, first)


def test_selection_is_deterministic_on_the_cpu():
    model, arch, layout, _ = build(seed=1)
    eng = FusionEngine(arch)
    runs = [eng.prefill(layout, get_policy("prophetkv"), keep_state=True) for _ in range(2)]
    a, b = (recomputed(r, layout, arch.n_layers) for r in runs)
    assert a.any() and torch.equal(a, b)
    torch.testing.assert_close(runs[0].logits, runs[1].logits, atol=0, rtol=0)


def test_the_question_decides_what_is_recomputed():
    # The crowding-out the paper names: a question-blind rank (CacheBlend's deviation) picks
    # the same tokens whatever is asked; ProphetKV's choice follows the question.
    model, arch, layout, ids = build(seed=2)
    g = torch.Generator().manual_seed(7)
    other_q = rand_ids(QUESTION, g)
    pieces = list(layout.pieces[:-1]) + [type(layout.pieces[-1])(torch.tensor(other_q))]
    layout2 = Layout.build(pieces)
    eng = FusionEngine(arch)
    picks = {}
    for name in ("prophetkv", "cacheblend"):
        pol = get_policy(name, recompute_ratio=0.2)
        picks[name] = [
            recomputed(eng.prefill(lay, pol, keep_state=True), lay, arch.n_layers) for lay in (layout, layout2)
        ]
    assert not torch.equal(*picks["prophetkv"])
    assert torch.equal(*picks["cacheblend"])


def test_beats_naive_reuse_on_logits():
    errs = {"prophetkv": [], "naive_reuse": []}
    for seed in range(3):
        model, arch, layout, ids = build(seed=seed)
        ref = hf_logits(model, ids)
        eng = FusionEngine(arch)
        for name in errs:
            errs[name].append(
                (
                    eng.prefill(
                        layout, get_policy(name, **({"recompute_ratio": 0.3} if name == "prophetkv" else {}))
                    ).logits
                    - ref
                ).norm()
            )
    assert sum(errs["prophetkv"]) < sum(errs["naive_reuse"])


def fused_ops(arch, n_chunks, total=96, seed=0, **params):
    g = torch.Generator().manual_seed(seed)
    segs = [(rand_ids(5, g), False)] + [(rand_ids(total // n_chunks, g), True) for _ in range(n_chunks)]
    segs.append((rand_ids(6, g), False))
    engine = FusionEngine(arch)
    # The op budget is a launch-bound device's (a GPU's): count the placement it runs, all
    # layers' chunk rows at once (a CPU places them layer by layer, a few ops more a layer).
    engine.layerwise = False
    layout = Layout.build(pieces_for(arch, segs))
    return count_ops(engine.prefill, layout, get_policy("prophetkv", **params))


def test_ops_within_1_3x_a_plain_forward_and_flat_in_the_chunk_count():
    model = tiny("llama")
    arch = Arch(model)
    two, _ = fused_ops(arch, 2)
    eight, res = fused_ops(arch, 8)
    # Scoring is one [H, Q, context] attention per score layer and one ranking, whatever the
    # number of chunks: 4x the chunks adds nothing per layer.
    assert eight.total <= two.total + 4, (two.top(), eight.top())
    n_cached = res.stats.cached_tokens
    plain = plain_forward_ops(model, n_cached, res.stats.prompt_tokens - n_cached)
    assert eight.total <= 1.3 * plain.total, (eight.total, plain.total, eight.top())
    # More score layers add a fixed few ops each (two: the question's logits), not a pass.
    three, _ = fused_ops(arch, 8, score_layers=(0, 1, 2))
    assert three.total <= eight.total + 3


def test_bad_params_are_named():
    with pytest.raises(ValueError, match="score_layers"):
        get_policy("prophetkv", score_layers=(2, 1))
    with pytest.raises(ValueError, match="fusion"):
        get_policy("prophetkv", fusion="median")
    with pytest.raises(ValueError, match="tie_tolerance"):
        get_policy("prophetkv", tie_tolerance=0.0)
    with pytest.raises(ValueError, match="recompute_ratio"):
        get_policy("prophetkv", recompute_ratio=1.5)
    model, arch, layout, _ = build()
    with pytest.raises(ValueError, match="score_layers=.* only 4 layers"):
        FusionEngine(arch).prefill(layout, get_policy("prophetkv", score_layers=(1, 4)))


# ---- end to end: registry, KVRag, device -----------------------------------------------------
DEVICE = os.environ.get("KVRAG_TEST_DEVICE", "cpu")


def test_registered_for_kvrag_and_the_cli(tmp_path):
    from kvrag import KVRag
    from kvrag.testing import tiny_llama

    assert "prophetkv" in policy_names()
    rag = KVRag(tiny_llama(seed=3, device=DEVICE), cache_dir=tmp_path / "kv", hot_cache=0, policy="prophetkv")
    rag.precompute(DOCS[:3])
    prompt = prompt_for(DOCS[:3])
    out = rag.generate(prompt, max_new_tokens=4)
    assert out.stats.policy == "prophetkv" and out.stats.chunks_hit == 3
    assert out.stats.recomputed_tokens == int(0.2 * out.stats.cached_tokens)
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=6)
    exact = rag.generate(prompt, policy="prophetkv", recompute_ratio=1.0, max_new_tokens=6)
    assert exact.token_ids == full.token_ids
