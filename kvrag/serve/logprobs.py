"""Per-token log-probabilities of a reply, what OpenAI's ``logprobs`` reports: for each
generated token its log-probability and the ``k`` most likely tokens at that step.

They are the model's own distribution at each step (``log_softmax`` of its logits), before
anything the request does to sampling: temperature, top-p and the EOS bar of ``min_tokens``
change which token is drawn, not the figures reported (vLLM's default, "raw" logprobs). Under a
reuse policy the first step's distribution is the fused prefill's, which is what the reply was
drawn from.

A token's text is what it adds to the reply: the decoded text of a few tokens before it and
itself, less that of the tokens before it, so a token that opens with a space (SentencePiece's
``▁``) shows it, and the tokens of a reply spell the reply (``token_text``). A character split
over several tokens (byte-level BPE, byte fallback) is shown whole by the token that completes
it; the tokens before it add "".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Tokens of context decoded before a token to read its text: enough for a space or a
#: character's first bytes carried over from the tokens before.
_CONTEXT = 8


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its ``token`` text, ``logprob`` (natural log) and the ``top``
    alternatives as ``(text, logprob)``, most likely first (as many as the request asked for;
    special tokens spelled out)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


def distribution(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-probabilities [B, V] (or [V]) of next-token ``logits`` of the same shape: a
    new tensor, so the caller may mask the logits afterwards for sampling."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_texts(tokenizer, context: list[int], tokens: list[int], alternative: bool = False) -> list[str]:
    """The text each of ``tokens`` would add after the ids ``context`` (their last few are
    decoded, once for all of them).

    A token that ends inside a character adds nothing until the token that completes it, which
    adds the whole character: the rule the reply's own text streams by, so the chosen tokens
    spell the reply. An ``alternative`` (a token not drawn) shows U+FFFD for such a part
    instead, and spells special tokens (an EOS shows as itself) where the reply drops them."""
    skip = not alternative
    tail = context[-_CONTEXT:]
    # A trailing U+FFFD is a character whose bytes are not all there yet.
    before = tokenizer.decode(tail, skip_special_tokens=skip).rstrip("\ufffd") if tail else ""
    out = []
    for token in tokens:
        after = tokenizer.decode(tail + [token], skip_special_tokens=skip)
        if not alternative:
            after = after.rstrip("\ufffd")
        if after.startswith(before):
            out.append(after[len(before) :])
        else:
            out.append(tokenizer.decode([token], skip_special_tokens=skip))
    return out


def token_text(tokenizer, context: list[int], token: int, alternative: bool = False) -> str:
    """``token_texts`` of one token."""
    return token_texts(tokenizer, context, [token], alternative)[0]


def token_logprob(tokenizer, context: list[int], logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The entry of ``token``, drawn after the ids ``context`` from the distribution
    ``logprobs`` [V] (``distribution``), with its ``k`` most likely alternatives."""
    top = torch.topk(logprobs, k) if k else None
    chosen = float(logprobs[token])
    alternatives: tuple[tuple[str, float], ...] = ()
    if top is not None:
        texts = token_texts(tokenizer, context, top.indices.tolist(), alternative=True)
        alternatives = tuple(zip(texts, top.values.tolist()))
    return TokenLogprob(token_text(tokenizer, context, token), chosen, alternatives)
