"""``kvrag serve`` under hostile clients: each request an outside audit sent to a real server on
127.0.0.1, sent again -- the answer is a 4xx naming the field, or a reply that ends cleanly, and
the server goes on serving. Requests a server must refuse before the model's work are checked to
be refused before the scheduler (which renders and tokenizes) ever sees them."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch
from helpers.serve import kvrag_serve, running

from kvrag.query.decode import Decoder, Sampling
from kvrag.serve.app import create_app
from kvrag.serve.lifecycle import Lifecycle
from kvrag.serve.protocol import MAX_LOGIT_BIAS_ENTRIES
from kvrag.serve.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")

HELLO = [{"role": "user", "content": "Say hello."}]
#: Every document of it nests {"c": ...} without end: the grammar engine can never finish one.
ENDLESS = {
    "$defs": {
        "n": {
            "type": "object",
            "properties": {"c": {"$ref": "#/$defs/n"}},
            "required": ["c"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/n",
}
#: The audit's recursive schema (finite documents exist; a model may nest it deep).
RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}


class Counting(Scheduler):
    """A scheduler that counts the requests handed to it (rendered and tokenized there)."""

    submitted = 0

    def submit_choices(self, req):
        type(self).submitted += 1
        return super().submit_choices(req)


@pytest.fixture
def server(rag):
    Counting.submitted = 0
    with Counting(rag, max_concurrency=2, max_queue=4) as sch, running(create_app(rag, sch, model_name="t")) as url:
        yield url, sch


def post(url: str, body: dict | str, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=120, **kw)


def stream_events(url: str, body: dict) -> tuple[int, list]:
    """(status, the SSE events' JSON bodies, with "[DONE]" as is) of a streamed request."""
    events: list = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return 200, events


def still_serves(url: str) -> None:
    r = post(url, {"messages": HELLO, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text


def assert_400(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    return err


# ---- a schema the grammar engine cannot finish ---------------------------------------------
def test_an_endless_schema_ends_the_reply_cleanly_whole_and_streamed(server):
    url, _ = server
    body = {
        "messages": HELLO,
        "max_tokens": 50,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": ENDLESS}},
    }
    r = post(url, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # The engine gives up after the first tokens: the reply is what it held, cut as a limit cuts.
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")
    status, events = stream_events(url, body)
    assert status == 200 and events[-1] == "[DONE]"
    assert not any("error" in e for e in events if isinstance(e, dict)), events
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finishes[-1] == "length"
    still_serves(url)


def test_the_audits_recursive_schema_is_answered(server):
    url, _ = server
    body = {
        "messages": HELLO,
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": RECURSIVE}},
    }
    r = post(url, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_decoder_ends_with_length_where_the_grammar_engine_gives_up(rag):
    constraint = rag.json_constraint(ENDLESS)
    d = Decoder(Sampling(max_new_tokens=100, temperature=0), 100, rag.tokenizer, rag.eos, constraint)
    flat = torch.zeros(rag.handle.config.vocab_size)  # the mask alone picks each token
    while not d.done:
        d.accept(d.draw(flat.clone()))
    # Ended where the engine gave up, long before the budget, and not as a finished document.
    assert d.finish_reason == "length" and len(d.tokens) < 100


# ---- sizes bounded before the model's work ------------------------------------------------
def test_a_hundred_thousand_messages_are_refused_before_rendering(server, rag):
    url, _ = server
    many = [{"role": "user", "content": "hi"}] * 100_000
    assert len(many) > rag.handle.max_context
    err = assert_400(post(url, {"messages": many, "max_tokens": 2}), "messages")
    assert err["code"] == "context_length_exceeded" and "100,000 messages" in err["message"]
    # With tools the messages would be rendered in the serving layer: refused there first too.
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert_400(post(url, {"messages": many, "tools": [tool]}), "messages")
    # Few messages whose characters together pass the limit: refused by their sum.
    half = [{"role": "user", "content": "x" * 600_000}] * 2
    err = assert_400(post(url, {"messages": half}), "messages")
    assert "1,200,000 characters" in err["message"]
    assert Counting.submitted == 0
    still_serves(url)


def test_logit_bias_is_held_to_openais_300_entries(server, rag):
    url, _ = server
    ok = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)}
    assert post(url, {"messages": HELLO, "max_tokens": 1, "logit_bias": ok}).status_code == 200
    for n in (MAX_LOGIT_BIAS_ENTRIES + 1, 1_000_000):
        bias = {str(i): 1.0 for i in range(n)}
        err = assert_400(post(url, {"messages": HELLO, "logit_bias": bias}), "logit_bias")
        assert f"{n:,}" in err["message"]
    assert Counting.submitted == 1
    still_serves(url)


def test_a_chunked_body_past_the_limit_gets_a_413(rag):
    with Scheduler(rag) as sch, running(create_app(rag, sch, max_body_bytes=4096)) as url:
        body = json.dumps({"messages": [{"role": "user", "content": "z" * 10_000}]}).encode()

        def chunks():  # no Content-Length: httpx sends it chunked
            for i in range(0, len(body), 1024):
                yield body[i : i + 1024]

        r = httpx.post(url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"], r.text
        small = json.dumps({"messages": HELLO, "max_tokens": 1}).encode()
        r = httpx.post(
            url + "/v1/chat/completions", content=iter([small]), headers={"content-type": "application/json"}
        )
        assert r.status_code == 200, r.text


# ---- one validation rule, whole or streamed ----------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**70),
        ("seed", -(2**63) - 1),
        ("seed", True),
        ("max_tokens", True),
        ("max_tokens", "5"),
        ("max_tokens", 5.0),
        ("max_completion_tokens", False),
        ("n", True),
        ("top_k", True),
        ("min_tokens", True),
        ("temperature", True),
        ("temperature", "0.5"),
        ("top_p", False),
        ("stream", 1),
        ("logprobs", 1),
        ("top_logprobs", True),
    ],
)
def test_wrong_typed_or_out_of_range_fields_get_the_same_400_whole_and_streamed(server, field, value):
    url, _ = server
    body = {"messages": HELLO, "max_tokens": 2, field: value}
    assert_400(post(url, body), field)
    if field != "stream":
        status, (err,) = stream_events(url, body)
        assert status == 400 and err["error"]["param"] == field, err
    assert Counting.submitted == 0


def test_completion_fields_are_strict_too(server):
    url, _ = server
    for field, value in (("seed", 2**64), ("max_tokens", True), ("logprobs", True), ("echo", 0), ("best_of", 1.0)):
        r = post(url, {"prompt": "Hello", "max_tokens": 2, field: value}, path="/v1/completions")
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert Counting.submitted == 0


def test_seeds_across_int64_are_served_for_every_choice(server):
    url, _ = server
    for seed in (2**63 - 1, -(2**63), 0):
        body = {"messages": HELLO, "max_tokens": 3, "temperature": 1.0, "seed": seed, "n": 2}
        r = post(url, body)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        assert post(url, body).json()["choices"] == r.json()["choices"]  # a seed repeats
        status, events = stream_events(url, body)
        assert status == 200 and events[-1] == "[DONE]"


# ---- readiness apart from liveness -------------------------------------------------------
def test_ready_follows_the_lifecycle_and_health_stays_live(rag):
    life = Lifecycle("starting")
    with Scheduler(rag) as sch, running(create_app(rag, sch, lifecycle=life)) as url:
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.get(url + "/ready")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        r = post(url, {"messages": HELLO, "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "starting" in r.json()["error"]["message"]
        life.mark_ready()
        assert httpx.get(url + "/ready").status_code == 200
        assert post(url, {"messages": HELLO, "max_tokens": 1}).status_code == 200
        assert life.drain(sch, timeout_s=5) is True  # nothing in flight: drained at once
        assert httpx.get(url + "/ready").json()["status"] == "draining"
        r = post(url, {"messages": HELLO, "max_tokens": 1})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [1, 2]})):
            r = httpx.post(url + path, json=body)  # the tokenizer endpoints are API work too
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], path
        assert httpx.get(url + "/health").status_code == 200
        assert 'endpoint="/ready",status="503"' in httpx.get(url + "/metrics").text


# ---- the process after them ----------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


HOSTILE = [
    {"messages": [{"role": "user", "content": "hi"}] * 100_000},
    {"messages": HELLO, "logit_bias": {str(i): 1.0 for i in range(1_000_000)}},
    {"messages": [{"role": "user", "content": "x" * 600_000}] * 2},
    {"messages": HELLO, "seed": 2**70, "stream": True},
    {"messages": HELLO, "max_tokens": True},
    {
        "messages": HELLO,
        "max_tokens": 20,
        "response_format": {"type": "json_schema", "json_schema": {"schema": ENDLESS}},
    },
]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads a process's RSS from /proc")
def test_a_server_process_answers_every_hostile_request_and_its_memory_stays_level(model_dir, tmp_path):
    """Memory a hostile body's parse took is handed back or reused: after a first round of
    them (the allocator's pools grown once), rounds more leave the RSS within 5% of its level
    -- nothing a request refused keeps growing it."""
    with kvrag_serve(model_dir, str(tmp_path / "kv"), "--max-concurrency", "2") as (p, url):
        for _ in range(2):  # warm: the prefix cache, the grammar engine
            still_serves(url)
        levels = []
        for _ in range(3):
            statuses = [post(url, body).status_code for body in HOSTILE]
            assert statuses == [400, 400, 400, 400, 400, 200], statuses
            still_serves(url)
            levels.append(rss_bytes(p.pid))
        assert max(levels[1:]) <= levels[0] * 1.05, [x >> 20 for x in levels]
