"""Half-precision copies for one-row (decode) products (``kvrag.model.gemv``): a row reads the
copies, within float16's rounding of the float32 result, through every family's projections
and MLP shapes; several rows (prefill, precompute) read the model's own weights, bit for bit;
the compiled step reads them as the eager one does; ``auto`` takes a format only where it
measured faster."""

import pytest
import torch
from helpers.corpus import DOCS, prompt_for

import kvrag.model.gemv as gemv
from kvrag.chunk import compute_chunk_kv
from kvrag.engine import KVRag
from kvrag.model.gemv import DecodeWeights
from kvrag.query.batch import DecodeArena, DecodeCache, decode_step
from kvrag.query.compiled import CompiledStep
from kvrag.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

# Gated MLPs with SiLU (llama) and GELU and sandwich norms (gemma3), Phi-3's fused q/k/v and
# gate/up projections, OLMo 2's norms after the projections, Granite's multipliers.
FAMILIES = ["llama", "gemma3_text", "phi3", "olmo2", "granite"]


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_one_row_reads_the_copies_and_many_rows_the_model(family):
    h = tiny_llama(seed=0, model_type=family)
    full = h.arch
    half = full.with_decode_weights("float16")
    assert half is not full and full.decode_weights is None  # the handle's arch is untouched
    torch.manual_seed(1)
    hidden, attn = torch.randn(3, full.hidden_size), torch.randn(3, full.n_heads * full.head_dim)
    cs = full.cos_sin(torch.tensor([5, 6, 7]))
    for layer in range(full.n_layers):
        # Several rows: the float32 weights, exactly.
        assert torch.equal(half.finish_layer(layer, hidden, attn), full.finish_layer(layer, hidden, attn))
        for a, b in zip(half.qkv(layer, hidden, cs), full.qkv(layer, hidden, cs)):
            assert torch.equal(a, b)
        # One row: the copies, within float16's rounding (~5e-4 a product), and not bit for bit.
        one = full.cos_sin(torch.tensor([5]))
        got, want = half.finish_layer(layer, hidden[:1], attn[:1]), full.finish_layer(layer, hidden[:1], attn[:1])
        assert not torch.equal(got, want) and _max_rel(got, want) < 1e-2
        for a, b in zip(half.qkv(layer, hidden[:1], one), full.qkv(layer, hidden[:1], one)):
            assert not torch.equal(a, b) and _max_rel(a, b) < 1e-2
    assert torch.equal(half.logits(hidden), full.logits(hidden))
    got, want = half.logits(hidden[:1]), full.logits(hidden[:1])
    assert not torch.equal(got, want) and _max_rel(got, want) < 1e-2


def test_the_copies_hold_every_projection_and_the_head_in_half_the_bytes():
    h = tiny_llama(seed=0)
    dw = h.arch.with_decode_weights("bfloat16").decode_weights
    assert dw is not None and dw.name == "bfloat16"
    linears = [m for m in h.model.model.layers.modules() if isinstance(m, torch.nn.Linear)] + [h.model.lm_head]
    assert dw.nbytes == sum(m.weight.numel() * 2 for m in linears)
    assert all(w.dtype == torch.bfloat16 for layer in dw.layers for w in layer.values())
    assert len(dw.layers[0]) == 7  # q, k, v, o, gate, up, down


def test_no_copies_where_the_model_is_not_float32_or_float32_is_asked():
    bf16 = tiny_llama(seed=0, dtype="bfloat16")
    assert bf16.arch.with_decode_weights("float16") is bf16.arch
    h = tiny_llama(seed=0)
    assert h.arch.with_decode_weights("float32") is h.arch
    with pytest.raises(ValueError, match="decode_weights must be one of"):
        h.arch.with_decode_weights("int8")


