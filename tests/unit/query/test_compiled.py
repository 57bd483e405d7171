"""The compiled decode step (``kvrag.query.compiled``) against the eager one, on tiny
random-weight models of every family it compiles for: the same logits to float32 rounding
and the same greedy tokens, over caches filled by different policies, as requests join and
leave; two graphs (one request, several) and no recompile as the lengths grow; the families
and options it leaves to the eager step."""

import pytest
import torch
from helpers.corpus import DOCS, prompt_for
from helpers.models import LONGROPE

from kvrag.engine import KVRag
from kvrag.policies import get_policy
from kvrag.query.batch import DecodeArena, DecodeCache, decode_step
from kvrag.query.compiled import CompiledRows, CompiledStep, compile_wanted
from kvrag.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

# The arena-decoded families, each with what its step adds: grouped-query heads (llama),
# per-head q/k norms (qwen3), norms over all heads after the projections and norms after
# attention and MLP (olmo2), multipliers on embeddings, residuals, attention and logits
# (granite), one fused q/k/v projection (phi3), a layer without RoPE (smollm3).
FAMILIES = ["llama", "qwen3", "olmo2", "granite", "phi3", "smollm3"]
SMOLLM3_NOPE = {"smollm3": {"no_rope_layer_interval": 2}}
POLICIES = [
    ("full_prefill", {}),
    ("cacheblend", {}),
    ("a3", {"evict_budget": 30}),  # a thinned cache: fewer rows than positions
    ("naive_reuse", {}),
    ("kvlink", {}),
]
QUESTIONS = ["Where does the red fox live?", "How tall?", "Which river flows east?", "Who founded Brisk, and when?"]
# The compiled graph fuses element-wise work the eager step runs op by op: float32 sums in
# another order, so logits agree to rounding, never bit for bit.
TOL = {"atol": 2e-4, "rtol": 2e-4}


def _caches(rag: KVRag) -> list[DecodeCache]:
    out = []
    for i, (policy, params) in enumerate(POLICIES):
        pre = rag.prefill(prompt_for(DOCS[: i % 4 + 1], QUESTIONS[i % 4]), policy, **params)
        cache = DecodeCache.from_stepper(rag.arch, pre.stepper, spare=2)  # the arena grows mid-test
        assert cache is not None, policy
        out.append(cache)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_step_equals_the_eager_step(tmp_path, family):
    # Two layers (a graph half the size to build); SmolLM3's second one without RoPE.
    h = tiny_llama(seed=0, model_type=family, num_hidden_layers=2, **SMOLLM3_NOPE.get(family, {}))
    rag = KVRag(h, cache_dir=tmp_path / "kv", compile="off")
    assert rag.arch.n_layers == 2 and (family != "smollm3" or rag.arch.rope_layers == [True, False])
    rag.precompute(DOCS)
    compiled = CompiledStep(rag.arch)
    eager, fast = _caches(rag), _caches(rag)
    assert len({c.pos for c in eager}) > 3 and eager[2].n[0] < eager[2].pos  # lengths differ; A3 evicted
    arenas = DecodeArena(rag.arch), DecodeArena(rag.arch)
    for arena, caches in zip(arenas, (eager, fast)):
        for c in caches:
            assert arena.add(c)
    tokens = [7, 11, 13, 17, 19]
    rows_before = arenas[1].rows
    for step in range(12):
        if step == 4:  # two requests finish: the arena keeps its slots, the batch shrinks
            for arena, caches in zip(arenas, (eager, fast)):
                for c in (caches[1], caches[3]):
                    arena.remove(c)
                    caches.remove(c)
            tokens = [tokens[0], tokens[2], tokens[4]]
        ref = decode_step(rag.arch, eager, tokens, arenas[0])
        got = decode_step(rag.arch, fast, tokens, arenas[1], compiled)
        torch.testing.assert_close(got, ref, **TOL, msg=f"step {step}")
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist(), step
        tokens = ref.argmax(-1).tolist()
    assert [c.pos for c in fast] == [c.pos for c in eager]
    assert arenas[1].rows > rows_before  # the rows grew past the first spare ones...
    assert compiled.compiles == 1  # ...and one graph served every length and batch size


