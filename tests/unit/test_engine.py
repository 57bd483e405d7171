"""KVRag facade end to end on a tiny random-weight model with the real SmolLM2 tokenizer."""

import json
import os

import pytest
import torch
from helpers.corpus import DOCS as CORPUS
from helpers.corpus import hf_greedy, prompt_for
from helpers.splice import sentencepiece_style_tokenizer

from kvrag.engine import KVRag
from kvrag.errors import ChunkError
from kvrag.layout.state import CACHED, PLAIN
from kvrag.query.decode import Sampling, adjust_logits
from kvrag.testing import tiny_llama

DOCS = CORPUS[:3]


def test_full_prefill_equals_transformers_generate(rag, handle):
    rag.precompute(DOCS)
    out = rag.generate(prompt_for(DOCS), policy="full_prefill", max_new_tokens=12)
    assert out.stats.cached_tokens == 0 and out.stats.prompt_tokens == len(out.prompt_ids)
    assert out.token_ids == hf_greedy(handle.model, out.prompt_ids, len(out.token_ids))


def test_policy_ratio_one_equals_full_prefill(rag):
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=10)
    blend = rag.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=10)
    assert blend.stats.chunks_hit == 3 and blend.stats.cached_tokens > 0
    assert blend.prompt_ids == full.prompt_ids
    assert blend.token_ids == full.token_ids
    cont = full.token_ids[:6]
    lf, _ = rag.continuation_logits(prompt, cont, policy="full_prefill")
    lb, _ = rag.continuation_logits(prompt, cont, policy="cacheblend", recompute_ratio=1.0)
    torch.testing.assert_close(lb, lf, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "model_type,overrides,windowed",
    [
        ("mistral", {"sliding_window": 12}, True),  # every layer windowed (Mistral-7B-v0.1 style)
        ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 2}, True),  # upper layers
        ("smollm3", {}, False),  # layer 3 of 4 without RoPE
        # Gemma 3: local layers with a 16-token window (the prompt is ~6x longer: cached chunks lie
        # wholly beyond it, decoding runs past it) between global layers of another RoPE base.
        ("gemma3_text", {"sliding_window": 16}, True),
        ("gemma2", {"sliding_window": 16}, True),  # alternating windows, soft-capped attention and logits
        # A stray window in a Llama config (llamafied Qwen checkpoints): Llama's attention ignores it.
        ("llama", {"sliding_window": 12, "use_sliding_window": False}, False),
    ],
)
def test_window_and_nope_models_generate_like_the_model(tmp_path, model_type, overrides, windowed):
    """Sliding windows and NoPE layers are honoured by the chunk prefill, the fused prefill and
    decoding: full_prefill == the model's own forward, and every exact limit of a policy (the
    whole prompt recomputed) generates the same tokens from the cache."""
    h = tiny_llama(seed=0, model_type=model_type, **overrides)
    assert any(w for w in h.arch.windows) == windowed
    if model_type == "smollm3":
        assert not all(h.arch.rope_layers)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=12)
    assert len(full.prompt_ids) > 12 * 4  # the window binds
    if windowed or model_type != "llama":
        assert full.token_ids == hf_greedy(h.model, full.prompt_ids, len(full.token_ids))
    else:  # transformers' generate crops its cache to the stray window; the model's forward does not
        ids = list(full.prompt_ids)
        with torch.no_grad():
            for _ in full.token_ids:
                ids.append(int(h.model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert full.token_ids == ids[len(full.prompt_ids) :]
    exact = [
        ("cacheblend", {"recompute_ratio": 1.0}),
        ("a3", {"recompute_ratio": 1.0}),
        ("epic", {"k_head": 10_000}),
        ("samkv", {"recompute_ratio": 1.0, "keep_ratio": 1.0, "adaptive_p": False, "update": "overwrite"}),
    ]
    for policy, params in exact:
        out = rag.generate(prompt, policy=policy, max_new_tokens=12, **params)
        assert out.stats.chunks_hit == 3, policy
        assert out.token_ids == full.token_ids, policy


@pytest.mark.parametrize("policy,params", [("samkv", {}), ("a3", {"evict_budget": 9})])
def test_decoding_a_thinned_cache_windows_by_position(tmp_path, policy, params):
    """SamKV and A3's eviction hand the decoder a cache whose slots are not the positions 0..M-1.
    A sliding window must still be applied by position (HF's cache would apply it by slot)."""
    from kvrag.policies import get_policy
    from kvrag.query.decode import FusedStepper, HFStepper

    class ReadAll:  # kvrag's layer step with no decode-time selection: windows by key position
        decode_select = None

    h = tiny_llama(seed=0, model_type="mistral", sliding_window=8)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS[:2])
    prompt = "Answer.\n\n" + DOCS[0] + "\n\n" + DOCS[1]  # a short question: the window spans kept gaps
    out = rag.generate(prompt, policy=policy, max_new_tokens=6, **params)
    pol = get_policy(policy, **params)
    res = rag.fusion.prefill(rag.fusion.apply_insertions(rag.pieces(prompt)[0], pol), pol, keep_state=True)
    pos = res.positions if res.positions.dim() == 1 else res.positions[0, 0]
    assert pos.numel() < res.next_position  # thinned
    ref = FusedStepper(rag.arch, res.K, res.V, res.next_position, ReadAll, res.state, res.positions)
    by_slot = HFStepper(h.model, res.K, res.V, res.next_position)
    toks = [int(res.logits.argmax())]
    for _ in range(5):
        logits = ref.step([toks[-1]])[-1]
        if len(toks) == 1:  # the test can tell: windowing by slot reads other keys
            assert (by_slot.step([toks[-1]])[-1] - logits).abs().max() > 1e-2
        toks.append(int(logits.argmax()))
    assert out.token_ids == toks


def test_every_policy_reads_the_tokenizers_own_ids_of_the_prompt(rag, handle):
    """The prompt's ids are the tokenizer's for the whole prompt (what a user's own pipeline
    feeds the model), for full_prefill and reuse alike: segment-wise tokenization would spell
    the "\n\n" separators as one token where the tokenizer, reading on, writes two."""
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    canonical = handle.tokenizer(prompt)["input_ids"]
    parts = prompt.split(DOCS[0])[0], DOCS[0], "\n\n", DOCS[1], "\n\n", DOCS[2], prompt.split(DOCS[2])[1]
    assert "".join(parts) == prompt and [t for x in parts for t in handle.encode(x)] != canonical
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=10)
    assert full.prompt_ids == canonical
    assert full.token_ids == hf_greedy(handle.model, canonical, len(full.token_ids))
    for policy in ("naive_reuse", "cacheblend"):
        out = rag.generate(prompt, policy=policy, max_new_tokens=4)
        assert out.prompt_ids == canonical and out.stats.chunks_hit == 3
        assert out.stats.cached_tokens == sum(len(rag.chunk_ids(d)) for d in DOCS)


