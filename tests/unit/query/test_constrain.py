"""Structured output (``kvrag.query.constrain``) on SmolLM2's real tokenizer: the mask lets
through exactly the tokens a valid document can take next, and a complete document ends."""

import json

import pytest
import torch

from kvrag.query.constrain import JsonConstraint
from kvrag.testing import smollm2_tokenizer

VERDICT = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_the_mask_admits_a_valid_document_token_by_token_and_then_only_its_end(tok):
    c = JsonConstraint(tok, 49152, VERDICT)
    doc = '{"answer": "no", "score": 12}'
    for t in tok(doc, add_special_tokens=False)["input_ids"]:
        assert not c.done
        allowed = c.allowed()
        assert allowed.shape == (49152,) and allowed[t], tok.decode([t])
        c.accept(t)
    assert c.done
    assert c.allowed().nonzero().flatten().tolist() == [tok.eos_token_id]
    json.loads(doc)  # (the document the test walked is itself valid)


def test_the_mask_bars_what_cannot_follow_and_keeps_the_rest(tok):
    c = JsonConstraint(tok, 49152, VERDICT)
    first = {tok.decode([i]) for i in c.allowed().nonzero().flatten().tolist()}
    assert first and all(t.lstrip().startswith("{") for t in first)
    logits = torch.randn(49152)
    masked = c.mask(logits)
    keep = c.allowed()
    assert torch.equal(masked[keep], logits[keep]) and bool((masked[~keep] == float("-inf")).all())
    with pytest.raises(RuntimeError, match="does not continue"):
        c.accept(tok("hello", add_special_tokens=False)["input_ids"][0])


def test_a_schema_the_engine_cannot_compile_is_named(tok):
    for bad in ({"type": "nonsense"}, ["not", "a", "schema"], {"$ref": "#/nowhere"}):
        with pytest.raises(ValueError, match="JSON schema"):
            JsonConstraint(tok, 49152, bad)
