"""Per-token log-probabilities (``kvrag.serve.logprobs``) on SmolLM2's real tokenizer: each
token's text is what it adds to the text, so the tokens spell it, a character split over byte
tokens included; the figures are ``log_softmax`` of the logits."""

import pytest
import torch

from kvrag.serve.logprobs import distribution, token_logprob, token_text
from kvrag.testing import smollm2_tokenizer

TEXT = "Hello café, the price is 5 € — こんにちは means hello.\n\nEnd of the reply."


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_token_texts_spell_the_text_and_a_split_character_comes_whole(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    pieces = [token_text(tok, ids[:i], t) for i, t in enumerate(ids)]
    assert "".join(pieces) == TEXT
    split = [i for i, p in enumerate(pieces) if p == ""]
    assert split, "the text must hold a character its tokenizer splits over byte tokens"
    assert all("\ufffd" not in p for p in pieces)
    # Not drawn, the same token shows that it holds part of a character.
    assert "\ufffd" in token_text(tok, ids[: split[0]], ids[split[0]], alternative=True)


def test_special_tokens_show_as_themselves_only_as_alternatives(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    assert token_text(tok, ids, eos) == ""  # the reply's text drops it
    assert token_text(tok, ids, eos, alternative=True) == tok.eos_token


def test_an_entry_holds_the_chosen_tokens_logprob_and_the_top_k(tok):
    torch.manual_seed(0)
    logits = torch.randn(len(tok), dtype=torch.bfloat16) * 4
    lp = distribution(logits)
    assert lp.dtype == torch.float32 and torch.logsumexp(lp, 0).item() == pytest.approx(0.0, abs=1e-5)
    context = tok("The answer is", add_special_tokens=False)["input_ids"]
    chosen = int(torch.argsort(lp)[len(tok) // 2])  # not the most likely: sampled
    e = token_logprob(tok, context, lp, chosen, 3)
    assert e.logprob == pytest.approx(float(lp[chosen]))
    best = torch.topk(lp, 3)
    assert [v for _, v in e.top] == pytest.approx(best.values.tolist())
    assert [t for t, _ in e.top] == [token_text(tok, context, i, alternative=True) for i in best.indices.tolist()]
    assert e.token == token_text(tok, context, chosen)
    assert token_logprob(tok, context, lp, chosen, 0).top == ()
