"""Prompts for the splice rule's equality tests (``kvrag.query.splice``), shared by the unit
test on SmolLM2's tokenizer and the real test on Gemma 3's: random texts cut into chunks at
random characters (mid-word, inside whitespace runs, beside newlines, inside multi-byte
characters), chunks repeated and adjacent, and the house RAG layout; a SentencePiece-style
tokenizer small enough for the unit tests."""

from __future__ import annotations

import random

from kvrag.query.splice import splice_ids

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "concatenate",
    "Paris",
    "1234",
    "3.14159",
    "e=mc²",
    "héllo",
    "wörld",
    "Пример",
    "текста",
    "日本語",
    "😀",
    "naïve",
    "don't",
    "it's",
    "(a)",
    "[b]",
    "—",
    "...",
    ",",
    ".",
    ":",
    "\t",
    "<b>",
    "x",
    "QUESTION",
]
SEPARATORS = [" ", " ", " ", " ", "  ", "\n", "\n\n", " \n", "\n ", "", "   "]


def spelled(tokenizer, text: str) -> list[int]:
    """A chunk's stored ids: the tokenizer's ids of the text after a line break, without those
    of the line break (``kvrag.layout.align.spell_chunk``'s rule, read on the tokenizer alone)."""
    nl = tokenizer("\n", add_special_tokens=False)["input_ids"]
    ids = tokenizer("\n" + text, add_special_tokens=False)["input_ids"]
    if nl and ids[: len(nl)] == nl and len(ids) > len(nl):
        return ids[len(nl) :]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sentencepiece_style_tokenizer(merge_spaces: bool = False):
    """A character-level tokenizer that marks the first word of a text as Llama 2 / Mistral's
    SentencePiece tokenizers do (normalizer: prepend "▁", spaces -> "▁"), and decodes as they
    do (the tokens fused, then the text's first space dropped). ``merge_spaces``: "▁" merges
    with the letter or digit after it ("▁T"), as a word's leading space does in their
    vocabularies."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.ascii_letters + string.digits + ".,:;?!'-\n") | {"▁"})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    merges = [("▁", c) for c in string.ascii_letters + string.digits] if merge_spaces else []
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def random_text(rng: random.Random, n_words: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(SEPARATORS) for _ in range(n_words))


def random_case(rng: random.Random) -> tuple[str, list[tuple[int, int]]]:
    """A prompt and its chunks' character spans ``[(start, end)]`` (in order, not overlapping,
    non-whitespace): cut at random characters, some adjacent, some texts repeated."""
    pool = [random_text(rng, rng.randint(1, 12)) for _ in range(4)]
    parts, spans, pos = [], [], 0
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.7:  # plain text before the next chunk (else: adjacent chunks)
            plain = random_text(rng, rng.randint(0, 5))
            parts.append(plain)
            pos += len(plain)
        chunk = rng.choice(pool)  # a text repeated in one prompt
        if rng.random() < 0.5:  # cut at random characters: mid-word, mid-whitespace run
            a = rng.randrange(len(chunk))
            chunk = chunk[a : rng.randint(a + 1, len(chunk))]
        if not chunk.strip():
            continue
        parts.append(chunk)
        spans.append((pos, pos + len(chunk)))
        pos += len(chunk)
    parts.append(random_text(rng, rng.randint(0, 4)))
    return "".join(parts), spans


def house_case(rng: random.Random, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """A prompt in kvrag's RAG layout (``kvrag.layout.prompt.rag_prompt`` as plain text,
    passages separated by blank lines) and its passages' spans."""
    from kvrag.layout.prompt import DEFAULT_INSTRUCTION

    passages = []
    for _ in range(rng.randint(1, 6)):
        text = random_text(rng, rng.randint(3, 40)).strip()
        passages.append(text[0].upper() + text[1:] if text else "Text.")
    passages = list(dict.fromkeys(p for p in passages if p.strip()))
    body = "\n\n".join(passages)
    prompt = f"{DEFAULT_INSTRUCTION}\n\nPassages:\n\n{body}\n\nQuestion: {random_text(rng, 6).strip()}?\nAnswer:"
    spans, pos = [], 0
    for p in passages:
        start = prompt.index(p, pos)
        spans.append((start, start + len(p)))
        pos = start + len(p)
    return prompt, spans


def check(tokenizer, prompt: str, spans: list[tuple[int, int]]) -> bool:
    """Splice ``prompt`` with its chunks at ``spans``: True if spliced, False if it fell back.
    Asserts the invariant: a splice is the tokenizer's own ids of the whole prompt, with each
    chunk's stored ids where ``starts`` says."""
    chunks = [(a, b, spelled(tokenizer, prompt[a:b])) for a, b in spans]
    got = splice_ids(tokenizer, prompt, chunks)
    if got is None:
        return False
    want = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert got.ids == want, (prompt, spans)
    for (_, _, ids), j in zip(chunks, got.starts, strict=True):
        assert got.ids[j : j + len(ids)] == ids
    return True
