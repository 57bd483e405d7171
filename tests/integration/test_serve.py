"""``kvrag serve`` end to end: a real uvicorn server on 127.0.0.1 (a free port, in a thread,
stopped after each test) in front of a tiny random-weight model, driven by the ``openai``
package unchanged (sync, async, streaming) and by raw HTTP for what no client sends (malformed
bodies, 1M-character prompts). Greedy answers are compared with ``KVRag.generate`` on the same
prompt and policy; cache hits are read from OpenAI's own usage field
(``usage.prompt_tokens_details.cached_tokens``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from typing import Literal

import httpx
import openai
import pytest
from helpers.corpus import DOCS as CORPUS
from helpers.corpus import head_tokens
from helpers.serve import kvrag_serve, running

from kvrag.engine import KVRag
from kvrag.serve.app import create_app
from kvrag.serve.scheduler import Scheduler
from kvrag.testing import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = CORPUS[:3]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def messages(question: str = "Where does the red fox live?") -> list[dict]:
    context = "\n\n".join(DOCS)
    return [{"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]


@pytest.fixture(scope="module")
def handle():
    return tiny_llama(seed=0)


@pytest.fixture
def rag(handle, tmp_path):
    rag = KVRag(handle, cache_dir=tmp_path / "kv")
    rag.precompute(DOCS)
    return rag


@pytest.fixture
def server(rag):
    """(base URL, scheduler) of a server over ``rag``; 2 decode slots, 4 waiting."""
    with Scheduler(rag, max_concurrency=2, max_queue=4) as sch, running(create_app(rag, sch, model_name="tiny")) as url:
        yield url, sch


def client(url, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw)


# ---- answers: the library's, through the wire ----------------------------------------------
def test_import_kvrag_imports_no_web_framework():
    code = (
        "import sys, kvrag, kvrag.serve, kvrag.cli; kvrag.cli.build_parser(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'starlette', 'uvicorn', 'prometheus_client', 'httpx', 'openai', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_openai_sync_chat_and_completion_equal_generate_with_cached_tokens(server, rag):
    url, _ = server
    c = client(url)
    want = rag.generate(messages(), max_new_tokens=8)
    assert want.stats.cached_tokens > 0
    got = c.chat.completions.create(model="tiny", messages=messages(), max_tokens=8, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens_details.cached_tokens == want.stats.read_tokens
    assert got.usage.prompt_tokens == want.stats.prompt_tokens
    assert got.usage.completion_tokens == len(want.token_ids)
    # /v1/completions takes the rendered string: the same prompt, the same answer.
    prompt = rag.render(messages())
    got = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens_details.cached_tokens == want.stats.read_tokens


def test_openai_stream_with_usage_gives_generates_text(server, rag):
    url, _ = server
    want = rag.generate(messages(), max_new_tokens=10)
    stream = client(url).chat.completions.create(
        model="tiny",
        messages=messages(),
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == want.text
    assert finish == want.finish_reason
    assert usage.prompt_tokens_details.cached_tokens == want.stats.read_tokens > 0
    # /v1/completions streams text_completion chunks, without usage unless asked.
    chunks = list(
        client(url).completions.create(
            model="tiny", prompt=rag.render(messages()), max_tokens=10, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == want.finish_reason


def test_async_client_concurrent_streams_each_get_their_tokens_alone(server, rag):
    url, _ = server
    questions = ["Where does the red fox live?", "How tall is Mount Kelvar?", "Who founded Brisk?", "Why?"]
    alone = {q: rag.generate(messages(q), max_new_tokens=12).text for q in questions}
    ac = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

    async def one(q):
        stream = await ac.chat.completions.create(
            model="tiny", messages=messages(q), max_tokens=12, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        try:
            return await asyncio.gather(*(one(q) for q in questions))
        finally:
            await ac.close()

    got = asyncio.run(main())
    assert dict(zip(questions, got)) == alone


def test_per_request_policy_through_extra_body(server, rag):
    url, _ = server
    c = client(url)
    full = c.chat.completions.create(
        model="tiny", messages=messages(), max_tokens=6, temperature=0, extra_body={"kvrag": {"policy": "full_prefill"}}
    )
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert full.choices[0].message.content == rag.generate(messages(), max_new_tokens=6, policy="full_prefill").text
    want = rag.generate(messages(), max_new_tokens=6, policy="epic", k_head=2)
    got = c.chat.completions.create(
        model="tiny",
        messages=messages(),
        max_tokens=6,
        temperature=0,
        extra_body={"kvrag": {"policy": "epic", "k_head": 2}},
    )
    assert got.choices[0].message.content == want.text
    assert got.model_extra["kvrag"]["policy"] == "epic"
    assert got.usage.prompt_tokens_details.cached_tokens == want.stats.read_tokens > 0
    # "auto" is the server's own policy, as KVRag.generate(policy="auto") is the KVRag's.
    own = c.chat.completions.create(
        model="tiny", messages=messages(), max_tokens=6, temperature=0, extra_body={"kvrag": {"policy": "auto"}}
    )
    assert own.model_extra["kvrag"]["policy"] == rag.policy.name
    assert own.choices[0].message.content == rag.generate(messages(), max_new_tokens=6, policy="auto").text


def test_sampling_with_a_seed_repeats(server):
    url, _ = server
    c = client(url)
    kw = dict(model="tiny", messages=messages(), max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    assert c.chat.completions.create(**kw).choices[0].message.content == (
        c.chat.completions.create(**kw).choices[0].message.content
    )


def test_stop_sequence_ends_the_answer(server, rag):
    url, _ = server
    want = rag.generate(messages(), max_new_tokens=8)
    stop = want.text.split()[1]
    got = client(url).chat.completions.create(
        model="tiny", messages=messages(), max_tokens=8, temperature=0, stop=[stop]
    )
    assert got.choices[0].finish_reason == "stop"
    assert stop not in got.choices[0].message.content
    assert want.text.startswith(got.choices[0].message.content)


def test_logprobs_through_the_openai_client_whole_and_streamed(server, rag):
    url, _ = server
    c = client(url)
    want = rag.generate(messages(), max_new_tokens=6)
    n = len(want.token_ids) - (want.finish_reason == "stop")  # an EOS that ends the reply has no entry
    kw = dict(model="tiny", messages=messages(), max_tokens=6, temperature=0)
    got = c.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == want.text and len(content) == n
    assert "".join(t.token for t in content) == want.text
    for t in content:
        assert bytes(t.bytes).decode("utf-8") == t.token
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0  # greedy: the argmax
    streamed = [
        t
        for chunk in c.chat.completions.create(**kw, logprobs=True, top_logprobs=2, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [(t.token, t.top_logprobs[1].token) for t in streamed] == [
        (t.token, t.top_logprobs[1].token) for t in content
    ]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert c.chat.completions.create(**kw).choices[0].logprobs is None
    # /v1/completions: the legacy shape, text offsets into the reply.
    prompt = rag.render(messages())
    lp = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2).choices[0].logprobs
    assert lp.tokens == [t.token for t in content]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert [len(d) for d in lp.top_logprobs] == [len({a.token for a in t.top_logprobs}) for t in content]
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(
        c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0, stream=True)
    )
    offsets = [o for ch in chunks if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_penalties_logit_bias_and_top_k_through_the_openai_client(server, rag):
    url, _ = server
    c = client(url)
    fox = rag.tokenizer.encode(" fox", add_special_tokens=False)[0]
    got = c.chat.completions.create(
        model="tiny", messages=messages(), max_tokens=3, temperature=0, logit_bias={str(fox): 100}
    )
    assert got.choices[0].message.content == " fox" * 3
    opts = dict(presence_penalty=1.5, frequency_penalty=-0.5, logit_bias={fox: 4.0})
    want = rag.generate(messages(), max_new_tokens=6, temperature=0.7, top_k=4, seed=5, **opts)
    got = c.chat.completions.create(
        model="tiny",
        messages=messages(),
        max_tokens=6,
        temperature=0.7,
        seed=5,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        logit_bias={str(fox): 4.0},
        extra_body={"top_k": 4},
    )
    assert got.choices[0].message.content == want.text
    for extra, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"fox": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {str(10**9): 1}}, None),  # outside the vocabulary: named in the message
    ]:
        r = httpx.post(
            url + "/v1/chat/completions", json={"messages": messages(), "max_tokens": 2, **extra}, timeout=60
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param, err
        if param is None:
            assert "vocabulary" in err["message"], err


def test_several_choices_whole_and_streamed(server, rag):
    url, _ = server
    c = client(url)
    kw = dict(model="tiny", max_tokens=5, temperature=0.9, seed=7, n=2)
    want = [rag.generate(messages(), max_new_tokens=5, temperature=0.9, seed=7 + i) for i in range(2)]
    got = c.chat.completions.create(messages=messages(), **kw)
    assert [ch.index for ch in got.choices] == [0, 1]
    assert [ch.message.content for ch in got.choices] == [w.text for w in want]
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert got.usage.prompt_tokens == want[0].stats.prompt_tokens
    assert got.usage.prompt_tokens_details.cached_tokens == want[0].stats.read_tokens
    texts, finish, usage = ["", ""], [None, None], None
    for chunk in c.chat.completions.create(
        messages=messages(), stream=True, stream_options={"include_usage": True}, **kw
    ):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finish[ch.index] = ch.finish_reason or finish[ch.index]
        usage = chunk.usage or usage
    assert texts == [w.text for w in want] and finish == [w.finish_reason for w in want]
    assert usage.completion_tokens == got.usage.completion_tokens
    comp = c.completions.create(prompt=rag.render(messages()), **kw)
    assert [ch.text for ch in comp.choices] == [w.text for w in want]


def test_structured_output_through_the_openai_client_and_langchain(server, rag):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    url, _ = server
    c = client(url)
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer"}},
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    got = c.chat.completions.create(
        model="tiny", messages=messages(), max_tokens=40, temperature=0, response_format=fmt
    )
    assert got.choices[0].finish_reason == "stop"
    doc = json.loads(got.choices[0].message.content)
    assert doc["answer"] in ("yes", "no") and isinstance(doc["confidence"], int)
    assert got.choices[0].message.content == rag.generate(messages(), max_new_tokens=40, json_schema=schema).text
    obj = c.chat.completions.create(
        model="tiny", messages=messages(), max_tokens=4, temperature=0, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content.startswith("{")

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        confidence: int

    llm = ChatOpenAI(model="tiny", base_url=url + "/v1", api_key="none", max_tokens=40, temperature=0, max_retries=0)
    verdict = llm.with_structured_output(Verdict, method="json_schema").invoke(messages()[0]["content"])
    assert isinstance(verdict, Verdict)
    for bad, param in [
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, None),
    ]:
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": messages(), "max_tokens": 2, "response_format": bad},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the documents",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 16}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "count",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    },
]


def test_tool_calls_required_named_streamed_and_tool_results_served_from_chunk_caches(server, rag):
    url, _ = server
    c = client(url)
    kw = dict(model="tiny", messages=messages(), max_tokens=60, temperature=0, tools=TOOLS)
    got = c.chat.completions.create(tool_choice="required", **kw).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content is None
    (call,) = got.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("search", "count")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"query"} if call.function.name == "search" else {"n"})
    named = c.chat.completions.create(tool_choice={"type": "function", "function": {"name": "count"}}, **kw)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "count" and isinstance(json.loads(call.function.arguments)["n"], int)
    # Streamed: the call arrives whole, in one chunk, when the reply ends.
    deltas = [
        ch.choices[0] for ch in c.chat.completions.create(tool_choice="required", stream=True, **kw) if ch.choices
    ]
    streamed = [t for d in deltas if d.delta.tool_calls for t in d.delta.tool_calls]
    assert len(streamed) == 1 and streamed[0].function.name == got.message.tool_calls[0].function.name
    assert deltas[-1].finish_reason == "tool_calls"
    # "auto": the model chooses; this random one writes text, which comes back as text.
    auto = c.chat.completions.create(**kw).choices[0]
    assert auto.finish_reason in ("stop", "length") and auto.message.tool_calls is None and auto.message.content
    # The agent's next turn: its call and the tool's result, the retrieved passage verbatim.
    turns = [
        {"role": "user", "content": "Where does the red fox live?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "fox"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": DOCS[0]},
    ]
    answer = c.chat.completions.create(model="tiny", messages=turns, max_tokens=4, temperature=0, tools=TOOLS)
    assert answer.usage.prompt_tokens_details.cached_tokens >= len(rag.chunk_ids(DOCS[0]))
    for bad, param in [
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ]:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": messages(), "max_tokens": 2, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_langchain_bind_tools_gets_the_call(server):
    from langchain_openai import ChatOpenAI

    url, _ = server

    # An enum: a random model given a free string may not close it within the token budget.
    def lookup(city: Literal["Brisk", "Aldport"]) -> str:
        """Look a city up in the atlas."""
        return city

    llm = ChatOpenAI(model="tiny", base_url=url + "/v1", api_key="none", max_tokens=40, temperature=0, max_retries=0)
    msg = llm.bind_tools([lookup], tool_choice="required").invoke("Where is Brisk?")
    (call,) = msg.tool_calls
    assert call["name"] == "lookup" and call["args"]["city"] in ("Brisk", "Aldport") and call["id"].startswith("call_")


# ---- refusals in OpenAI's shape ------------------------------------------------------------
def test_unsupported_fields_are_refused_naming_them(server):
    url, _ = server
    c = client(url)
    for kw, param in [
        ({"n": 3}, "n"),  # more choices than the server's 2 decode slots
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true, as OpenAI refuses it
        ({"extra_body": {"best_of": 2}}, "best_of"),
        ({"extra_body": {"functions": [{"name": "f", "parameters": {}}]}}, "functions"),
        ({"extra_body": {"guided_json": {}}}, "guided_json"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=messages(), max_tokens=2, **kw)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body


def test_logprobs_out_of_range_or_of_the_wrong_kind_are_named(server, rag):
    url, _ = server
    prompt = rag.render(messages())
    for path, extra, param in [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),  # a count, not a flag, on this endpoint
    ]:
        body = {"model": "tiny", "max_tokens": 2, **extra}
        body.update({"messages": messages()} if "chat" in path else {"prompt": prompt})
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "logprobs": False}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


def test_defaults_clients_send_are_accepted(server):
    url, _ = server
    body = {
        "model": "gpt-4o",
        "messages": messages(),
        "max_tokens": 2,
        "n": 1,
        "stream": False,
        "user": "alice",
        "logprobs": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": None,
        "tools": None,
        "response_format": {"type": "text"},
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"


def test_unknown_policy_and_bad_params_name_the_problem(server):
    url, _ = server
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="t", messages=messages(), extra_body={"kvrag": {"policy": "nope"}})
    assert "unknown policy 'nope'" in e.value.body["message"] and "cacheblend" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="t", messages=messages(), extra_body={"kvrag": {"policy": "epic", "bogus": 1}})
    assert "bogus" in e.value.body["message"] and "k_head" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model="t", messages=messages(), extra_body={"kvrag": {"policy": "cacheblend", "recompute_ratio": 5}}
        )
    assert "recompute_ratio" in e.value.body["message"]


def test_malformed_huge_and_over_context_requests_get_a_clear_400_and_the_server_goes_on(server, rag):
    url, sch = server
    post = url + "/v1/chat/completions"
    cases = [
        ("{not json", "malformed JSON"),
        ("[]", "body"),
        (json.dumps({"messages": []}), "messages"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "role"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 1_000_000}]}), "1,000,000 characters"),
        (json.dumps({"messages": [{"role": "user", "content": "hello " * 5000}]}), "exceeds the model context"),
        (json.dumps({"messages": messages(), "max_tokens": 0}), "max_tokens"),
        (json.dumps({"messages": messages(), "max_tokens": rag.handle.max_context}), "context exceeded"),
        (json.dumps({"messages": messages(), "max_tokens": 4, "min_tokens": 5}), "min_tokens"),
        (json.dumps({"messages": messages(), "min_tokens": -1}), "min_tokens"),
        (json.dumps({"messages": messages(), "temperature": 3}), "temperature"),
    ]
    for body, words in cases:
        t = time.perf_counter()
        r = httpx.post(post, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (body[:60], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
        assert time.perf_counter() - t < 10
    r = httpx.post(url + "/v1/completions", json={"prompt": "y" * 1_000_000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    ok = client(url).chat.completions.create(model="t", messages=messages(), max_tokens=3, temperature=0)
    assert ok.choices[0].message.content == rag.generate(messages(), max_new_tokens=3).text
    assert sch.queue_depth == 0 and sch.running == 0


def test_api_key(rag):
    with Scheduler(rag) as sch, running(create_app(rag, sch, api_key="s3cret")) as url:
        with pytest.raises(openai.AuthenticationError) as e:
            client(url, api_key="wrong").chat.completions.create(model="t", messages=messages(), max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        r = httpx.get(url + "/v1/models", timeout=30)  # no key at all
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        ok = client(url, api_key="s3cret").chat.completions.create(model="t", messages=messages(), max_tokens=2)
        assert ok.usage.completion_tokens >= 1
        assert [m.id for m in client(url, api_key="s3cret").models.list()] == ["kvrag"]


# ---- load: queue limit, disconnects, failures -----------------------------------------------
class _Gate:
    """Holds the scheduler's worker inside a prefill until released (the library's own
    ``KVRag._fuse``, wrapped), so "the server is busy" is a state, not a race."""

    def __init__(self, rag, monkeypatch, fail_on: str | None = None):
        self.entered, self.release = threading.Event(), threading.Event()
        fuse = rag._fuse

        def gated(prep, *a, **k):
            self.entered.set()
            assert self.release.wait(60), "gate never released"
            if fail_on is not None and any(p.key == fail_on for p in prep.pieces):
                raise OSError("simulated store fault")
            return fuse(prep, *a, **k)

        monkeypatch.setattr(rag, "_fuse", gated)


def test_past_max_queue_a_503_with_retry_after(rag, monkeypatch):
    gate = _Gate(rag, monkeypatch)
    with Scheduler(rag, max_concurrency=1, max_queue=1) as sch, running(create_app(rag, sch)) as url:
        body = {"messages": messages(), "max_tokens": 2, "temperature": 0}
        results = []

        def send():
            results.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code)

        first = threading.Thread(target=send)
        first.start()
        assert gate.entered.wait(30)  # the one slot is busy
        second = threading.Thread(target=send)
        second.start()
        deadline = time.monotonic() + 30
        while sch.queue_depth < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sch.queue_depth == 1  # the one waiting place is taken
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.APIStatusError) as e:
            client(url).chat.completions.create(**body, model="t")
        assert e.value.status_code == 503
        gate.release.set()
        first.join(60)
        second.join(60)
        assert results == [200, 200]
        assert 'kvrag_rejected_requests_total{reason="queue_full"} 2.0' in httpx.get(url + "/metrics").text


def test_a_disconnected_stream_frees_its_slot(rag, monkeypatch):
    tickets = []
    with Scheduler(rag, max_concurrency=1, max_queue=2) as sch, running(create_app(rag, sch)) as url:
        submit = sch.submit_choices
        monkeypatch.setattr(sch, "submit_choices", lambda req: tickets.extend(submit(req)) or tickets[-1:])
        body = {"messages": messages(), "max_tokens": 3000, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]  # the answer is under way
                assert any('"content"' in x for x in got)
        # The connection is closed: the request ends "cancelled" long before its 3,000 tokens.
        fin = tickets[0].result(timeout=30)
        assert fin.finish_reason == "cancelled" and fin.completion_tokens < 3000
        deadline = time.monotonic() + 10
        while sch.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sch.running == 0
        ok = client(url).chat.completions.create(model="t", messages=messages(), max_tokens=3, temperature=0)
        assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_non_streaming_client_that_gives_up_cancels_its_request(rag, monkeypatch):
    tickets = []
    with Scheduler(rag, max_concurrency=1, max_queue=2) as sch, running(create_app(rag, sch)) as url:
        submit = sch.submit_choices
        monkeypatch.setattr(sch, "submit_choices", lambda req: tickets.extend(submit(req)) or tickets[-1:])
        body = {"messages": messages(), "max_tokens": 3000, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
        fin = tickets[0].result(timeout=30)
        assert fin.finish_reason == "cancelled" and fin.completion_tokens < 3000


def test_a_failing_request_fails_alone(rag, monkeypatch):
    want = rag.generate(messages(), max_new_tokens=4).text
    (boom,) = rag.precompute(["A chunk whose reads fail in this test: BOOM."])
    gate = _Gate(rag, monkeypatch, fail_on=boom)
    gate.release.set()
    with Scheduler(rag, max_concurrency=2, max_queue=4) as sch, running(create_app(rag, sch)) as url:
        bad = [{"role": "user", "content": "Context:\nA chunk whose reads fail in this test: BOOM.\n\nQuestion: ?"}]
        c = client(url)
        out = {}

        def ask(name, msgs, stream=False):
            try:
                r = c.chat.completions.create(model="t", messages=msgs, max_tokens=4, temperature=0, stream=stream)
                out[name] = "".join(x.choices[0].delta.content or "" for x in r if x.choices) if stream else r
            except openai.APIError as e:
                out[name] = e

        threads = [
            threading.Thread(target=ask, args=("bad", bad)),
            threading.Thread(target=ask, args=("good", messages())),
            threading.Thread(target=ask, args=("bad_stream", bad, True)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert isinstance(out["bad"], openai.InternalServerError) and "simulated store fault" in out["bad"].message
        assert isinstance(out["bad_stream"], openai.APIError) and "simulated store fault" in str(out["bad_stream"])
        assert out["good"].choices[0].message.content == want
        assert sch.running == 0
        metrics = httpx.get(url + "/metrics").text
        assert 'kvrag_finished_requests_total{finish_reason="error"} 2.0' in metrics
        assert 'kvrag_finished_requests_total{finish_reason="length"} 1.0' in metrics


# ---- chunks over HTTP, metrics, replicas ---------------------------------------------------
def _ingest(url, texts, headers=None) -> list[str]:
    r = httpx.post(url + "/v1/chunks", json={"texts": texts}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    keys = [d["key"] for d in r.json()["data"]]
    deadline = time.monotonic() + 60
    for k in keys:
        while not httpx.get(f"{url}/v1/chunks/{k}", headers=headers, timeout=30).json()["stored"]:
            assert time.monotonic() < deadline, "chunk never stored"
            time.sleep(0.05)
    return keys


def test_chunks_posted_over_http_are_hits_on_the_first_query(handle, tmp_path):
    rag = KVRag(handle, cache_dir=tmp_path / "kv")  # nothing ingested
    with Scheduler(rag) as sch, running(create_app(rag, sch, model_name="tiny")) as url:
        r = httpx.post(url + "/v1/chunks", json={"texts": [DOCS[0], "   "]}, timeout=60).json()["data"]
        assert r[0]["status"] == "queued" and r[0]["key"] == rag.chunk_key(DOCS[0])
        assert r[1]["status"] == "rejected" and "empty" in r[1]["error"]
        keys = _ingest(url, DOCS)
        assert keys == [rag.chunk_key(d) for d in DOCS]
        again = httpx.post(url + "/v1/chunks", json={"texts": DOCS[:1]}, timeout=60).json()["data"]
        assert again[0]["status"] == "stored"
        assert httpx.get(url + "/v1/chunks/" + "0" * 64).json() == {"key": "0" * 64, "stored": False}
        assert httpx.get(url + "/v1/chunks/not-a-key").status_code == 400
        got = client(url).chat.completions.create(model="t", messages=messages(), max_tokens=3, temperature=0)
        chunks = sum(len(rag.chunk_ids(d)) for d in DOCS)
        assert got.usage.prompt_tokens_details.cached_tokens == chunks + head_tokens(rag, messages())


def test_metrics_count_requests_ttft_and_cache_share(server):
    url, _ = server
    c = client(url)
    c.chat.completions.create(model="t", messages=messages(), max_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="t", messages=messages(), n=3)
    text = httpx.get(url + "/metrics").text
    assert 'kvrag_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'kvrag_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert "kvrag_time_to_first_token_seconds_count 1.0" in text
    assert "kvrag_time_per_output_token_seconds_count 1.0" in text
    assert "kvrag_chunk_hits_total 3.0" in text
    share = float(next(x for x in text.splitlines() if x.startswith("kvrag_cached_token_share ")).split()[1])
    assert 0 < share < 1
    assert "kvrag_queue_depth 0.0" in text
    # The one request decoded its 3 tokens after the first in batched steps of one.
    assert "kvrag_decode_step_seconds_count 3.0" in text
    assert 'kvrag_decode_batch_size_bucket{le="1.0"} 3.0' in text


def test_two_replicas_sharing_redis_share_chunks(handle, tmp_path, redis_url, prefix):
    from kvrag.store import open_shared

    a = KVRag(handle, cache_dir=tmp_path / "a", shared=open_shared(redis_url, prefix=prefix))
    b = KVRag(handle, cache_dir=tmp_path / "b", shared=open_shared(redis_url, prefix=prefix))
    with (
        Scheduler(a) as sa,
        Scheduler(b) as sb,
        running(create_app(a, sa)) as url_a,
        running(create_app(b, sb)) as url_b,
    ):
        keys = _ingest(url_a, DOCS)  # ingested through replica A only
        assert all(httpx.get(f"{url_b}/v1/chunks/{k}").json()["stored"] for k in keys)
        got = client(url_b).chat.completions.create(model="t", messages=messages(), max_tokens=3, temperature=0)
        chunks = sum(len(b.chunk_ids(d)) for d in DOCS)
        assert got.usage.prompt_tokens_details.cached_tokens == chunks + head_tokens(b, messages())
        assert got.choices[0].message.content == a.generate(messages(), max_new_tokens=3).text


# ---- the command ---------------------------------------------------------------------------
def test_cli_refuses_bad_options_before_loading_a_model():
    env = dict(os.environ, PYTHONPATH=ROOT)
    for args, words in [
        (["--param", "epic.bogus=1", "--policy", "epic"], "bogus"),
        (["--param", "cacheblend.recompute_ratio=0.2", "--policy", "epic"], "cacheblend"),
        (["--policy", "nope"], "unknown policy"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--precompute-via", "queue"], "needs --shared"),
        (["--threads", "0"], "--threads"),
        (["--decode-weights", "half"], "--decode-weights"),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "kvrag", "serve", "--model", "/nonexistent", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 2 and words in out.stderr, out.stderr


@pytest.fixture(scope="module")
def model_dir(handle, tmp_path_factory):
    """The tiny model saved once: every server process loads the same files (same fingerprint)."""
    d = tmp_path_factory.mktemp("tiny-model")
    handle.model.save_pretrained(d)
    handle.tokenizer.save_pretrained(d)
    return str(d)


def test_cli_serves_a_model_dir_with_an_api_key_from_the_environment(model_dir, tmp_path):
    # Decoding from float16 copies of the weights, said at start.
    args = ("--decode-weights", "float16")
    with kvrag_serve(model_dir, str(tmp_path / "kv"), *args, env_extra={"KVRAG_API_KEY": "k1"}) as (p, url):
        keys = _ingest(url, DOCS, headers={"Authorization": "Bearer k1"})
        assert len(keys) == 3
        got = client(url, api_key="k1").chat.completions.create(model="model", messages=messages(), max_tokens=4)
        assert got.model == os.path.basename(model_dir) and got.usage.prompt_tokens_details.cached_tokens > 0
        assert got.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="k2").chat.completions.create(model="model", messages=messages(), max_tokens=2)
        p.kill()
        out = p.communicate(timeout=30)[0]
    assert "decode reads float16 copies of the weights" in out, out


def test_two_server_processes_on_one_redis_prefix_share_chunks(model_dir, tmp_path, redis_url, prefix):
    common = ["--shared", redis_url, "--shared-prefix", prefix]
    with (
        kvrag_serve(model_dir, str(tmp_path / "a"), *common) as (_, url_a),
        kvrag_serve(model_dir, str(tmp_path / "b"), *common) as (_, url_b),
    ):
        keys = _ingest(url_a, DOCS)  # through server A only
        assert all(httpx.get(f"{url_b}/v1/chunks/{k}").json()["stored"] for k in keys)
        got = client(url_b).chat.completions.create(model="m", messages=messages(), max_tokens=3, temperature=0)
        assert got.usage.prompt_tokens_details.cached_tokens > 0
        assert got.model_extra["kvrag"]["chunks_hit"] == 3


def test_serve_compiled_builds_its_step_before_ready_and_answers_as_eager(model_dir, tmp_path):
    """``kvrag serve --compile on`` (what ``auto`` means for a server) builds the compiled step
    at start — /ready waits for it and the time is printed — and answers, concurrently,
    what op-by-op decoding answers."""
    questions = ["Where does the red fox live?", "How tall is Mount Kelvar?", "Who founded Brisk?"]
    eager = KVRag(model_dir, cache_dir=tmp_path / "eager", compile="off")
    eager.precompute(DOCS)
    want = [eager.generate(messages(q), max_new_tokens=12).text for q in questions]
    with kvrag_serve(model_dir, str(tmp_path / "kv"), "--compile", "on", timeout=600) as (p, url):
        _ingest(url, DOCS)
        c = client(url)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # several requests: the batched graph too
            got = list(
                pool.map(
                    lambda q: c.chat.completions.create(model="m", messages=messages(q), max_tokens=12, temperature=0),
                    questions,
                )
            )
        p.kill()
        out = p.communicate(timeout=30)[0]
    assert "compiled the prefill's computed rows and the decode step in" in out, out
    assert [g.choices[0].message.content for g in got] == want
    assert all(g.usage.prompt_tokens_details.cached_tokens > 0 for g in got)


@pytest.mark.real
def test_real_smollm2_greedy_answers_through_the_server_equal_generate(tmp_path):
    rag = KVRag(cache_dir=tmp_path / "kv")  # the default SmolLM2-135M-Instruct
    rag.precompute(DOCS)
    questions = ["Where does the red fox live?", "How tall is Mount Kelvar?"]
    with Scheduler(rag, max_concurrency=2) as sch, running(create_app(rag, sch)) as url:
        c = client(url)
        for policy in ("cacheblend", "full_prefill"):
            for q in questions:
                want = rag.generate(messages(q), max_new_tokens=16, policy=policy)
                got = c.chat.completions.create(
                    model="smollm2",
                    messages=messages(q),
                    max_tokens=16,
                    temperature=0,
                    extra_body={"kvrag": {"policy": policy}},
                )
                assert got.choices[0].message.content == want.text
                assert got.usage.prompt_tokens_details.cached_tokens == want.stats.read_tokens
                assert (want.stats.cached_tokens > 0) == (policy != "full_prefill")


def test_oversized_bodies_and_chunks_are_refused_unread(rag):
    with Scheduler(rag) as sch, running(create_app(rag, sch, max_body_bytes=4096, max_prompt_chars=1000)) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "z" * 5000}]})
        assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]
        data = httpx.post(url + "/v1/chunks", json={"texts": ["q" * 1001, DOCS[0]]}).json()["data"]
        assert data[0]["status"] == "rejected" and "too long" in data[0]["error"]
        assert data[1]["status"] == "stored"


def test_hooks_server_mode_checks_its_arguments_and_names_an_unreachable_server(rag):
    from kvrag.frameworks import ServerChunks, ServerChunksError, hook_target

    with pytest.raises(TypeError, match="not both"):
        hook_target("KVPrecompute", rag, server="http://127.0.0.1:1")
    with pytest.raises(TypeError, match="api_key= goes with server="):
        hook_target("KVPrecompute", rag, api_key="k")
    with pytest.raises(ValueError, match="http"):
        ServerChunks("127.0.0.1:8000")
    from helpers.redis_servers import free_port

    dead = ServerChunks(f"http://127.0.0.1:{free_port()}/v1", timeout=5)
    with pytest.raises(ServerChunksError, match="cannot reach the kvrag server"):
        dead.submit_many(DOCS)
    with Scheduler(rag) as sch, running(create_app(rag, sch, api_key="k")) as url:
        with pytest.raises(ServerChunksError, match="401"):
            ServerChunks(url, api_key="wrong").submit_many(DOCS)
        c = ServerChunks(url + "/v1/", api_key="k")
        assert c.submit_many(DOCS + ["  "]) == [rag.chunk_key(d) for d in DOCS] + [None]
        assert c.counts["stored"] == 3 and c.counts["rejected"] == 1
        with pytest.raises(ServerChunksError, match="rejected"):
            c.submit_many(["  "], skip_invalid=False)
        assert c.wait_until_idle(timeout=30)


def test_vllm_min_tokens_and_ignore_eos_fix_the_answer_length(server, rag):
    """vLLM's sampling extras, as benchmarks send them through extra_body: ``ignore_eos``
    decodes to max_tokens past EOS; ``min_tokens`` bars EOS until then. The tiny model's first
    greedy tokens are made its EOS, so a plain request would stop at once."""
    url, _ = server
    ref = rag.generate(rag.render(messages()), max_new_tokens=6)
    # Each request's decoder reads the KVRag's EOS ids when it is admitted.
    saved = set(rag.eos)
    rag.eos.clear()
    rag.eos.add(ref.token_ids[0])
    try:
        c = client(url)
        plain = c.chat.completions.create(model="t", messages=messages(), max_tokens=6, temperature=0)
        assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 1
        ignored = c.chat.completions.create(
            model="t", messages=messages(), max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 6
        barred = c.chat.completions.create(
            model="t", messages=messages(), max_tokens=6, temperature=0, extra_body={"min_tokens": 6}
        )
        assert barred.choices[0].finish_reason == "length" and barred.usage.completion_tokens == 6
        assert barred.choices[0].message.content != ignored.choices[0].message.content  # EOS never drawn
    finally:
        rag.eos.clear()
        rag.eos.update(saved)
