"""The prompt prefix cache (kvrag.query.prefix): the plain text before a prompt's first cached
chunk is computed once, from position 0, and every later fused prefill that starts with it
reads it instead of computing it -- exactly, so every policy answers as without it."""

import os

import pytest
import torch
from helpers.corpus import DOCS as CORPUS
from helpers.corpus import head_tokens

from kvrag import KVRag
from kvrag.chunk import compute_chunk_kv
from kvrag.layout.state import CACHED, PLAIN, PREFIX, Piece
from kvrag.testing import tiny_llama

DOCS = CORPUS[:3]
# benchmarks/gpu_check.sh runs the first two tests on the device (KVRAG_TEST_DEVICE=cuda).
DEVICE = os.environ.get("KVRAG_TEST_DEVICE", "cpu")
# Longer than the sliding windows below, so the prefix's own K/V are windowed too.
HEAD = "You are a careful assistant who reads every passage before answering. " * 3 + "Passages:\n\n"


def prompt(docs=DOCS, head=HEAD, question="Where does the red fox live?"):
    return head + "\n\n".join(docs) + f"\n\nQuestion: {question}\nAnswer:"


POLICIES = [
    ("naive_reuse", {}),
    ("cacheblend", {}),
    ("cacheblend", {"deviation": "attention"}),
    ("epic", {}),
    ("kvlink", {"mode": "untrained"}),
    ("kvlink", {"mode": "untrained", "recompute_ratio": 0.2, "deviation": "attention"}),
    ("samkv", {}),
    ("a3", {}),
    ("prophetkv", {}),
]
MODELS = [
    ("llama", {}),
    ("mistral", {"sliding_window": 12}),
    ("gemma3_text", {"sliding_window": 16}),
]


@pytest.fixture(scope="module", params=MODELS, ids=[m for m, _ in MODELS])
def rags(request, tmp_path_factory):
    """(with the prefix cache, without) over one model and one store."""
    model_type, overrides = request.param
    h = tiny_llama(seed=0, model_type=model_type, device=DEVICE, **overrides)
    store = tmp_path_factory.mktemp("kv")
    on = KVRag(h, cache_dir=store, hot_cache=0)
    off = KVRag(h, cache_dir=store, hot_cache=0, prefix_cache=0)
    on.precompute(DOCS)
    return on, off


@pytest.mark.parametrize("policy,params", POLICIES, ids=[f"{p}{sorted(k.items())}" for p, k in POLICIES])
def test_every_policy_prefills_as_without_it(rags, policy, params):
    on, off = rags
    text = prompt()
    n_head = head_tokens(on, text)
    window = max((w for w in on.arch.windows if w is not None), default=0)
    assert n_head > window
    want = off.prefill(text, policy, **params)
    assert want.stats.prefix_tokens == 0
    for _ in range(2):  # computed on the first call, read on the second
        got = on.prefill(text, policy, **params)
        s = got.stats
        assert s.prefix_tokens == n_head and s.read_tokens == s.cached_tokens + n_head
        assert s.cached_tokens == want.stats.cached_tokens > 0
        assert s.computed_tokens == want.stats.computed_tokens - n_head
        assert got.prompt_ids == want.prompt_ids
        # Equal up to float rounding: the prefix rows' matrix products run in another batch.
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        assert int(got.logits.argmax()) == int(want.logits.argmax())
        assert s.recomputed_tokens == want.stats.recomputed_tokens  # the same selection


EXACT = [
    ("cacheblend", {"recompute_ratio": 1.0}),
    ("cacheblend", {"recompute_ratio": 1.0, "deviation": "attention"}),
    ("epic", {"k_head": 10_000}),
    ("a3", {"recompute_ratio": 1.0}),
    ("samkv", {"recompute_ratio": 1.0, "keep_ratio": 1.0, "adaptive_p": False, "update": "overwrite"}),
]


def test_exact_limits_still_generate_as_full_prefill(rags):
    on, _ = rags
    text = prompt()
    full = on.generate(text, policy="full_prefill", max_new_tokens=10)
    assert full.stats.prefix_tokens == 0  # the baseline computes its whole prompt
    for policy, params in EXACT:
        out = on.generate(text, policy=policy, max_new_tokens=10, **params)
        assert out.stats.prefix_tokens > 0, policy
        assert out.token_ids == full.token_ids, policy