def test_a_short_chunk_inside_words_is_not_loaded(rag, handle, monkeypatch):
    """A one-word chunk found inside longer words ("fox" in "foxes") holds no whole prompt
    token: it is counted as unaligned without reading its entry from disk; found as a word
    of its own it is served."""
    rag.precompute(["fox", DOCS[1]])
    reads = []
    get = rag.store.get
    monkeypatch.setattr(rag.store, "get", lambda key, fp, **kw: reads.append(key) or get(key, fp, **kw))
    out = rag.generate("Foxes: the foxes and " + DOCS[1] + "\nQ: ok?", policy="naive_reuse", max_new_tokens=1)
    assert out.stats.chunks_hit == 1 and out.stats.chunks_unaligned == 1 and len(reads) == 1
    out = rag.generate("A word:\nfox\n" + DOCS[1], policy="naive_reuse", max_new_tokens=1)
    assert out.stats.chunks_hit == 2 and out.stats.chunks_unaligned == 0


def test_chunk_edges_the_prompt_tokenizes_otherwise_are_computed(rag, handle):
    """A chunk whose first token merges with a preceding space, or whose last merges with the
    line break after it, is reused for the tokens both tokenizations share; its edge tokens
    are computed, so the prompt's ids stay the tokenizer's and ratio 1.0 stays exact."""
    docs = [DOCS[0], DOCS[1] + " ", DOCS[2]]
    rag.precompute(docs)
    prompt = "Context: " + docs[0] + "\n\n" + docs[1] + "\nMore: " + docs[2] + "\nQuestion: Where does the fox live?"
    canonical = handle.tokenizer(prompt)["input_ids"]
    out = rag.generate(prompt, policy="naive_reuse", max_new_tokens=4)
    s = out.stats
    assert out.prompt_ids == canonical
    assert s.chunks_hit == 3 and s.chunks_unaligned == 0
    # " The" / " Mount"-style first tokens (docs 0 and 2) and doc 1's trailing space are computed.
    lens = [len(rag.chunk_ids(d)) for d in docs]
    assert sum(lens) - 3 <= s.cached_tokens < sum(lens)
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=8)
    exact = rag.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=8)
    assert exact.token_ids == full.token_ids and exact.stats.chunks_hit == 3


@pytest.mark.parametrize(
    "doc",
    [
        "Привет мир: a Russian greeting used in many programming tutorials online.",
        "東京タワー is a communications and observation tower in the Shiba-koen district.",
        "ñandú is the Spanish name of the rhea, a large flightless bird of South America.",
    ],
)
@pytest.mark.parametrize("lead", ["- ", "1. ", "Context: "])
def test_a_chunk_starting_with_a_multibyte_letter_after_a_space_is_served(rag, doc, lead):
    """Byte-level BPE spells a multi-byte first letter as several tokens starting at that
    character, and after a space the prompt merges its first byte with the space (" П" ->
    "ĠÐ", "Ł"; the chunk alone has "Ð", "Ł"): the chunk is still served from the first token
    both spellings share, not dropped as unaligned."""
    rag.precompute([doc])
    prompt = lead + doc + "\nQuestion: what is it?"
    pieces, stats = served(rag, prompt)
    n = len(rag.chunk_ids(doc))
    assert stats.chunks_unaligned == 0
    ((key, (a, b), _),) = pieces
    assert key == rag.chunk_key(doc) and 1 <= a <= 3 and b == n
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=6)
    exact = rag.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=6)
    assert exact.stats.chunks_hit == 1 and exact.token_ids == full.token_ids


def served(rag, prompt):
    """(key, span, ids) of each cached piece of ``prompt``; checks that the pieces spell the
    prompt's own ids and that each cached piece's ids are its chunk's ids on its span."""
    pieces, stats = rag.pieces(prompt)
    ids = [t for p in pieces for t in p.token_ids.tolist()]
    assert ids == rag.tokenizer(prompt)["input_ids"]
    out = []
    for p in pieces:
        if p.entry is not None:
            a, b = p.span
            assert p.token_ids.tolist() == rag.chunk_ids(p.entry.text)[a:b]
            out.append((p.key, p.span, p.token_ids.tolist()))
    return out, stats


