"""Batched decoding (``kvrag.query.batch``) on tiny random-weight models of every family: one
step over requests with caches of different lengths, filled by different policies, gives each
request the logits its own decoder gives it alone."""

import pytest
import torch
from corpus_helpers import DOCS, prompt_for

from kvrag.engine import KVRag
from kvrag.query.batch import DecodeCache, decode_step
from kvrag.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

# Every request of a batch runs another policy (and so another decoder behind KVRag.prefill:
# the model's own forward over a DynamicCache, or kvrag's layer step over a thinned cache).
POLICIES = [
    ("full_prefill", {}),
    ("cacheblend", {}),
    ("epic", {}),
    ("a3", {"evict_budget": 40}),  # a cache thinned per layer and head (the longest prompt)
    ("a3", {}),
    ("naive_reuse", {}),
    ("kvlink", {}),
    ("samkv", {}),
]
QUESTIONS = ["Where does the red fox live?", "How tall?", "Which river flows east?", "Who founded Brisk, and when?"]

FAMILIES = {
    "llama": ("llama", {}),
    # Every layer windowed, window well inside the prompt: decoding reads past it.
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    "qwen3": ("qwen3", {}),
    "smollm3": ("smollm3", {}),  # a NoPE layer
    "gemma3": ("gemma3_text", {}),  # local (window 8) and global layers, two RoPE tables
    "gemma2": ("gemma2", {}),  # soft-capped attention and logits, windows
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "phi3": ("phi3", {}),
    # LongRoPE: frequencies depend on the sequence length, so per request in a batch.
    "llama-longrope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 64,
                "short_factor": [1.0] * 8,
                "long_factor": [1.0 + 0.5 * i for i in range(8)],
            },
        },
    ),
}


def _prompts():
    """Prompts of different lengths (1 to 4 cached passages, or none)."""
    out = [prompt_for(DOCS[: i % 4 + 1], QUESTIONS[i % 4]) for i in range(len(POLICIES))]
    out[-1] = "No passage here, a short prompt."  # no cached chunk: the full-prefill path
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_step_equals_each_request_alone(tmp_path, family):
    model_type, overrides = FAMILIES[family]
    h = tiny_llama(seed=0, model_type=model_type, **overrides)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    prompts = _prompts()
    alone, caches, tokens = [], [], []
    for prompt, (policy, params) in zip(prompts, POLICIES):
        ref = rag.prefill(prompt, policy, **params)
        pre = rag.prefill(prompt, policy, **params)
        torch.testing.assert_close(pre.logits, ref.logits)
        cache = DecodeCache.from_stepper(rag.arch, pre.stepper, spare=2)  # grows mid-test
        assert cache is not None, policy
        alone.append(ref.stepper)
        caches.append(cache)
        tokens.append(int(ref.logits.argmax()))
    assert len({c.pos for c in caches}) > 3  # lengths differ
    assert caches[3].n[0] < caches[3].pos  # A3 evicted
    if any(w is not None for w in rag.arch.windows):
        assert max(c.pos for c in caches) > 4 * max(w for w in rag.arch.windows if w)  # the window binds
    for _ in range(6):
        logits = decode_step(rag.arch, caches, tokens)
        assert logits.shape == (len(caches), rag.arch.model.config.vocab_size)
        for i, stepper in enumerate(alone):
            ref = stepper.step([tokens[i]])[-1]
            # The batched rows round differently from a lone forward (another matmul shape,
            # kvrag's layer step instead of the model's forward): equal up to float32 rounding.
            torch.testing.assert_close(logits[i], ref, atol=2e-4, rtol=2e-4, msg=f"request {i} ({POLICIES[i][0]})")
            assert int(logits[i].argmax()) == int(ref.argmax()), POLICIES[i][0]
        tokens = logits.argmax(-1).tolist()


