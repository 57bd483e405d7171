"""``kvrag serve`` stopped as an orchestrator stops it: SIGTERM while a stream is decoding. The
process keeps answering while it drains (``/ready`` and new requests: 503, ``/health``: 200),
the stream in flight finishes -- or, past ``--drain-timeout``, ends with an error event and
``[DONE]`` -- and the process exits 0 within the drain time. A real ``python -m kvrag serve``
on 127.0.0.1 over the tiny model saved to a directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from helpers.serve import kvrag_serve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELLO = [{"role": "user", "content": "Say hello."}]
#: Seconds past the drain a process may take to close its connections and exit.
EXIT_SLACK_S = 15


def sigterm_mid_stream(p: subprocess.Popen, url: str, max_tokens: int, during) -> list:
    """Stream a chat reply, SIGTERM the server after its first token, call ``during()`` while
    the stream goes on; the stream's events (JSON bodies; "[DONE]" as is)."""
    body = {"messages": HELLO, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    events: list = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 2:  # the role chunk, then the first token's
                p.send_signal(signal.SIGTERM)
                during()
    return events


def test_sigterm_drains_a_stream_to_its_end_refusing_new_requests(model_dir, tmp_path):
    drain_s = 120
    with kvrag_serve(model_dir, str(tmp_path / "kv"), "--drain-timeout", str(drain_s)) as (p, url):
        seen: dict = {}

        def during():
            t = time.monotonic()
            while httpx.get(url + "/ready", timeout=10).status_code != 503:  # the signal is handled async
                assert time.monotonic() - t < 10
                time.sleep(0.05)
            seen["ready"] = httpx.get(url + "/ready", timeout=10).json()
            seen["health"] = httpx.get(url + "/health", timeout=10).status_code
            r = httpx.post(url + "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1}, timeout=10)
            seen["new"] = (r.status_code, r.json()["error"], r.headers.get("retry-after"))

        t0 = time.monotonic()
        # Long enough (milliseconds a token at best) to be decoding through ``during``.
        events = sigterm_mid_stream(p, url, 3000, during)
        assert p.wait(drain_s + EXIT_SLACK_S) == 0, p.communicate(timeout=5)
        # Drained as soon as the stream ended, not at the deadline.
        assert time.monotonic() - t0 < drain_s
    assert seen["ready"]["status"] == "draining" and seen["health"] == 200
    status, error, retry = seen["new"]
    assert status == 503 and "shutting down" in error["message"] and retry == "1"
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    tokens = sum(1 for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content"))
    assert finishes[-1] == "length" and text and tokens > 1000  # the whole reply, to its token limit


def test_past_the_drain_timeout_a_stream_ends_with_an_error_event_and_the_process_exits_0(model_dir, tmp_path):
    drain_s = 1
    with kvrag_serve(model_dir, str(tmp_path / "kv"), "--drain-timeout", str(drain_s)) as (p, url):
        t0 = time.monotonic()
        # A reply far longer than the drain allows (the tiny model's whole context).
        events = sigterm_mid_stream(p, url, 4000, lambda: None)
        assert p.wait(drain_s + EXIT_SLACK_S) == 0, p.communicate(timeout=5)
        assert time.monotonic() - t0 < drain_s + EXIT_SLACK_S
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_busy" and "shutting down" in error["message"]
    tokens = sum(
        1 for e in events if isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
    )
    assert 0 < tokens < 4000


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_drain_timeout_is_refused_before_the_model_loads(value):
    out = subprocess.run(
        [sys.executable, "-m", "kvrag", "serve", "--model", "/nonexistent", "--drain-timeout", value],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode != 0 and "--drain-timeout" in out.stderr, out.stderr