def test_a_chunk_cut_by_the_framework_is_served_for_its_prefix(rag, handle):
    """A framework that cuts a chunk to fit its window (LlamaIndex repacking, a ``[:n]`` in a
    format function) leaves the chunk's beginning in the prompt: its tokens are served from
    the cache -- exactly, a token's K/V depending only on the tokens before it -- up to the
    last whole token the prompt shares with the chunk; the rest of the prompt is computed."""
    long_doc = DOCS[0] + " Its den is dug under the roots of old oaks, and a litter of cubs is born in spring."
    rag.precompute([long_doc, DOCS[1]])
    cut = long_doc[:100]  # ends inside a word ("...old oa")
    assert not cut.endswith(" ") and long_doc[100] != " "
    prompt = "Context:\n" + cut + "\n\n" + DOCS[1] + "\n\nQuestion: where?"
    pieces, stats = served(rag, prompt)
    assert stats.chunks_partial == 1 and stats.chunks_unaligned == 0
    (k0, span0, ids0), (k1, span1, _) = pieces
    assert k0 == rag.chunk_key(long_doc) and span0[0] == 0
    # Up to the last token wholly inside the cut: " oa" is not the chunk's " oaks".
    assert ids0 == rag.chunk_ids(long_doc)[: span0[1]] and rag.tokenizer.decode(ids0) == cut[: cut.rfind(" ")]
    assert k1 == rag.chunk_key(DOCS[1]) and span1 == (0, len(rag.chunk_ids(DOCS[1])))
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=8)
    exact = rag.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=8)
    assert exact.stats.chunks_hit == 2 and exact.stats.chunks_partial == 1
    assert exact.prompt_ids == full.prompt_ids and exact.token_ids == full.token_ids
    # Less than 64 characters of it left: not worth a load, computed.
    _, stats = served(rag, "Context:\n" + long_doc[:50] + "\nQ?")
    assert stats.chunks_partial == 0


def test_a_chunk_whose_edge_whitespace_was_trimmed_is_served(rag, handle):
    """Documents often carry leading/trailing whitespace (loaders, hand-made chunks) and chains
    or chat templates strip it (``d.page_content.strip()``, Llama 3's ``| trim``): the chunk is
    served from its first non-whitespace token on, and never beyond the prompt's text."""
    padded = "\n\n" + DOCS[2] + "  \n\n"
    spaced = "\n\t " + DOCS[0] + "\n"
    rag.precompute([padded, spaced])
    prompt = "Context:\n" + padded.strip() + "\n" + spaced.strip() + "\nQuestion: where?"
    pieces, stats = served(rag, prompt)
    assert stats.chunks_partial == 2 and len(pieces) == 2
    (key, (a, b), ids), (key2, (a2, _), ids2) = pieces
    assert key == rag.chunk_key(padded) and a > 0
    assert rag.tokenizer.decode(ids) == DOCS[2]
    # Stored, its first word was " The" (merged with the space before it); the prompt's "The"
    # is another token: served from the next shared boundary on (to its own "\n", which the
    # prompt has too).
    assert key2 == rag.chunk_key(spaced) and rag.tokenizer.decode(ids2) == DOCS[0][len("The") :] + "\n"
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=8)
    exact = rag.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=8)
    assert exact.stats.chunks_hit == 2 and exact.token_ids == full.token_ids


def test_a_different_chunk_sharing_a_beginning_is_served_only_where_equal(rag, handle):
    """Two versions of a text that part after their first sentence: only the shared tokens
    come from the cache, the rest is the prompt's own text, computed."""
    v1 = DOCS[1] + " It was first climbed in 1871 by three guides from Oster."
    v2 = DOCS[1] + " It has never been climbed in winter, the guides of Oster say."
    rag.precompute([v1])
    pieces, stats = served(rag, "Context:\n" + v2 + "\nQ?")
    ((key, (a, b), ids),) = pieces
    assert key == rag.chunk_key(v1) and a == 0 and stats.chunks_partial == 1
    assert rag.tokenizer.decode(ids) == DOCS[1] + " It"


def test_a_cut_chunk_does_not_swallow_the_start_of_the_next_chunk(rag, handle):
    """A chunk cut at a paragraph break whose next paragraph starts like the chunk the prompt
    goes on with: the cut chunk is served up to the cut, the next chunk whole (its beginning
    is not taken by the cut chunk's matching tail)."""
    a = DOCS[0] + "\n\nThe den is dug under the roots of old oaks, and cubs are born in spring."
    b = DOCS[2]  # "The river Lenne ..."
    rag.precompute([a, b])
    prompt = "Context:\n" + DOCS[0] + "\n\n" + b + "\n\nQuestion: where?"
    pieces, stats = served(rag, prompt)
    assert [k for k, _, _ in pieces] == [rag.chunk_key(a), rag.chunk_key(b)]
    assert pieces[1][1] == (0, len(rag.chunk_ids(b))) and stats.chunks_partial == 1


def test_sentencepiece_style_chunks_are_reused_without_the_first_word_mark(tmp_path):
    """Alone, such a tokenizer writes a chunk as "▁The ..."; inside a prompt, after a line
    break, as "The ...". Chunks are stored in the second spelling, so the prompt's own ids
    hold them and they are reused — and the ids stay the tokenizer's."""
    tok = sentencepiece_style_tokenizer()
    h = tiny_llama(seed=1, tokenizer=tok)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    doc = DOCS[0]
    assert h.encode(doc)[0] == tok.convert_tokens_to_ids("▁") and rag.chunk_ids(doc) == h.encode(doc)[1:]
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=8)
    assert full.prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
    assert full.token_ids == hf_greedy(h.model, full.prompt_ids, len(full.token_ids))
    out = rag.generate(prompt, policy="naive_reuse", max_new_tokens=4)
    assert out.stats.chunks_hit == 3 and out.stats.chunks_unaligned == 0
    assert out.stats.cached_tokens == sum(len(rag.chunk_ids(d)) for d in DOCS)
    exact = rag.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=8)
    assert exact.prompt_ids == full.prompt_ids and exact.token_ids == full.token_ids