def test_a_request_steps_the_same_in_any_batch(tmp_path):
    """The same code stepping a request alone or among others: only the matmul shapes differ,
    so the rows agree to float32 rounding, step after step."""
    h = tiny_llama(seed=1, model_type="gemma3_text")
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    prompts = _prompts()[:4]
    batch = [DecodeCache.from_stepper(rag.arch, rag.prefill(p).stepper) for p in prompts]
    solo = [DecodeCache.from_stepper(rag.arch, rag.prefill(p).stepper) for p in prompts]
    tokens = [5, 17, 300, 4000]
    for _ in range(4):
        logits = decode_step(rag.arch, batch, tokens)
        for i, c in enumerate(solo):
            alone = decode_step(rag.arch, [c], [tokens[i]])[0]
            torch.testing.assert_close(logits[i], alone, atol=1e-4, rtol=1e-4)
            assert int(logits[i].argmax()) == int(alone.argmax())
        tokens = logits.argmax(-1).tolist()


def test_a_policy_with_its_own_decode_step_keeps_its_stepper(tmp_path):
    """A2ATS reads top-k rows per decode step: its request is not taken into the batch."""
    from kvrag.policies.a2ats.calibrate import calibrate

    h = tiny_llama(seed=0)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    _, path = calibrate(
        h, texts=[" ".join(DOCS) * 8], n_tokens=300, n_codes=16, iters=2, seq_len=96, out=tmp_path / "cb.safetensors"
    )
    rag.precompute(DOCS)
    pre = rag.prefill(prompt_for(DOCS), "a2ats", codebook=str(path), window=4, sink=2)
    assert pre.stepper.policy.decode_select is not None
    assert DecodeCache.from_stepper(rag.arch, pre.stepper) is None


def test_a_failed_step_leaves_every_cache_as_it_was(tmp_path):
    """A step that raises part-way (here: in the third request's attention) advances no cache,
    so the scheduler can retry the others: their logits are then those of a clean step."""
    h = tiny_llama(seed=0)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    prompts = _prompts()[:3]
    caches = [DecodeCache.from_stepper(rag.arch, rag.prefill(p).stepper) for p in prompts]
    clean = [DecodeCache.from_stepper(rag.arch, rag.prefill(p).stepper) for p in prompts[:2]]
    state = [(c.pos, list(c.n)) for c in caches]
    bad = caches[2]
    write = bad.write
    calls = {"n": 0}

    def failing_write(layer, k, v):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fault")
        return write(layer, k, v)

    bad.write = failing_write
    with pytest.raises(RuntimeError, match="device fault"):
        decode_step(rag.arch, caches, [1, 2, 3])
    assert [(c.pos, list(c.n)) for c in caches] == state
    got = decode_step(rag.arch, caches[:2], [1, 2])
    torch.testing.assert_close(got, decode_step(rag.arch, clean, [1, 2]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type,overrides", [("llama", {}), ("mistral", {"sliding_window": 8})])
def test_the_batch_reads_the_weights_once(tmp_path, model_type, overrides):
    """The step's cost in ops (what a GPU pays in kernel launches; counted, not timed): eight
    requests run the weight matmuls of one (the same count as one request), each request adds
    only its attention (at most 4 ops per layer: two row writes, the attention, a slice), and
    nothing waits for the device. On a sliding-window model an unthinned cache's window is a
    slice of its rows, without a mask."""
    from kvrag.bench.ops import count_ops

    h = tiny_llama(seed=0, model_type=model_type, **overrides)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    prompts = [prompt_for(DOCS[: i % 4 + 1], QUESTIONS[i % 4]) for i in range(8)]
    counts = {}
    for b in (1, 8):
        caches = [DecodeCache.from_stepper(rag.arch, rag.prefill(p).stepper) for p in prompts[:b]]
        counts[b], _ = count_ops(decode_step, rag.arch, caches, [5] * b)
    one, eight = counts[1], counts[8]
    matmuls = ("mm", "addmm", "bmm", "linear")
    assert sum(eight.by_op[m] for m in matmuls) == sum(one.by_op[m] for m in matmuls) > 0
    assert eight.total - one.total <= 7 * 4 * rag.arch.n_layers, eight.top(12)
    assert eight.syncs == one.syncs == 0
