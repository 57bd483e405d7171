"""The splice rule (kvrag.query.splice): a prompt's ids built from its plain spans, tokenized
in context, and its chunks' stored ids are exactly the tokenizer's ids of the whole prompt --
or the rule says it cannot tell and the caller tokenizes the whole prompt. And the lookup
(kvrag.query.lookup) uses it: it does not tokenize the whole prompt where the splice holds,
and serves the very pieces the whole-prompt alignment serves. On SmolLM2's tokenizer (the tiny
test models' own); Gemma 3's: tests/integration/test_real_gemma3_splice.py."""

import random

import pytest
import torch
from helpers.corpus import DOCS, prompt_for
from helpers.splice import check, house_case, random_case, spelled

import kvrag.query.lookup as lookup_module
from kvrag.layout.align import prompt_tokens, spell_chunk
from kvrag.layout.prompt import rag_messages
from kvrag.query.splice import splice_ids
from kvrag.testing import smollm2_tokenizer


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_spelled_is_the_stores_spelling(handle):
    for text in DOCS + [" leading space", "Пример 😀", "x"]:
        assert spelled(handle.tokenizer, text) == spell_chunk(handle, text, handle.encode("\n"))


def test_random_prompts_splice_to_the_tokenizers_ids(tok):
    # Chunks cut at random characters: most seams merge (mid-word), those fall back; every
    # splice made equals the whole prompt's tokenization (``check`` asserts it).
    rng = random.Random(0)
    spliced = sum(check(tok, *random_case(rng)) for _ in range(600))
    assert spliced >= 30  # the rule decides a share of even these, not only none


def test_rag_layout_prompts_splice(tok):
    # kvrag's own layout, passages between blank lines: the seams are decided nearly always
    # (a passage that ends in whitespace merges it with the blank line: those fall back).
    rng = random.Random(1)
    spliced = sum(check(tok, *house_case(rng, tok)) for _ in range(150))
    assert spliced >= 120


@pytest.mark.parametrize(
    ("prompt", "chunk"),
    [
        ("Answer from the passages.\n\nThe red fox.\n\nQuestion: where?", "The red fox."),
        ("The red fox.", "The red fox."),  # the whole prompt is one chunk
        ("Пример текста —\nhéllo wörld!\n😀 x", "héllo wörld!"),
        ("a\tb\n\nC 1234 5678\n\nd", "C 1234 5678"),
    ],
)
def test_prompts_that_splice(tok, prompt, chunk):
    start = prompt.index(chunk)
    assert check(tok, prompt, [(start, start + len(chunk))])


def test_repeated_and_adjacent_chunks(tok):
    a, b = DOCS[0], DOCS[1]
    prompt = f"Passages:\n\n{a}\n\n{b}\n\n{a}\n{b}{a}\n\nQuestion: where?"
    spans, pos = [], 0
    for text in (a, b, a, b, a):
        start = prompt.index(text, pos)
        spans.append((start, start + len(text)))
        pos = start + len(text)
    assert spans[3][1] == spans[4][0]  # adjacent: no plain text between
    assert check(tok, prompt, spans)


@pytest.mark.parametrize(
    ("prompt", "chunk"),
    [
        ("Please concatenate these.", "cat"),  # found inside a word
        ("Context: The red fox.", "The red fox."),  # " The" is one token in the prompt
        ("Passages:\n\n  The red fox.", "  The red fox."),  # leading spaces merge with the line breaks
        ("The red fox. \n\nQuestion", "The red fox. "),  # a trailing space merges with them
        ("The red fox.\n", "The re"),  # its last word goes on in the prompt
    ],
)
def test_a_seam_that_merges_falls_back(tok, prompt, chunk):
    start = prompt.index(chunk)
    end = start + len(chunk)
    # The prompt's own ids differ from the naive concatenation of its parts: a splice without
    # the check would be wrong here.
    naive = (
        tok(prompt[:start], add_special_tokens=False)["input_ids"]
        + spelled(tok, chunk)
        + tok(prompt[end:], add_special_tokens=False)["input_ids"]
    )
    assert naive != tok(prompt, add_special_tokens=False)["input_ids"]
    assert splice_ids(tok, prompt, [(start, end, spelled(tok, chunk))]) is None


def test_a_wrong_stored_spelling_falls_back(tok):
    # Stored ids that are not the prompt's at a seam (another tokenizer's spelling, say) are
    # caught there, not served.
    prompt = prompt_for(DOCS[:2])
    start = prompt.index(DOCS[0])
    ids = spelled(tok, DOCS[0])
    assert splice_ids(tok, prompt, [(start, start + len(DOCS[0]), ids[:-1] + [ids[-1] + 1])]) is None
    assert splice_ids(tok, prompt, [(start, start + len(DOCS[0]), [ids[0] + 1, *ids[1:]])]) is None


def test_bad_chunk_lists_fall_back(tok):
    prompt = prompt_for(DOCS[:2])
    a = prompt.index(DOCS[0])
    b = prompt.index(DOCS[1])
    ids_a, ids_b = spelled(tok, DOCS[0]), spelled(tok, DOCS[1])
    assert splice_ids(tok, prompt, []) is None
    assert splice_ids(tok, prompt, [(b, b + len(DOCS[1]), ids_b), (a, a + len(DOCS[0]), ids_a)]) is None  # order
    assert splice_ids(tok, prompt, [(a, a + len(DOCS[0]), [])]) is None


# ---- the lookup -------------------------------------------------------------------------


def _pieces_summary(pieces):
    return [(p.kind, p.token_ids.tolist(), p.key, p.span) for p in pieces]