def test_no_cached_chunk_takes_full_prefill_path(rag):
    prompt = prompt_for(DOCS)  # nothing precomputed
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=8)
    naive = rag.generate(prompt, policy="naive_reuse", max_new_tokens=8)
    assert naive.stats.chunks_hit == 0 and naive.stats.cached_tokens == 0
    assert naive.token_ids == full.token_ids


def test_naive_reuse_uses_cache_and_counts(rag):
    rag.precompute(DOCS[:2])
    out = rag.generate(prompt_for(DOCS), policy="naive_reuse", max_new_tokens=4)
    s = out.stats
    assert s.chunks_hit == 2 and s.recompute_fraction == 0.0
    assert s.cached_tokens == sum(len(rag.chunk_ids(d)) for d in DOCS[:2])
    # The text before the first chunk (the template's head) is read from the prefix cache.
    pieces, _ = rag.pieces(rag.render(prompt_for(DOCS)))
    assert pieces[0].kind == PLAIN and pieces[1].kind == CACHED
    assert s.prefix_tokens == len(pieces[0].token_ids) > 0
    assert s.computed_tokens == s.prompt_tokens - s.cached_tokens - s.prefix_tokens
    assert s.bytes_loaded > 0 and s.ttft_s > 0


def test_continuation_logits_match_model(rag, handle):
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=5)
    logits, _ = rag.continuation_logits(prompt, full.token_ids, policy="full_prefill")
    with torch.no_grad():
        ref = handle.model(torch.tensor([full.prompt_ids + full.token_ids])).logits[0, len(full.prompt_ids) - 1 :]
    torch.testing.assert_close(logits, ref.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", ["full_prefill", "cacheblend", "a2ats"])
def test_several_continuations_from_one_prefill(rag, policy, tmp_path):
    """The decoder rewinds between continuations (or re-prefills for a policy with decode-time
    state): each continuation's logits equal those of its own fresh prefill."""
    params = {}
    if policy == "a2ats":  # needs codebooks for this model; window 4 so top-k retrieval runs
        from kvrag.policies.a2ats.calibrate import calibrate

        _, path = calibrate(
            rag.handle,
            texts=[" ".join(DOCS) * 8],
            n_tokens=300,
            n_codes=16,
            iters=2,
            seq_len=96,
            out=tmp_path / "books.safetensors",
        )
        params = {"codebook": str(path), "window": 4, "sink": 2}
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    a, b = [1, 2, 3, 4, 5], [7, 8]
    outs, _ = rag.continuations_logits(prompt, [a, b, a], policy=policy, **params)
    for ids, got in zip([a, b, a], outs):
        ref, _ = rag.continuation_logits(prompt, ids, policy=policy, **params)
        assert got.shape == (1 + len(ids), ref.shape[1])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_stream_rejects_bad_options_at_the_call(rag):
    """Not at the first next(): a stream handed on unread would fail far from its cause."""
    for kw, msg in (
        (dict(policy="bogus"), "bogus"),
        (dict(recompute_ratio="0.5"), "recompute_ratio"),
        (dict(stop=""), "stop"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(logit_bias={5: 101}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={10**9: 1.0}), "vocabulary"),
    ):
        with pytest.raises(ValueError, match=msg):
            rag.stream("Hello", **kw)
    with pytest.raises(TypeError):
        rag.stream(b"Hello")
    with pytest.raises(ValueError, match="max_new_tokens, not max_tokens"):
        rag.generate("Hello", max_tokens=3)


def test_stream_rejects_bad_prompts_and_model_mismatches_at_the_call(handle, tmp_path):
    """Tokenization, the context limit, a layer the model lacks and a layout the policy cannot
    serve are checked before ``stream`` returns."""
    rag = KVRag(handle, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    cases = [
        ("", {}, "empty prompt"),
        ("word " * (handle.max_context + 10), {}, "exceeds the model context"),
        (prompt, dict(policy="cacheblend", check_layers=(handle.arch.n_layers + 5,)), "check_layers"),
        (prompt, dict(policy="a3", evict_budget=1), "evict_budget=1 is smaller"),
    ]
    for text, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            rag.stream(text, **kw)
    # The call did the checking; the prefill runs at the first next(), and TTFT counts both.
    s = rag.stream(prompt, policy="a3", max_new_tokens=2)
    assert "".join(s) == s.text and s.stats.chunks_hit == 3 and s.stats.ttft_s >= s.stats.load_s > 0


def test_inserted_link_tokens_count_toward_the_context(tmp_path):
    h = tiny_llama(seed=0, max_position_embeddings=200)
    rag = KVRag(h, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    ids = rag.generate(prompt, policy="full_prefill", max_new_tokens=1).prompt_ids
    assert len(ids) <= 200 < len(ids) + 3 * 64
    with pytest.raises(ValueError, match="kvlink inserts exceeds the model context"):
        rag.stream(prompt, policy="kvlink", link_tokens=64)
    out = rag.generate(prompt, policy="kvlink", link_tokens=1, max_new_tokens=2)
    assert out.stats.chunks_hit == 3 and out.stats.inserted_tokens == 3
    # prompt_ids is the tokenizer's sequence: link tokens have no id and are not in it.
    assert out.prompt_ids == ids


@pytest.mark.parametrize("bad", [0, -5, 2.7, "3", True])
def test_bad_query_tokens_is_named_at_construction(handle, tmp_path, bad):
    with pytest.raises(ValueError, match="query_tokens"):
        KVRag(handle, cache_dir=tmp_path / "kv", query_tokens=bad)


def test_stream_matches_generate_and_stops(rag):
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    ref = rag.generate(prompt, policy="naive_reuse", max_new_tokens=16)
    s = rag.stream(prompt, policy="naive_reuse", max_new_tokens=16)
    pieces = list(s)
    assert "".join(pieces) == ref.text == s.text
    assert s.stats.ttft_s > 0 and s.stats.new_tokens == len(ref.token_ids)
    assert len(ref.text.strip()) > 3, ref.text  # the stop check below needs a few characters
    stop = ref.text.strip()[1:3]
    cut = rag.generate(prompt, policy="naive_reuse", max_new_tokens=16, stop=[stop])
    assert stop not in cut.text and ref.text.startswith(cut.text) and len(cut.text) < len(ref.text)


def test_penalties_and_logit_bias_adjust_every_draw(rag):
    """OpenAI's adjustments, greedy draws included: a bias of 100 forces its token; a frequency
    penalty counts the reply's own tokens, never the prompt's."""
    prompt = prompt_for(DOCS[:2])
    ref = rag.generate(prompt, max_new_tokens=8)
    forced = rag.tokenizer.encode(" fox", add_special_tokens=False)[0]
    assert rag.generate(prompt, max_new_tokens=3, logit_bias={forced: 100}).token_ids == [forced] * 3
    banned = ref.token_ids[0]
    assert rag.generate(prompt, max_new_tokens=8, logit_bias={banned: -100}).token_ids[0] != banned
    # The prompt's tokens are not counted: a prompt token biased to win by 1 still wins under
    # penalties that would take 4 from it.
    assert forced in rag.tokenizer.encode(prompt, add_special_tokens=False)
    first = rag.prefill(prompt).logits.float()
    bias = {forced: float(first.max() - first[forced]) + 1.0}
    pen = rag.generate(prompt, max_new_tokens=1, logit_bias=bias, frequency_penalty=2.0, presence_penalty=2.0)
    assert pen.token_ids == [forced] != ref.token_ids[:1]
    logits = torch.randn(50)
    logits[7] = float("-inf")
    s = Sampling(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 1.0, 7: 100.0})
    out = adjust_logits(logits, s, [3, 3, 4])
    want = logits.clone()
    want[3] += -2 * 0.25 - 0.5 + 1.0
    want[4] += -0.25 - 0.5
    assert torch.equal(out[torch.arange(50) != 7], want[torch.arange(50) != 7]) and out[7] == float("-inf")
    assert adjust_logits(logits, Sampling(), [3]) is logits


def test_an_answer_held_to_a_json_schema_is_a_valid_document(rag):
    prompt = prompt_for(DOCS[:2])
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    got = rag.generate(prompt, max_new_tokens=40, json_schema=schema)
    assert got.finish_reason == "stop"  # the document is complete: nothing may follow
    doc = json.loads(got.text)
    assert doc["answer"] in ("yes", "no") and isinstance(doc["n"], int)
    assert "".join(rag.stream(prompt, max_new_tokens=40, json_schema=schema)) == got.text
    assert rag.generate(prompt, max_new_tokens=3, json_schema={"type": "object"}).text.startswith("{")
    with pytest.raises(ValueError, match="JSON schema"):
        rag.stream(prompt, json_schema={"type": "nonsense"})


def test_bad_chunks_rejected(rag, handle):
    with pytest.raises(ChunkError, match="empty"):
        rag.precompute(["   \n"])
    with pytest.raises(ChunkError, match="exceeds the model context"):
        rag.precompute(["word " * (handle.max_context + 10)])
    assert rag.store.stats()["entries"] == 0


def test_a_bad_text_in_a_batch_is_named_by_its_position(rag):
    with pytest.raises(ChunkError, match=r"text 1 of 3 \('   '\): empty"):
        rag.precompute([DOCS[0], "   ", DOCS[1]])
    assert rag.store.stats()["entries"] == 0  # checked before any work


def test_kv_that_overflow_the_storage_dtype_are_not_stored(tmp_path):
    h = tiny_llama(seed=0)
    with torch.no_grad():
        for layer in h.model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1e6)  # keys far beyond float16's 65504
    rag = KVRag(h, cache_dir=tmp_path / "kv", storage_dtype="float16")
    with pytest.raises(ChunkError, match="not finite in float16"):
        rag.precompute(DOCS[:1])
    assert rag.store.stats()["entries"] == 0
    assert KVRag(h, cache_dir=tmp_path / "kv32", storage_dtype="float32").precompute(DOCS[:1])


def test_bad_input_names_the_problem_and_stores_nothing(rag, handle, tmp_path):
    # A bare string is one text, not an iterable of one-character chunks.
    with pytest.raises(TypeError, match="single str"):
        rag.precompute(DOCS[0])
    # A lone surrogate is not Unicode: named, not the tokenizer's obscure TypeError.
    with pytest.raises(ChunkError, match="surrogate"):
        rag.precompute(["Kelvar \udcff peak"])
    with pytest.raises(ChunkError, match="surrogate"):
        rag.is_cached("Kelvar \udcff peak")
    assert rag.store.stats()["entries"] == 0
    rag.precompute(DOCS)
    for prompt, err, msg in [
        ("Question \udcff?", ValueError, "surrogate"),
        (b"bytes", TypeError, "bytes"),
        (None, TypeError, "NoneType"),
        (5, TypeError, "int"),
    ]:
        with pytest.raises(err, match=msg):
            rag.generate(prompt, max_new_tokens=1)
    for kw, msg in [
        (dict(max_new_tokens=-1), "max_new_tokens"),  # (None is unnamed: the default, cut to the room)
        (dict(max_new_tokens="3"), "max_new_tokens"),
        (dict(top_k=-1, temperature=1.0), "top_k"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(stop=[3]), "stop"),
        (dict(recompute_ratio="0.5"), "recompute_ratio"),
        (dict(recompute_ratio=True), "recompute_ratio"),
    ]:
        with pytest.raises(ValueError, match=msg):
            rag.generate(prompt_for(DOCS), **kw)
    assert rag.generate(prompt_for(DOCS), max_new_tokens=2, stop=None).stats.chunks_hit == 3
    # A constructor refusing its options leaves the store as it was (no size limit recorded).
    before = rag.store.size_limit
    for kw, msg in ((dict(storage_dtype="fp16"), "storage_dtype"), (dict(ingest_policies=["typo"]), "typo")):
        with pytest.raises(ValueError, match=msg):
            KVRag(handle, cache_dir=tmp_path / "kv", size_limit=20_000, **kw)
        with pytest.raises(ValueError, match=msg):
            KVRag(handle, cache_dir=tmp_path / "fresh", size_limit=20_000, **kw)
    assert not (tmp_path / "fresh").exists()
    assert KVRag(handle, cache_dir=tmp_path / "kv").store.size_limit == before
    assert rag.store.stats()["entries"] == 3


def test_corrupt_blob_falls_back_to_recompute(rag, tmp_path):
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    ref = rag.generate(prompt, policy="naive_reuse", max_new_tokens=6)
    # Damage every blob file on disk: loads must be refused and the chunks computed instead.
    blobs = [p for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.stat().st_size > 4096]
    assert blobs
    for p in blobs:
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    # The hot tier still holds the chunks this KVRag served: a key names its content, so the
    # in-memory copies are served (the disk is not read) and the answer is unchanged.
    hot = rag.generate(prompt, policy="naive_reuse", max_new_tokens=6)
    assert hot.stats.chunks_hot == 3 and hot.token_ids == ref.token_ids
    # Without it (another process, or the tier emptied) every damaged blob is refused.
    rag.hot.clear()
    out = rag.generate(prompt, policy="naive_reuse", max_new_tokens=6)
    full = rag.generate(prompt, policy="full_prefill", max_new_tokens=6)
    assert out.stats.chunks_hit == 0 and out.stats.chunks_missed == 3
    assert out.token_ids == full.token_ids
    assert ref.stats.chunks_hit == 3 and ref.stats.chunks_hot == 0


def test_hot_tier_serves_repeated_chunks_from_memory_within_its_budget(handle, tmp_path):
    """A chunk served once is kept on the compute device in the compute dtype; the next prompt
    gets it without a disk read, with the same K/V (hence the same answer), and the tier never
    holds more bytes than its budget (least recently used dropped first)."""
    cold = KVRag(handle, cache_dir=tmp_path / "kv", hot_cache=0, storage_dtype="float16")
    cold.precompute(DOCS)
    prompt = prompt_for(DOCS)
    ref = cold.generate(prompt, policy="naive_reuse", max_new_tokens=6)
    again = cold.generate(prompt, policy="naive_reuse", max_new_tokens=6)
    assert again.stats.chunks_hot == 0 and len(cold.hot) == 0
    one_chunk = max(cold.store.get(cold.chunk_key(d), cold.fingerprint).keys.numel() for d in DOCS) * 4 * 2
    rag = KVRag(handle, cache_dir=tmp_path / "kv", hot_cache=2 * one_chunk, storage_dtype="float16")
    first = rag.generate(prompt, policy="naive_reuse", max_new_tokens=6)
    assert first.stats.chunks_hit == 3 and first.stats.chunks_hot == 0
    st = rag.hot.stats()
    assert st["entries"] == 2 and st["bytes"] <= 2 * one_chunk  # three served, two fit
    kept = [d for d in DOCS if rag.hot.get(rag.chunk_key(d)) is not None]
    assert kept == DOCS[1:]  # the least recently served one went first
    entry = rag.hot.get(rag.chunk_key(DOCS[1]))
    assert entry.keys.dtype == handle.dtype and entry.keys.device == handle.device
    second = rag.generate(prompt, policy="naive_reuse", max_new_tokens=6)
    assert second.stats.chunks_hit == 3 and second.stats.chunks_hot >= 1
    assert first.token_ids == second.token_ids == ref.token_ids
    for bad in (-1, "lots", 1.5, True):
        with pytest.raises(ValueError, match="hot_cache"):
            KVRag(handle, cache_dir=tmp_path / "kv", hot_cache=bad)


def test_hot_tier_in_host_memory_and_bad_tier_names(handle, tmp_path):
    """hot_tier="host" keeps served chunks in host RAM (page-locked only beside a CUDA device;
    on a CPU it is the compute device's memory) with the same answer; its "auto" budget beside
    a GPU is a tenth of the machine's RAM, at least 1 GiB (on a CPU: 1 GiB, as the device
    tier's). An unknown tier fails before the model load."""
    from kvrag.store.hot import AUTO_CPU_BYTES, hot_device, resolve_budget

    assert hot_device("host", torch.device("cpu")) == (torch.device("cpu"), False)
    assert hot_device("host", torch.device("cuda", 0)) == (torch.device("cpu"), True)
    assert hot_device("device", torch.device("cuda", 0)) == (torch.device("cuda", 0), False)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert resolve_budget("auto", torch.device("cpu"), beside_gpu=True) == max(AUTO_CPU_BYTES, ram // 10)
    assert resolve_budget("auto", torch.device("cpu")) == AUTO_CPU_BYTES
    rag = KVRag(handle, cache_dir=tmp_path / "kv", hot_tier="host")
    assert rag.hot.budget == AUTO_CPU_BYTES
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    first = rag.generate(prompt, policy="naive_reuse", max_new_tokens=4)
    again = rag.generate(prompt, policy="naive_reuse", max_new_tokens=4)
    assert first.stats.chunks_hot == 0 and again.stats.chunks_hot == 3 and again.token_ids == first.token_ids
    assert not rag.hot.pin and all(e.keys.device.type == "cpu" for e in rag.hot.values())
    with pytest.raises(ValueError, match="hot_tier must be one of device, host, got 'gpu'"):
        KVRag("no/such/model/dir", cache_dir=tmp_path / "kv", hot_tier="gpu")


def test_hot_tier_keeps_copies_not_views_of_the_blob_files(handle, tmp_path):
    """Disk reads are views of the blob files' mappings. The hot tier keeps its own copy even
    where no conversion is needed (storage dtype == compute dtype on the CPU): a kept view would
    hold one open file per chunk (a process runs out of descriptors) and the disk space of
    evicted blobs. So serving chunks leaves no file open, and evicting them frees their files."""
    import os

    def open_blobs():  # descriptors of this store's blob files (a mapping holds one)
        blobs = str(tmp_path / "kv" / "blobs")
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return sum(1 for target in links if target.startswith(blobs) and target.endswith(".val"))

    rag = KVRag(handle, cache_dir=tmp_path / "kv", storage_dtype=str(handle.dtype).split(".")[1], hot_cache=1 << 30)
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    out = rag.generate(prompt, policy="naive_reuse", max_new_tokens=4)
    assert out.stats.chunks_hit == 3 and out.stats.chunks_hot == 0 and len(rag.hot) == 3
    assert open_blobs() == 0
    for d in DOCS:
        kept, read = rag.hot.get(rag.chunk_key(d)), rag.store.get(rag.chunk_key(d), rag.fingerprint)
        assert kept.keys.dtype == read.keys.dtype and torch.equal(kept.keys, read.keys)
        assert kept.keys.untyped_storage().data_ptr() != read.keys.untyped_storage().data_ptr()
    again = rag.generate(prompt, policy="naive_reuse", max_new_tokens=4)
    assert again.stats.chunks_hot == 3 and again.token_ids == out.token_ids


def test_other_model_never_hits(handle, tmp_path):
    a = KVRag(handle, cache_dir=tmp_path / "kv")
    a.precompute(DOCS)
    b = KVRag(tiny_llama(seed=1), cache_dir=tmp_path / "kv")
    assert b.fingerprint != a.fingerprint
    out = b.generate(prompt_for(DOCS), policy="naive_reuse", max_new_tokens=3)
    assert out.stats.chunks_hit == 0 and out.stats.cached_tokens == 0


def test_chunks_are_precomputed_behind_the_anchor_and_keyed_by_it(handle, tmp_path):
    from kvrag.chunk import compute_chunk_kv

    auto = KVRag(handle, cache_dir=tmp_path / "kv")
    none = KVRag(handle, cache_dir=tmp_path / "kv", chunk_anchor="none")
    bos = handle.tokenizer.bos_token_id
    assert auto.anchor == [bos] and none.anchor == []
    assert none.fingerprint == handle.fingerprint != auto.fingerprint
    auto.precompute(DOCS[:1])
    # Same store, other anchor: a miss (computed again), never the other one's K/V.
    assert auto.is_cached(DOCS[0]) and not none.is_cached(DOCS[0])
    none.precompute(DOCS[:1])
    ids = auto.chunk_ids(DOCS[0])
    ea = auto.store.get(auto.chunk_key(DOCS[0]), auto.fingerprint)
    en = none.store.get(none.chunk_key(DOCS[0]), none.fingerprint)
    assert ea.token_ids.tolist() == en.token_ids.tolist() == ids
    ka, va = compute_chunk_kv(auto.arch, [ids], [bos])[0]
    kn, vn = compute_chunk_kv(auto.arch, [ids])[0]
    torch.testing.assert_close(ea.values.float(), va, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(en.values.float(), vn, atol=2e-3, rtol=2e-3)
    assert not torch.allclose(ea.values.float(), en.values.float(), atol=1e-2)
    # Both answer a prompt from their own caches; ratio 1.0 is full prefill either way.
    prompt = prompt_for(DOCS[:1])
    full = auto.generate(prompt, policy="full_prefill", max_new_tokens=6)
    for r in (auto, none):
        out = r.generate(prompt, policy="cacheblend", recompute_ratio=1.0, max_new_tokens=6)
        assert out.stats.chunks_hit == 1 and out.token_ids == full.token_ids
    # An explicit anchor is its own cache.
    other = KVRag(handle, cache_dir=tmp_path / "kv", chunk_anchor=[bos, bos])
    assert other.fingerprint not in (auto.fingerprint, none.fingerprint) and not other.is_cached(DOCS[0])


@pytest.mark.parametrize("bad", ["bogus", [-1], [10**9], [1.5]])
def test_bad_chunk_anchor_is_a_clear_error(handle, tmp_path, bad):
    with pytest.raises(ValueError, match="chunk_anchor"):
        KVRag(handle, cache_dir=tmp_path / "kv", chunk_anchor=bad)


def test_chat_messages_are_rendered(rag):
    rag.precompute(DOCS)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt_for(DOCS)}]
    out = rag.generate(msgs, policy="naive_reuse", max_new_tokens=3)
    assert out.stats.chunks_hit == 3


def test_a_reuse_query_that_finds_no_cached_chunk_says_so_once(rag, caplog):
    """The speed-up must not be lost silently: with chunks cached, a prompt in which none is
    found (here a framework rewrote their text) is computed in full with one warning naming
    why; later ones log at debug level. Before anything is cached, nothing is said."""
    import logging

    caplog.set_level(logging.DEBUG, logger="kvrag")
    rag.generate(prompt_for(DOCS), max_new_tokens=1)
    assert not [r for r in caplog.records if "no cached chunk" in r.getMessage()]
    rag.precompute(DOCS)
    rewritten = prompt_for([d.upper() for d in DOCS])
    for _ in range(2):
        out = rag.generate(rewritten, max_new_tokens=1)
        assert out.stats.cached_tokens == 0
    notes = [r for r in caplog.records if "no cached chunk" in r.getMessage()]
    assert [r.levelno for r in notes] == [logging.WARNING, logging.DEBUG]
    assert "3 chunk texts cached" in notes[0].getMessage()
    caplog.clear()
    assert rag.generate(prompt_for(DOCS), max_new_tokens=1).stats.cached_tokens > 0
    assert not [r for r in caplog.records if "no cached chunk" in r.getMessage()]


def test_a_miss_on_chunks_still_being_precomputed_says_so(rag, caplog, monkeypatch):
    """The first query of a quickstart runs while background precompute is still busy: the
    warning must name that cause, with the counts as they stood when the prompt was looked up
    (by the time it printed, the worker had registered the chunks, and it used to blame
    segmentation)."""
    import logging

    from kvrag.precompute import Precomputer

    caplog.set_level(logging.DEBUG, logger="kvrag")
    rag.precompute(DOCS[:1])
    pc = Precomputer(rag, start=False)
    pc.submit_many(DOCS[1:])
    fuse = rag._fuse

    def worker_finishes_meanwhile(prep):
        rag.precompute(DOCS[1:])  # what the worker does while the prompt is prefilled
        return fuse(prep)

    monkeypatch.setattr(rag, "_fuse", worker_finishes_meanwhile)
    out = rag.generate(prompt_for(DOCS[1:]), max_new_tokens=1)
    assert out.stats.cached_tokens == 0
    notes = [r.getMessage() for r in caplog.records if "no cached chunk" in r.getMessage()]
    assert len(notes) == 1
    assert "2 chunk text(s) it contains were still queued or being computed" in notes[0]
    assert "1 chunk texts cached at lookup" in notes[0] and "wait_until_idle" in notes[0]
    assert "segmentation" not in notes[0]
    pc.shutdown(cancel_pending=True)


def test_an_empty_cache_dir_is_refused_before_anything_is_written(handle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="cache_dir must be a non-empty path"):
        KVRag(handle, cache_dir="")
    assert not any(tmp_path.iterdir())


def test_continuation_ids_outside_the_vocabulary_or_not_ints_are_named(rag, handle):
    vocab = handle.model.get_input_embeddings().num_embeddings
    prompt = prompt_for(DOCS[:1])
    for bad, shown in [
        ([5, -1], "-1"),
        ([vocab], str(vocab)),
        ([3, 7.9], "7.9"),
        ([2.0], "2.0"),
        ([True], "True"),
        (["7"], "'7'"),
    ]:
        with pytest.raises(ValueError, match=rf"{shown} at position"):
            rag.continuation_logits(prompt, bad)
    with pytest.raises(ValueError, match="tensor of shape"):
        rag.continuation_logits(prompt, torch.tensor([1.0, 2.0]))
    out, _ = rag.continuation_logits(prompt, torch.tensor([vocab - 1, 0]))
    assert out.shape == (3, vocab)


def test_precompute_refuses_a_batch_of_no_tokens(rag):
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="batch_tokens"):
            rag.precompute(DOCS[:1], batch_tokens=bad)
    assert rag.store.stats()["entries"] == 0


def test_a_stored_entry_that_does_not_fit_the_model_is_computed_instead(handle, tmp_path, caplog):
    """A forged entry (valid checksum, right key) whose K/V have another model's layout is a
    miss with a warning naming it, not a RuntimeError deep in the fusion."""
    from kvrag.store import ChunkEntry

    rag = KVRag(handle, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS[:1])
    key = rag.chunk_key(DOCS[0])
    e = rag.store.get(key, rag.fingerprint)
    k = torch.cat([e.keys, e.keys[:1]])  # one layer too many
    rag.store.put(key, ChunkEntry(e.fingerprint, e.text, e.token_ids.clone(), k.clone(), k.clone()))
    fresh = KVRag(handle, cache_dir=tmp_path / "kv")  # nothing of it in the hot tier
    out = fresh.generate(prompt_for(DOCS[:1]), max_new_tokens=4)
    assert out.stats.chunks_hit == 0 and out.stats.chunks_missed == 1
    assert "does not fit this model" in caplog.text
    ref = fresh.generate(prompt_for(DOCS[:1]), policy="full_prefill", max_new_tokens=4)
    assert out.token_ids == ref.token_ids