def test_a_warm_step_compiles_nothing_more(tmp_path):
    """After ``warm_up`` (two graphs: one request, several), answers of other lengths, alone
    or side by side, build no graph."""
    h = tiny_llama(seed=0)
    rag = KVRag(h, cache_dir=tmp_path / "kv", compile="on")
    rag.precompute(DOCS)
    assert rag.compiled is not None and rag.compiled.compiles == 0
    assert rag.warm_up() > 0
    assert rag.compiled.compiles == 2
    rag.generate(prompt_for(DOCS[:1]), max_new_tokens=5, ignore_eos=True)
    rag.generate(prompt_for(DOCS), policy="cacheblend", max_new_tokens=9, ignore_eos=True)
    caches = _caches(rag)[:3]
    arena = DecodeArena(rag.arch)
    for c in caches:
        arena.add(c)
    decode_step(rag.arch, caches, [1, 2, 3], arena, rag.compiled)
    assert rag.compiled.compiles == 2


@pytest.mark.parametrize("policy", ["full_prefill", "cacheblend", "epic", "naive_reuse", "a3"])
def test_a_compiled_answer_is_the_eager_answer(tmp_path, policy):
    """``KVRag(compile="on")`` streams the same greedy tokens as op-by-op decoding."""
    h = tiny_llama(seed=2)
    eager = KVRag(h, cache_dir=tmp_path / "kv", compile="off")
    fast = KVRag(h, cache_dir=tmp_path / "kv", compile="on")
    eager.precompute(DOCS)
    prompt = prompt_for(DOCS[:3], "Which river flows east?")
    want = eager.generate(prompt, policy=policy, max_new_tokens=16, ignore_eos=True)
    got = fast.generate(prompt, policy=policy, max_new_tokens=16, ignore_eos=True)
    assert got.token_ids == want.token_ids
    assert fast.compiled is not None and fast.compiled.compiles >= 1  # the compiled step ran


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("gemma3_text", {}),  # sliding windows
        ("gemma2", {}),  # soft-capped attention
        ("llama", LONGROPE),
    ],
)
def test_families_it_does_not_compile_decode_op_by_op(tmp_path, model_type, overrides):
    h = tiny_llama(seed=0, model_type=model_type, **overrides)
    rag = KVRag(h, cache_dir=tmp_path / "kv", compile="on")
    assert rag.compiled is None
    assert rag.warm_up() == 0.0
    rag.precompute(DOCS)
    out = rag.generate(prompt_for(DOCS[:2]), max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4


def test_the_compile_choice():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert not compile_wanted("auto", cpu, serving=False)  # a CPU process: the first answer would wait
    assert compile_wanted("auto", cpu, serving=True)
    assert compile_wanted("auto", gpu, serving=False)
    assert compile_wanted("on", cpu, serving=False) and compile_wanted(True, cpu, serving=False)
    assert not compile_wanted("off", gpu, serving=True) and not compile_wanted(False, gpu, serving=True)
    with pytest.raises(ValueError, match="compile must be one of"):
        compile_wanted("fast", cpu, serving=False)


def test_a_bad_compile_value_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="compile must be one of"):
        KVRag("/nonexistent/model", cache_dir=tmp_path / "kv", compile="yes")


# ---- the fused prefill's computed rows ------------------------------------------------
# (policy, params, the layer the compiled loop starts at): rows fixed from the start (the
# question alone, chunk edges beside it, inserted link tokens), or after a ranking layer.
ROW_POLICIES = [
    ("naive_reuse", {}, 0),
    ("epic", {}, 0),
    ("kvlink", {"mode": "untrained"}, 0),
    ("cacheblend", {"deviation": "attention", "recompute_ratio": 0.3}, 1),
    ("kvlink", {"mode": "untrained", "recompute_ratio": 0.3, "check_layers": (1,)}, 2),
]


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "smollm3"])
def test_compiled_rows_equal_the_eager_layer_loop(tmp_path, family):
    """The fused prefill's loop compiled (``CompiledRows``) from where a policy's rows are
    fixed gives the eager loop's logits and K/V to float32 rounding, over prompts of other
    lengths from one graph per start layer."""
    h = tiny_llama(seed=0, model_type=family, num_hidden_layers=3, **SMOLLM3_NOPE.get(family, {}))
    rag = KVRag(h, cache_dir=tmp_path / "kv", compile="off", kvlink_adapter=None)
    rag.precompute(DOCS)
    rows = CompiledRows(rag.arch)
    for i, (policy, params, start) in enumerate(ROW_POLICIES):
        prep = rag.prepare(prompt_for(DOCS[: i % 3 + 2], QUESTIONS[i % 4]), policy, **params)
        assert prep.policy.rows_fixed_after() == start - 1
        rag.fusion.compiled = None
        ref = rag.fusion.prefill(prep.layout, prep.policy)
        rag.fusion.compiled = rows
        got = rag.fusion.prefill(prep.layout, prep.policy)
        # Built at a start layer's first prompt, serving the others.
        assert rows.compiles == len({s for _, _, s in ROW_POLICIES[: i + 1]}), policy
        torch.testing.assert_close(got.logits, ref.logits, **TOL, msg=policy)
        assert got.logits.argmax() == ref.logits.argmax()
        for a, b in zip(got.K + got.V, ref.K + ref.V):
            torch.testing.assert_close(a, b, **TOL, msg=policy)
        assert got.stats.computed_tokens == ref.stats.computed_tokens
        assert got.stats.recompute_fraction == ref.stats.recompute_fraction