@pytest.mark.parametrize(
    ("f16", "bf16", "picked"),
    [(0.5, 0.7, "float16"), (0.9, 0.95, "float32"), (0.5, 0.4, "bfloat16"), (0.85, 2.0, "float32")],
)
def test_auto_takes_a_format_only_where_it_measured_faster(monkeypatch, f16, bf16, picked):
    times = {torch.float32: 1.0, torch.float16: f16, torch.bfloat16: bf16}
    monkeypatch.setattr(gemv, "_time_rows", lambda mats: times[mats[0].dtype])
    h = tiny_llama(seed=0)
    assert DecodeWeights.choose(h.model) == picked
    arch = h.arch.with_decode_weights("auto")
    assert (arch.decode_weights.name if arch.decode_weights is not None else "float32") == picked


def test_auto_measures_this_machine():
    h = tiny_llama(seed=0)
    assert gemv._time_rows([h.model.lm_head.weight]) > 0
    assert DecodeWeights.choose(h.model) in ("float32", "float16", "bfloat16")


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])  # one decoded in an arena, one windowed
def test_answers_decoded_from_the_copies_share_the_stored_chunks(tmp_path, family):
    """The chunks a half-precision decoder reads are the float32 decoder's (same fingerprint,
    the same K/V computed); its decode steps read the copies (logits within float16's rounding
    of float32's, not equal) and its greedy answers, on these prompts, are the same tokens."""
    h = tiny_llama(seed=2, model_type=family)
    full = KVRag(h, cache_dir=tmp_path / "kv", compile="off")
    half = KVRag(h, cache_dir=tmp_path / "kv", compile="off", decode_weights="float16")
    assert half.fingerprint == full.fingerprint and half.arch.decode_weights is not None
    chunks = [h.encode(d) for d in DOCS[:2]]
    for a, b in zip(compute_chunk_kv(half.arch, chunks), compute_chunk_kv(full.arch, chunks)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    full.precompute(DOCS)
    for i, policy in enumerate(["full_prefill", "cacheblend", "naive_reuse", "a3"]):
        prompt = prompt_for(DOCS[: i + 2], "Which river flows east?")
        want = full.generate(prompt, policy=policy, max_new_tokens=16, ignore_eos=True)
        got = half.generate(prompt, policy=policy, max_new_tokens=16, ignore_eos=True)
        assert got.token_ids == want.token_ids, policy
        assert got.stats.chunks_hit == want.stats.chunks_hit
    # Teacher-forced over the same tokens, every decode step's logits differ by float16's rounding.
    prompt = prompt_for(DOCS[:2], "Which river flows east?")
    ids = full.generate(prompt, policy="cacheblend", max_new_tokens=6, ignore_eos=True).token_ids
    steps = {}
    for name, rag in (("full", full), ("half", half)):
        pre = rag.prefill(prompt, "cacheblend")
        step = rag._decoding(pre.stepper, len(ids) + 2)
        steps[name] = [step(t) for t in ids]
    for a, b in zip(steps["half"], steps["full"]):
        assert not torch.equal(a, b) and _max_rel(a, b) < 1e-2


def test_the_compiled_step_reads_the_copies_as_the_eager_step_does(tmp_path):
    h = tiny_llama(seed=0)
    rag = KVRag(h, cache_dir=tmp_path / "kv", compile="off", decode_weights="float16")
    rag.precompute(DOCS)
    compiled = CompiledStep(rag.arch)
    pre = rag.prefill(prompt_for(DOCS[:2], "How tall?"), "cacheblend")
    caches = [DecodeCache.from_stepper(rag.arch, pre.stepper, spare=8) for _ in range(2)]
    arenas = DecodeArena(rag.arch), DecodeArena(rag.arch)
    for arena, cache in zip(arenas, caches):
        assert cache is not None and arena.add(cache)
    token = int(pre.logits.argmax())
    for _ in range(6):
        want = decode_step(rag.arch, [caches[0]], [token], arenas[0])
        got = decode_step(rag.arch, [caches[1]], [token], arenas[1], compiled)
        # Inductor may keep a product's float16 output in float32 (no rounding of it): the
        # two differ by that rounding, float16's own (~5e-4 relative), not float32's.
        assert _max_rel(got, want) < 5e-3 and int(got.argmax()) == int(want.argmax())
        token = int(want.argmax())
    assert compiled.compiles == 1


def test_a_bad_value_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="decode_weights must be one of"):
        KVRag("/nonexistent/model", cache_dir=tmp_path / "kv", decode_weights="half")
