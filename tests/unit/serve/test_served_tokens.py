"""The served prompt's tokens (``Scheduler.submit`` -> ``KVRag.tokenize`` -> ``ChunkLookup.tokens``):
counted at submit by the lookup's own rule, the chunks the hot tier holds spliced in
(``kvrag.query.splice``), and handed to the prefill, which tokenizes and segments nothing
again. The ids the prefill reads are the tokenizer's own for the whole prompt, on a byte-level
BPE (SmolLM2's) and a SentencePiece-style tokenizer, whichever chunks are hot; the whole
prompt is not tokenized when its chunks are; and the context check refuses at submit with
the count it always gave."""

import threading

import pytest
import torch
from helpers.corpus import DOCS, prompt_for
from helpers.splice import sentencepiece_style_tokenizer

from kvrag.engine import KVRag
from kvrag.layout.prompt import rag_messages
from kvrag.query import lookup
from kvrag.query.lookup import PromptTokens
from kvrag.serve.scheduler import GenerationRequest, RequestError, Scheduler
from kvrag.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTION = "Where does the red fox live?"


@pytest.fixture(scope="module")
def sp_handle():
    """A tiny llama with a SentencePiece-style tokenizer (the first word marked "▁", no chat template)."""
    return tiny_llama(seed=1, tokenizer=sentencepiece_style_tokenizer(merge_spaces=True))


@pytest.fixture(params=["byte_bpe", "sentencepiece"])
def any_rag(request, tmp_path):
    handle = request.getfixturevalue("handle" if request.param == "byte_bpe" else "sp_handle")
    r = KVRag(handle, cache_dir=tmp_path / "kv", policy="cacheblend")
    r.precompute(DOCS)
    return r


def _summary(pieces) -> list:
    return [(p.kind, p.token_ids.tolist(), p.key, p.span) for p in pieces]


class _Served:
    """What the served path did: the tokens submit made, the pieces and prompt ids the prefill read."""

    def __init__(self, rag: KVRag, monkeypatch):
        self.tokens: list[PromptTokens] = []
        self.pieces: list = []
        self.prompt_ids: list[list[int]] = []
        tokenize, pieces, prefill = rag.tokenize, rag.pieces, rag.prefill
        monkeypatch.setattr(rag, "tokenize", lambda *a, **k: self._add(self.tokens, tokenize(*a, **k)))
        monkeypatch.setattr(rag, "pieces", lambda *a, **k: self._add(self.pieces, pieces(*a, **k)))
        monkeypatch.setattr(rag, "prefill", lambda *a, **k: self._add(self.prompt_ids, prefill(*a, **k)))

    def _add(self, into: list, got):
        into.append(got.prompt_ids if hasattr(got, "prompt_ids") else got)
        return got


