"""Structured output: a reply held to a JSON schema (OpenAI's ``response_format``).

Before each draw the tokens that cannot continue a document valid under the schema are masked
(their logits set to -inf), and the drawn token is fed to the grammar's matcher; the reply
ends when the document is complete. The grammar engine is llguidance (the guidance project's,
one of vLLM's structured-output back-ends): it compiles the schema against the tokenizer's
vocabulary and computes each step's mask as a bitmask, fast enough to run between decode
steps on the host.

Whitespace between JSON tokens is held to the usual form (``{"a": 1, "b": [2, 3]}``), since a
small model left free to choose it may pad a document with newlines until its token budget
ends (a schema's own ``x-guidance`` options may loosen it).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    from llguidance._lib import JsonCompileOptions

_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: Tokenizers converted for the grammar engine, kept for the next reply (a process serves one
#: model or a few).
_KEEP = 4
_lock = threading.Lock()
_tokenizers: OrderedDict[tuple[int, int], tuple[Any, Any]] = OrderedDict()


def _grammar_tokenizer(tokenizer, vocab: int):
    """llguidance's view of ``tokenizer`` (a fast Hugging Face tokenizer) for a model of
    ``vocab`` logits: converted once per tokenizer and vocabulary size (a few hundred ms)."""
    import llguidance.hf

    key = (id(tokenizer), vocab)
    with _lock:
        got = _tokenizers.get(key)
        if got is None or got[0] is not tokenizer:  # (an id reused by another tokenizer)
            got = _tokenizers[key] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
            while len(_tokenizers) > _KEEP:
                _tokenizers.popitem(last=False)
        _tokenizers.move_to_end(key)
    return got[1]


class JsonConstraint:
    """One reply's matcher for ``schema`` (a JSON schema as a dict) over ``tokenizer``'s
    vocabulary of ``vocab`` logits. ValueError names a schema the engine cannot compile.

    ``mask(logits)`` returns the logits with every token the document cannot take next at
    -inf; ``accept(token)`` advances it by the drawn token; ``done``: the document is complete
    (nothing may follow but the end of the reply)."""

    def __init__(self, tokenizer, vocab: int, schema: Mapping[str, Any]):
        import llguidance

        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        self.vocab = vocab
        ll = _grammar_tokenizer(tokenizer, vocab)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(dict(schema)), defaults=_OPTIONS)
        except (TypeError, ValueError) as e:
            raise ValueError(f"JSON schema: {e}") from None
        self._matcher = llguidance.LLMatcher(ll, grammar)
        if error := self._matcher.get_error():
            raise ValueError(f"JSON schema: {error}")

    def copy(self) -> JsonConstraint:
        """A matcher of the same schema at the same point, without compiling it again: each of
        a request's choices decodes with its own copy of the one compiled at submit."""
        twin = object.__new__(JsonConstraint)
        twin.vocab = self.vocab
        twin._matcher = self._matcher.deep_copy()
        return twin

    @property
    def done(self) -> bool:
        return bool(self._matcher.is_stopped())

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the document can take next."""
        # One bit per token, 32 to a little-endian word: token i is bit i % 8 of byte i // 8.
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = torch.zeros(self.vocab, dtype=torch.bool)
        n = min(self.vocab, bits.size)
        out[:n] = torch.from_numpy(bits[:n].astype(bool))
        return out

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits [V] (a new tensor) with the tokens the document cannot take next at
        -inf; ``logits`` [V] on any device."""
        return logits.float().masked_fill(~self.allowed().to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        """Advance by the drawn ``token`` (one ``mask`` allowed). GrammarGaveUp when the
        engine cannot carry the document past it."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarGaveUp(f"token {token} does not continue the JSON document: {self._matcher.get_error()}")


class GrammarGaveUp(RuntimeError):
    """The grammar engine stopped holding a reply to its schema mid-document: past one of its
    resource limits (a recursive schema whose every document nests without end makes it
    search forever for the tokens it forces), the reply cannot go on under the schema."""