def test_one_entry_per_prefix_kept_in_its_budget(tmp_path):
    h = tiny_llama(seed=0)
    rag = KVRag(h, cache_dir=tmp_path / "kv", hot_cache=0)
    rag.precompute(DOCS)
    a, b = prompt(), prompt(head="Read the passages, then answer in a few words.\n\n")
    rag.prefill(a, "naive_reuse")
    rag.prefill(a, "cacheblend")  # another policy, the same prefix
    st = rag.prefixes.stats()
    assert (st["entries"], st["hits"], st["misses"]) == (1, 1, 1)
    rag.prefill(b, "naive_reuse")
    assert rag.prefixes.stats()["entries"] == 2
    # Each entry is its K and V in the model's dtype.
    per_token = 2 * h.arch.n_layers * h.arch.n_kv_heads * h.arch.head_dim * 4
    assert rag.prefixes.stats()["bytes"] == per_token * (head_tokens(rag, a) + head_tokens(rag, b))

    # A budget for one entry keeps the most recent; one smaller than an entry keeps none.
    one = KVRag(h, cache_dir=tmp_path / "kv", hot_cache=0, prefix_cache=per_token * head_tokens(rag, a))
    assert one.prefill(a, "naive_reuse").stats.prefix_tokens > 0
    assert one.prefill(b, "naive_reuse").stats.prefix_tokens > 0  # shorter: fits, evicts a
    assert one.prefixes.stats()["entries"] == 1
    none = KVRag(h, cache_dir=tmp_path / "kv", hot_cache=0, prefix_cache=per_token)
    assert none.prefill(a, "naive_reuse").stats.prefix_tokens == 0
    assert none.prefixes.stats()["entries"] == 0


def test_concurrent_prefills_share_one_entry(tmp_path):
    """Requests prefilled on several threads at once (the framework adapters' streams) read and
    fill the cache together: one entry, every prefill as a lone one."""
    from concurrent.futures import ThreadPoolExecutor

    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv", hot_cache=0)
    rag.precompute(DOCS)
    texts = [prompt(question=q) for q in ("Where does the red fox live?", "What do foxes eat?")] * 3
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda t: rag.prefill(t, "cacheblend"), texts))
    st = rag.prefixes.stats()
    assert st["entries"] == 1 and st["hits"] + st["misses"] == len(texts)
    for text, res in zip(texts, got):
        alone = rag.prefill(text, "cacheblend")
        assert res.stats.prefix_tokens == alone.stats.prefix_tokens > 0
        torch.testing.assert_close(res.logits, alone.logits, atol=1e-4, rtol=1e-4)


def test_no_prefix_where_it_would_not_be_exact_or_there_is_none(tmp_path):
    # LongRoPE picks its frequencies from the sequence length: a prefix computed alone would
    # carry another length's tables.
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 16,
        "short_factor": [1.0] * 8,
        "long_factor": [1.0 + 0.5 * i for i in range(8)],
    }
    h = tiny_llama(seed=0, rope_parameters=rope)
    rag = KVRag(h, cache_dir=tmp_path / "kv", hot_cache=0)
    rag.precompute(DOCS)
    s = rag.prefill(prompt(), "naive_reuse").stats
    assert s.cached_tokens > 0 and s.prefix_tokens == 0 and not rag.prefixes.enabled

    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv2", hot_cache=0)
    rag.precompute(DOCS)
    s = rag.prefill(prompt(head=""), "naive_reuse").stats  # the prompt opens with a chunk
    pieces, _ = rag.pieces(rag.render(prompt(head="")))
    assert pieces[0].kind == CACHED and s.prefix_tokens == 0
    s = rag.prefill("Nothing cached here at all.", "naive_reuse").stats  # the full-prefill path
    assert s.prefix_tokens == 0 and s.cached_tokens == 0


def test_leading_plain_pieces_become_one_prefix(tmp_path):
    """A tokenizer's BOS and the template's text arrive as two plain pieces: the prefix is both,
    computed together from position 0."""
    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv", hot_cache=0)
    rag.precompute(DOCS)
    pieces, _ = rag.pieces(rag.render(prompt()))
    assert pieces[0].kind == PLAIN and pieces[1].kind == CACHED
    head = pieces[0].token_ids
    split = [Piece(head[:1]), Piece(head[1:]), *pieces[1:]]
    out = rag.prefixes.attach(split)
    assert [p.kind for p in out] == [PREFIX] + [p.kind for p in pieces[1:]]
    assert torch.equal(out[0].token_ids, head)
    ((keys, values),) = compute_chunk_kv(rag.arch, [head.tolist()])
    torch.testing.assert_close(out[0].entry.keys, keys, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[0].entry.values, values, atol=1e-6, rtol=1e-6)
    assert rag.prefixes.attach(pieces)[0].entry is out[0].entry  # the same tokens: one entry
    assert rag.prefixes.attach(pieces[1:]) == pieces[1:]  # no leading plain text: nothing to keep


def test_prefix_pieces_are_marked_and_bad_budgets_named(tmp_path):
    rag = KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv", hot_cache=0)
    rag.precompute(DOCS)
    prep = rag.prepare(prompt(), "naive_reuse")
    assert prep.layout.pieces[0].kind == PREFIX
    assert int(prep.layout.stored.sum()) == int(prep.layout.cached.sum()) + head_tokens(rag, prompt())
    for bad in (-1, 1.5, "64MB"):
        with pytest.raises((ValueError, TypeError), match="prefix_cache"):
            KVRag(tiny_llama(seed=0), cache_dir=tmp_path / "kv", prefix_cache=bad)
