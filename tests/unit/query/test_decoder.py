"""The decoding rules that have one home (``kvrag.query.decode``): the token budget
(``Sampling.budget``: an unnamed ``max_new_tokens`` is the one default cut to the room the
prompt leaves, a named one that does not fit is refused), applied alike by ``KVRag.generate``
and the server's scheduler; the options every wrapper takes derive from ``Sampling``; a served
request's schema is compiled, its prompt tokenized and its policy resolved once."""

from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path

import pytest
from helpers.corpus import DOCS, prompt_for

import kvrag
from kvrag.defaults import DEFAULT_MAX_NEW_TOKENS
from kvrag.engine import KVRag
from kvrag.frameworks import GEN_KEYS, option_fields
from kvrag.policies import Policy
from kvrag.query import constrain, lookup
from kvrag.query.decode import SAMPLING_OPTIONS, Sampling
from kvrag.serve.scheduler import GenerationRequest, RequestError, Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(kvrag.__file__).resolve().parent.parent


@pytest.fixture
def rag(handle, tmp_path):
    r = KVRag(handle, cache_dir=tmp_path / "kv", policy="cacheblend")
    r.precompute(DOCS)
    return r


# ---- the rule itself ------------------------------------------------------------------------
def test_budget_unnamed_is_the_default_cut_to_the_room_named_must_fit():
    assert Sampling().max_new_tokens is None  # unnamed by default, everywhere
    assert Sampling().budget(10, 10_000) == DEFAULT_MAX_NEW_TOKENS
    assert Sampling().budget(100, 105) == 5  # cut to the room left
    assert Sampling(max_new_tokens=5).budget(100, 105) == 5  # a named limit that fits exactly
    assert Sampling(max_new_tokens=0).budget(105, 105) == 0  # nothing asked, nothing refused
    with pytest.raises(ValueError, match=r"max_new_tokens=6 asks for more than the 5 left \(context exceeded\)"):
        Sampling(max_new_tokens=6).budget(100, 105)
    with pytest.raises(ValueError, match="leaves no room"):
        Sampling().budget(105, 105)
    with pytest.raises(ValueError, match="min_tokens=7 is over the request's max_new_tokens=5"):
        Sampling(min_tokens=7).budget(100, 105)  # unnamed, cut below min_tokens


def test_the_default_answer_length_is_defined_once_in_the_source_tree():
    """One definition of the default answer length: no second constant, and no literal
    default of ``max_new_tokens`` in a signature, a request or a wrapper's settings."""
    sources = [p for d in ("kvrag", "integrations") for p in (REPO / d).rglob("*.py") if "tests" not in p.parts]
    defined = [p for p in sources if re.search(r"^\s*DEFAULT_MAX_NEW_TOKENS\s*[:=]", p.read_text(), re.M)]
    assert [p.relative_to(REPO).as_posix() for p in defined] == ["kvrag/defaults.py"]
    # A declared default (a signature's, a dataclass's or a settings field's); a benchmark's
    # configuration (kvrag/bench) fixes its own answer length on purpose.
    literal = re.compile(r"max_new_tokens\s*:[^=\n]*=\s*(Field\(\s*default=)?\d")
    found = [p.relative_to(REPO).as_posix() for p in sources if literal.search(p.read_text())]
    assert [f for f in found if not f.startswith("kvrag/bench/")] == []


def test_every_wrapper_option_is_a_sampling_field():
    fields = [f.name for f in dataclasses.fields(Sampling)]
    assert GEN_KEYS == ("policy", *fields)
    assert set(fields) == SAMPLING_OPTIONS == {o.name for o in option_fields()}
    # A wrapper's settings start unnamed too, so they take the same rule.
    assert {o.name: o.default for o in option_fields()}["max_new_tokens"] is None


# ---- the library and the server alike -------------------------------------------------------
def test_library_and_scheduler_refuse_a_named_limit_past_the_context_and_cut_an_unnamed_one(rag):
    long_prompt = "word " * 4000
    n = rag.count_tokens(long_prompt)
    room = rag.handle.max_context - n
    assert 0 < room < DEFAULT_MAX_NEW_TOKENS
    with pytest.raises(ValueError, match=f"{n}.*max_new_tokens={room + 1}.*{room} left"):
        rag.generate(long_prompt, max_new_tokens=room + 1)
    cut = rag.generate(long_prompt, ignore_eos=True)
    assert len(cut.token_ids) == room and cut.finish_reason == "length"
    with Scheduler(rag) as sched:
        with pytest.raises(ValueError, match=f"{n}.*max_new_tokens={room + 1}.*{room} left") as refused:
            sched.submit(GenerationRequest.of(long_prompt, max_new_tokens=room + 1))
        served = sched.submit(GenerationRequest.of(long_prompt, ignore_eos=True)).result(timeout=120)
    assert isinstance(refused.value, RequestError) and refused.value.code == "context_length_exceeded"
    assert served.token_ids == cut.token_ids and served.finish_reason == "length"


def test_min_tokens_and_ignore_eos_are_the_library_s_rules_too(rag):
    """The server's EOS bar and ``ignore_eos`` are options of the one decoder: the library
    draws the same tokens as the scheduler under them."""
    prompt = prompt_for(DOCS[:2], "Where does the red fox live?")
    plain = rag.generate(prompt, max_new_tokens=6)
    opts = dict(max_new_tokens=6, min_tokens=4, ignore_eos=True)
    lib = rag.generate(prompt, **opts)
    with Scheduler(rag) as sched:
        served = sched.submit(GenerationRequest.of(prompt, **opts)).result(timeout=120)
    assert served.token_ids == lib.token_ids and len(lib.token_ids) == 6
    assert lib.token_ids[0] == plain.token_ids[0] or plain.token_ids[0] in rag.eos


# ---- once -----------------------------------------------------------------------------------
def test_a_served_request_compiles_its_schema_tokenizes_and_resolves_once(rag, monkeypatch):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    compiled = []
    real_init = constrain.JsonConstraint.__init__

    def counting_init(self, *a, **k):
        compiled.append(1)
        real_init(self, *a, **k)

    monkeypatch.setattr(constrain.JsonConstraint, "__init__", counting_init)
    tokenized = []
    real_tokens = lookup.prompt_tokens
    monkeypatch.setattr(
        lookup,
        "prompt_tokens",
        lambda tok, text: tokenized.append(threading.current_thread().name) or real_tokens(tok, text),
    )
    policies = []
    real_prefill = rag.prefill
    monkeypatch.setattr(rag, "prefill", lambda *a, **k: policies.append(a[1]) or real_prefill(*a, **k))
    with Scheduler(rag) as sched:
        tickets = sched.submit_choices(
            GenerationRequest.of(prompt_for(DOCS[:2], "Is it?"), n=3, max_new_tokens=12, json_schema=schema)
        )
        fins = [t.result(timeout=120) for t in tickets]
    assert all(f.finish_reason in ("stop", "length") for f in fins)
    assert len(compiled) == 1  # at submit; each choice decodes with a copy of it
    # Whole (its chunks are not in the hot tier yet), at submit: the prefill read those tokens.
    assert tokenized == [threading.current_thread().name]
    assert len(policies) == 1 and isinstance(policies[0], Policy)  # the instance resolved at submit
