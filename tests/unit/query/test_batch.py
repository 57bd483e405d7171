"""Batched decoding (``kvrag.query.batch``) on tiny random-weight models of every family: one
step over requests with caches of different lengths, filled by different policies, gives each
request the logits its own decoder gives it alone."""

import pytest
import torch
from helpers.corpus import DOCS, prompt_for
from helpers.models import LONGROPE

from kvrag.engine import KVRag
from kvrag.query.batch import DecodeArena, DecodeCache, decode_step
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
        LONGROPE,
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


ARENA_POLICIES = [("full_prefill", {}), ("cacheblend", {}), ("a3", {"evict_budget": 40}), ("naive_reuse", {})]


def _arena_rag(tmp_path, model_type="llama"):
    h = tiny_llama(seed=0, model_type=model_type)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    return rag


def _pair(rag, i, spare=2):
    """Request ``i`` twice: a cache for the arena and one that steps on its own."""
    p, (policy, params) = prompt_for(DOCS[: i % 4 + 1], QUESTIONS[i % 4]), ARENA_POLICIES[i % len(ARENA_POLICIES)]
    return [DecodeCache.from_stepper(rag.arch, rag.prefill(p, policy, **params).stepper, spare=spare) for _ in "ab"]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "olmo2", "granite", "phi3"])
def test_the_arena_step_equals_each_request_alone(tmp_path, model_type):
    """Caches of different lengths (an A3-thinned one among them, its rows chosen per layer and
    head) in one arena: one attention call per layer gives each request its own step's
    logits, through rows growing past the arena's (spare=2: it grows mid-test)."""
    rag = _arena_rag(tmp_path, model_type)
    arena = DecodeArena(rag.arch)
    pairs = [_pair(rag, i) for i in range(4)]
    pooled, solo = [a for a, _ in pairs], [b for _, b in pairs]
    assert all(arena.add(c) for c in pooled) and arena.members == pooled
    assert len({c.n[0] for c in pooled}) == 4 and pooled[2].n[0] < pooled[2].pos  # lengths differ, A3 evicted
    rows0 = arena.rows
    tokens = [5, 17, 300, 40]
    for _ in range(6):
        logits = decode_step(rag.arch, pooled, tokens, arena)
        for i, c in enumerate(solo):
            alone = decode_step(rag.arch, [c], [tokens[i]])[0]
            torch.testing.assert_close(logits[i], alone, atol=1e-4, rtol=1e-4)
            assert int(logits[i].argmax()) == int(alone.argmax())
        tokens = logits.argmax(-1).tolist()
    assert arena.rows > rows0  # grew, members' rows carried over
    assert [c.pos for c in pooled] == [c.pos for c in solo] and [c.n for c in pooled] == [c.n for c in solo]