def _stats_summary(stats):
    fields = ("chunks_missed", "chunks_unaligned", "chunks_partial", "chunks_hot", "bytes_loaded")
    return {f: getattr(stats, f) for f in fields}


def _count_whole_tokenizations(monkeypatch):
    calls = []

    def counted(tokenizer, prompt):
        calls.append(prompt)
        return prompt_tokens(tokenizer, prompt)

    monkeypatch.setattr(lookup_module, "prompt_tokens", counted)
    return calls


@pytest.mark.parametrize("chat", [False, True])
def test_lookup_splices_without_tokenizing_the_prompt(rag, monkeypatch, chat):
    rag.precompute(DOCS)
    prompt = rag.render(rag_messages(DOCS, "Where does the red fox live?")) if chat else prompt_for(DOCS)
    want_pieces, want_stats = rag.pieces(prompt, tokens=prompt_tokens(rag.tokenizer, prompt))  # aligned in the whole
    calls = _count_whole_tokenizations(monkeypatch)
    rag.hot.clear()  # from the store: the same pieces, read the same way
    pieces, stats = rag.pieces(prompt)
    assert calls == []
    assert _pieces_summary(pieces) == _pieces_summary(want_pieces)
    assert sum(p.kind != 0 for p in pieces) == len(DOCS)  # every chunk served, whole
    assert _stats_summary(stats) == _stats_summary(want_stats)
    ids = torch.cat([p.token_ids for p in pieces]).tolist()
    assert ids == rag.handle.prefix_ids() + rag.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # Hot now (the first lookup put them there): still no tokenization of the whole.
    pieces, stats = rag.pieces(prompt)
    assert calls == [] and stats.chunks_hot == len(DOCS)
    assert _pieces_summary(pieces) == _pieces_summary(want_pieces)


@pytest.mark.parametrize(
    ("prompt", "registered"),
    [
        # A cut chunk (partial: 69 of its 73 characters) beside whole ones.
        ("Answer.\n\n" + DOCS[0][:-4] + "\n\n" + DOCS[1] + "\n\n" + DOCS[2], DOCS),
        # A chunk whose first token merges with the space before it (" The"), beside whole ones.
        ("Passages:\n\n" + DOCS[1] + "\nContext: " + DOCS[0] + "\n\n" + DOCS[2] + "\nQ: ?", DOCS),
        # A one-word chunk inside words ("fox" in "foxes"): not even read.
        ("Passages:\n\n" + DOCS[1] + "\n\nThe foxes and the fox.\n\n" + DOCS[2], [*DOCS, "fox"]),
    ],
)
def test_lookup_aligns_the_other_chunks_in_context(rag, monkeypatch, prompt, registered):
    rag.precompute(registered)
    want_pieces, want_stats = rag.pieces(prompt, tokens=prompt_tokens(rag.tokenizer, prompt))
    calls = _count_whole_tokenizations(monkeypatch)
    rag.hot.clear()
    reads = []
    get = rag.store.get
    monkeypatch.setattr(rag.store, "get", lambda key, fp, **kw: reads.append(key) or get(key, fp, **kw))
    pieces, stats = rag.pieces(prompt)
    assert calls == []  # the spliced chunks' seams held: the others are aligned in their context
    assert _pieces_summary(pieces) == _pieces_summary(want_pieces)
    assert _stats_summary(stats) == _stats_summary(want_stats)
    assert stats.chunks_partial + stats.chunks_unaligned + sum(p.key is not None for p in pieces) > 2
    assert len(reads) == sum(p.key is not None for p in pieces)  # only the chunks served were read


def test_lookup_falls_back_to_the_whole_prompt(rag, monkeypatch):
    # Every chunk's first token merges with a space: none to splice.
    padded = "Queen Ilsa ruled the harbour town for forty years. "
    rag.precompute([*DOCS, padded])
    merged = "Context: " + " ".join(DOCS) + "\nQuestion: where?"
    # A chunk's trailing space merges with the line breaks after it: only the splice's check
    # sees it.
    trailing = "Passages:\n\n" + DOCS[0] + "\n\n" + padded + "\n\nQuestion: where?"
    for prompt in (merged, trailing):
        rag.hot.clear()
        want_pieces, want_stats = rag.pieces(prompt, tokens=prompt_tokens(rag.tokenizer, prompt))
        calls = _count_whole_tokenizations(monkeypatch)
        rag.hot.clear()
        pieces, stats = rag.pieces(prompt)
        assert calls == [prompt]  # tokenized once, whole
        assert _pieces_summary(pieces) == _pieces_summary(want_pieces)
        assert _stats_summary(stats) == _stats_summary(want_stats)
        assert any(p.kind != 0 for p in pieces)  # chunks still served, on the tokens they share
        monkeypatch.undo()


def test_lookup_with_an_evicted_chunk(rag, monkeypatch):
    rag.precompute(DOCS)
    prompt = prompt_for(DOCS)
    # Evicted (by another process, say) after the last read of the store's text index: still
    # found in the prompt, no longer read; computed, in the tokens of its context.
    monkeypatch.setattr(rag.lookup, "refresh", lambda: None)
    rag.store.delete(rag.chunk_key(DOCS[1]))
    rag.hot.clear()
    calls = _count_whole_tokenizations(monkeypatch)
    pieces, stats = rag.pieces(prompt)
    assert calls == [] and stats.chunks_missed == 1
    assert sum(p.key is not None for p in pieces) == len(DOCS) - 1
    ids = torch.cat([p.token_ids for p in pieces]).tolist()
    assert ids == rag.handle.prefix_ids() + rag.tokenizer(prompt, add_special_tokens=False)["input_ids"]