def test_policies_that_narrow_the_rows_at_any_layer_keep_the_eager_loop(tmp_path):
    """a3, prophetkv, samkv and a2ats may choose rows (or mask) at any layer: the compiled loop
    is not used for them (no graph is built) and their prefills are the eager ones; warm_up
    builds the graphs from layer 0 and from where the KVRag's own policy (cacheblend, ranking
    at layer 1) fixes its rows, which then serve answers without another."""
    h = tiny_llama(seed=2)
    rag = KVRag(h, cache_dir=tmp_path / "kv", compile="on", policy="cacheblend")
    rag.precompute(DOCS)
    eager = KVRag(h, cache_dir=tmp_path / "kv", compile="off")
    prompt = prompt_for(DOCS[:3], "Which river flows east?")
    for policy in ("a3", "prophetkv", "samkv", "a2ats"):
        assert get_policy(policy).rows_fixed_after() is None
    for policy in ("a3", "prophetkv"):
        assert rag.prefill(prompt, policy).logits.equal(eager.prefill(prompt, policy).logits)
    assert rag.fusion.compiled is not None and rag.fusion.compiled.compiles == 0
    assert rag.warm_up() > 0 and rag.fusion.compiled.compiles == 2
    for policy in ("naive_reuse", "cacheblend"):
        want = eager.generate(prompt, policy=policy, max_new_tokens=8, ignore_eos=True)
        got = rag.generate(prompt, policy=policy, max_new_tokens=8, ignore_eos=True)
        assert got.token_ids == want.token_ids, policy
    assert rag.fusion.compiled.compiles == 2
    # Rows spread over the prompt, attended in groups over key prefixes (an attention plan):
    # op by op, which skips what the groups cannot see.
    spread = {"recompute_ratio": 1.0, "deviation": "attention"}
    long_docs = [" ".join([d] * 4) for d in DOCS]
    rag.precompute(long_docs)
    long_prompt = prompt_for(long_docs)
    got = rag.prefill(long_prompt, "cacheblend", **spread)
    assert got.stats.computed_tokens + got.stats.recomputed_tokens >= 2 * 64
    assert got.logits.equal(eager.prefill(long_prompt, "cacheblend", **spread).logits)
    assert rag.fusion.compiled.compiles == 2


def test_rows_that_cannot_be_compiled_run_op_by_op(tmp_path, caplog):
    """A compiler that fails on this machine leaves the loop to the eager engine: the same
    prefill, bit for bit, the reason kept and logged once, no second try."""
    h = tiny_llama(seed=0)
    rag = KVRag(h, cache_dir=tmp_path / "kv", compile="off")
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS[:2], "How tall?")
    want = rag.prefill(prompt, "naive_reuse").logits
    rows = CompiledRows(rag.arch)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no C++ compiler here")

    rows._fn = broken
    rag.fusion.compiled = rows
    with caplog.at_level("WARNING", logger="kvrag"):
        for _ in range(2):
            assert rag.prefill(prompt, "naive_reuse").logits.equal(want)
    assert rows.failed == "RuntimeError: no C++ compiler here" and len(calls) == 1
    assert caplog.text.count("compiling them failed") == 1