@pytest.mark.parametrize("mode", ["fold", "expand"])
def test_the_arena_step_folds_or_expands_grouped_heads_under_its_mask(tmp_path, mode, monkeypatch):
    """Members of different lengths (a key-padding mask) with grouped-query heads: folding each
    KV head's query heads into rows, or expanding K/V per query head (what CUDA's fused
    kernels need; forced here on the CPU), gives the step the kernel's own GQA gives, through
    calls without ``enable_gqa``."""
    rag = _arena_rag(tmp_path)
    assert rag.arch.n_heads != rag.arch.n_kv_heads
    pairs = [_pair(rag, i) for i in range(3)]
    arenas = []
    for m in (None, mode):
        rag.arch.gqa_masked = m
        arena = DecodeArena(rag.arch)
        caches = [a if m is None else b for a, b in pairs]
        assert all(arena.add(c) for c in caches) and len({c.n[0] for c in caches}) == 3
        arenas.append((arena, caches))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((attn_mask is not None, kw["enable_gqa"], q.shape[1], k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    tokens = [5, 17, 300]
    try:
        for _ in range(3):
            rag.arch.gqa_masked = None
            ref = decode_step(rag.arch, arenas[0][1], tokens, arenas[0][0])
            calls.clear()
            rag.arch.gqa_masked = mode
            got = decode_step(rag.arch, arenas[1][1], tokens, arenas[1][0])
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
            heads = (rag.arch.n_kv_heads,) * 2 if mode == "fold" else (rag.arch.n_heads,) * 2
            assert calls and all(masked and not gqa and (qh, kh) == heads for masked, gqa, qh, kh in calls)
            tokens = ref.argmax(-1).tolist()
    finally:
        rag.arch.gqa_masked = None


def test_an_empty_arena_takes_its_first_member_without_copying_its_rows(tmp_path):
    """The first member's buffers become the arena's slot 0 as they are (the one-request
    decode of ``KVRag.stream`` copies its prompt's K/V once, not twice), its unwritten rows
    made zeros (NaN there would poison the masked step of a later batch); a second member
    joining copies both into a larger buffer, and both step as they would alone."""
    rag = _arena_rag(tmp_path)
    (a, solo_a), (b, solo_b) = _pair(rag, 0, spare=8), _pair(rag, 1, spare=8)
    for layer in range(len(a.n)):
        a._k[layer][:, a.n[layer] :] = float("nan")
        a._v[layer][:, a.n[layer] :] = float("nan")
    ptrs = [k.data_ptr() for k in a._k]
    arena = DecodeArena(rag.arch)
    assert arena.add(a)
    assert [k.data_ptr() for k in arena._k] == ptrs and [k.data_ptr() for k in a._k] == ptrs
    assert all(bool((k[0, :, a.n[i] :] == 0).all()) for i, k in enumerate(arena._k))
    torch.testing.assert_close(
        decode_step(rag.arch, [a], [5], arena)[0], decode_step(rag.arch, [solo_a], [5])[0], atol=1e-4, rtol=1e-4
    )
    assert arena.add(b) and arena.slots == 2 and arena._k[0].data_ptr() != ptrs[0]
    got = decode_step(rag.arch, [a, b], [6, 7], arena)
    for row, solo, tok in ((got[0], solo_a, 6), (got[1], solo_b, 7)):
        assert bool(torch.isfinite(row).all())
        torch.testing.assert_close(row, decode_step(rag.arch, [solo], [tok])[0], atol=1e-4, rtol=1e-4)


def test_requests_join_and_leave_an_arena_between_steps(tmp_path):
    """A member leaving moves the last one into its slot; a new one joins at the end; a step of
    one member alone (the scheduler's retry after a failed step) stays on its slot's rows; the
    last one leaving frees the buffers."""
    rag = _arena_rag(tmp_path)
    arena = DecodeArena(rag.arch)
    pairs = [_pair(rag, i) for i in range(5)]
    live = []
    for a, b in pairs[:3]:
        arena.add(a)
        live.append((a, b))

    def step_all():
        toks = [7 + i for i in range(len(live))]
        order = {id(c): i for i, c in enumerate(arena.members)}
        live.sort(key=lambda ab: order[id(ab[0])])
        got = decode_step(rag.arch, [a for a, _ in live], toks, arena)
        for i, (_, b) in enumerate(live):
            torch.testing.assert_close(got[i], decode_step(rag.arch, [b], [toks[i]])[0], atol=1e-4, rtol=1e-4)

    step_all()
    gone = live.pop(0)
    arena.remove(gone[0])
    assert gone[0] not in arena.members and gone[0].arena is None
    with pytest.raises(IndexError):
        decode_step(rag.arch, [gone[0]], [1])  # its rows are gone: no silent garbage
    step_all()
    for a, b in pairs[3:]:
        arena.add(a)
        live.append((a, b))
    step_all()
    a, b = live[1]
    alone = decode_step(rag.arch, [b], [9])[0]
    torch.testing.assert_close(decode_step(rag.arch, [a], [9], arena)[0], alone, atol=1e-4, rtol=1e-4)
    step_all()
    for a, _ in list(live):
        arena.remove(a)
    assert arena.members == [] and arena.rows == 0


def test_the_arena_takes_only_what_it_can_step(tmp_path):
    """Sliding windows or soft-capped attention mask per request by position: such a model's
    caches stay on the per-request path; a member never grows out of its slot unseen."""
    for model_type in ("mistral", "gemma2", "gemma3_text"):
        h = tiny_llama(seed=0, model_type=model_type, **({"sliding_window": 8} if model_type == "mistral" else {}))
        rag = KVRag(h, cache_dir=tmp_path / model_type)
        cache = DecodeCache.from_stepper(rag.arch, rag.prefill("a short prompt").stepper)
        assert not DecodeArena.supports(rag.arch) and not DecodeArena(rag.arch).add(cache)
    rag = _arena_rag(tmp_path)
    arena = DecodeArena(rag.arch)
    a, _ = _pair(rag, 0, spare=1)
    arena.add(a)
    assert not arena.add(a)  # already a member
    top = max(a.n)
    while max(a.n) < arena.rows - 1:  # the arena's steps keep two rows free: up to the last but one
        decode_step(rag.arch, [a], [3], arena)
    decode_step(rag.arch, [a], [3])  # alone, a member may write its slot's last row...
    with pytest.raises(RuntimeError, match="with its arena"):
        decode_step(rag.arch, [a], [3])  # ...but not a row the slot lacks
    decode_step(rag.arch, [a], [3], arena)  # with it, the arena grows first
    assert max(a.n) > top and arena.rows > max(a.n)


def test_an_arena_step_runs_one_attention_per_layer(tmp_path):
    """Counted, not timed: eight members attend in one SDPA call per layer (the per-request
    path makes eight), with no host sync."""
    from kvrag.bench.ops import count_ops

    rag = _arena_rag(tmp_path)
    arena = DecodeArena(rag.arch)
    caches = [_pair(rag, i)[0] for i in range(8)]
    for c in caches:
        arena.add(c)
    pooled, _ = count_ops(decode_step, rag.arch, caches, [5] * 8, arena)
    sdpa = [k for k in pooled.by_op if "scaled_dot_product" in k]
    assert sdpa and sum(pooled.by_op[k] for k in sdpa) == rag.arch.n_layers
    assert pooled.syncs == 0


def test_a_failed_arena_step_leaves_every_member_as_it_was(tmp_path, monkeypatch):
    """A fault part-way through an arena step (here: the third layer's attention) advances no
    member: the rows it wrote lie past every filled row, and the next step equals a clean one."""
    rag = _arena_rag(tmp_path)
    arena = DecodeArena(rag.arch)
    pairs = [_pair(rag, i) for i in range(3)]
    for a, _ in pairs:
        arena.add(a)
    members = list(arena.members)
    state = [(c.pos, list(c.n)) for c in members]
    real = DecodeArena.step_attention

    def failing(self, layer, *args):
        if layer == 2:
            raise RuntimeError("device fault")
        return real(self, layer, *args)

    monkeypatch.setattr(DecodeArena, "step_attention", failing)
    with pytest.raises(RuntimeError, match="device fault"):
        decode_step(rag.arch, members, [1, 2, 3], arena)
    monkeypatch.setattr(DecodeArena, "step_attention", real)
    assert [(c.pos, list(c.n)) for c in members] == state
    got = decode_step(rag.arch, members, [1, 2, 3], arena)
    solo = {id(a): b for a, b in pairs}
    for i, c in enumerate(members):
        alone = decode_step(rag.arch, [solo[id(c)]], [[1, 2, 3][i]])[0]
        torch.testing.assert_close(got[i], alone, atol=1e-4, rtol=1e-4)