def _whole_ids(rag: KVRag, prompt: str) -> list[int]:
    return rag.handle.prefix_ids() + rag.tokenizer(prompt, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("hot", ["all", "one", "none"])
def test_the_served_prompt_ids_are_the_tokenizers_own(any_rag, monkeypatch, hot):
    rag = any_rag
    prompt = prompt_for(DOCS, QUESTION)
    ref = rag.generate(prompt, max_new_tokens=6)  # the library's lookup: every chunk now hot
    want_pieces, _ = rag.pieces(prompt)
    if hot != "all":
        rag.hot.clear()
    if hot == "one":
        rag.pieces(prompt_for(DOCS[1:2]))  # only this chunk is hot at submit
    served = _Served(rag, monkeypatch)
    with Scheduler(rag) as sched:
        fin = sched.submit(GenerationRequest.of(prompt, max_new_tokens=6)).result(timeout=120)
    (tokens,) = served.tokens
    # Spliced at submit: the hot chunks' stored ids, the rest tokenized in context.
    assert len(tokens.spliced) == {"all": len(DOCS), "one": 1, "none": 0}[hot]
    assert rag.handle.prefix_ids() + tokens.ids == _whole_ids(rag, prompt)
    assert served.prompt_ids == [_whole_ids(rag, prompt)]  # what the prefill read
    ((pieces, stats),) = served.pieces
    assert _summary(pieces) == _summary(want_pieces)  # every chunk served as the library serves it
    assert stats.chunks_hit == 0 and stats.chunks_missed == stats.chunks_unaligned == 0
    assert torch.cat([p.token_ids for p in pieces]).tolist() == _whole_ids(rag, prompt)
    assert fin.token_ids == ref.token_ids and fin.prompt_tokens == ref.stats.prompt_tokens


def test_a_served_chat_prompt_with_hot_chunks(rag, monkeypatch):
    rag.precompute(DOCS)
    msgs = rag_messages(DOCS, QUESTION)
    ref = rag.generate(msgs, max_new_tokens=6)
    served = _Served(rag, monkeypatch)
    with Scheduler(rag) as sched:
        fin = sched.submit(GenerationRequest.of(msgs, max_new_tokens=6)).result(timeout=120)
    (tokens,) = served.tokens
    assert len(tokens.spliced) == len(DOCS)
    assert served.prompt_ids == [_whole_ids(rag, rag.render(msgs))] == [ref.prompt_ids]
    assert fin.token_ids == ref.token_ids


def _count_calls(monkeypatch, tokenizers) -> list[tuple[str, list[str]]]:
    """Every call of the tokenizers' ``__call__``: (thread name, the texts it tokenized)."""
    calls: list[tuple[str, list[str]]] = []
    for cls in {type(t) for t in tokenizers}:
        real = cls.__call__

        def counted(self, text=None, *a, _real=real, **k):
            calls.append((threading.current_thread().name, [text] if isinstance(text, str) else list(text or [])))
            return _real(self, text, *a, **k)

        monkeypatch.setattr(cls, "__call__", counted)
    return calls


def test_the_served_path_does_not_tokenize_the_whole_prompt_when_its_chunks_are_hot(any_rag, monkeypatch):
    rag = any_rag
    prompt = prompt_for(DOCS, QUESTION)
    ref = rag.generate(prompt, max_new_tokens=4)  # the chunks are hot now
    with Scheduler(rag) as sched:
        calls = _count_calls(monkeypatch, [rag.tokenizer, sched._tok])
        whole = []
        real_tokens = lookup.prompt_tokens
        monkeypatch.setattr(lookup, "prompt_tokens", lambda tok, text: whole.append(text) or real_tokens(tok, text))
        fin = sched.submit(GenerationRequest.of(prompt, max_new_tokens=4)).result(timeout=120)
        monkeypatch.undo()
    assert fin.token_ids == ref.token_ids
    assert whole == []
    # Only the plain text, each span with the edges of the chunks beside it: no chunk whole.
    assert calls and not any(doc in t for _, texts in calls for t in texts for doc in DOCS)
    assert [name for name, _ in calls if name == "kvrag-scheduler"] == []  # the prefill tokenized nothing


def test_the_context_check_counts_a_spliced_prompt_as_before(monkeypatch, tmp_path):
    rag = KVRag(tiny_llama(seed=0, max_position_embeddings=128), cache_dir=tmp_path / "kv", policy="cacheblend")
    rag.precompute(DOCS)
    fits, over = prompt_for(DOCS, QUESTION), prompt_for(DOCS + DOCS, QUESTION)
    rag.pieces(fits)  # the chunks are hot: both prompts are counted by the splice
    n_fits, n_over = rag.count_tokens(fits), rag.count_tokens(over)  # the whole prompt tokenized
    assert n_fits < 128 < n_over
    room = 128 - n_fits
    whole = []
    real_tokens = lookup.prompt_tokens
    monkeypatch.setattr(lookup, "prompt_tokens", lambda tok, text: whole.append(text) or real_tokens(tok, text))
    with Scheduler(rag) as sched:
        with pytest.raises(RequestError, match=f"prompt of {n_over} tokens exceeds the model context") as e:
            sched.submit(GenerationRequest.of(over, max_new_tokens=1))
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(RequestError, match=f"{n_fits}.*max_new_tokens={room + 1}.*{room} left") as e:
            sched.submit(GenerationRequest.of(fits, max_new_tokens=room + 1))
        assert e.value.code == "context_length_exceeded"
        fin = sched.submit(GenerationRequest.of(fits, max_new_tokens=room, ignore_eos=True)).result(timeout=120)
    assert whole == []  # counted without tokenizing the whole prompt
    assert fin.prompt_tokens == n_fits and len(fin.token_ids) == room and fin.finish_reason == "length"
