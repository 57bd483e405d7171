"""Real servers on 127.0.0.1 for the ``kvrag serve`` tests.

``running(app)``: a uvicorn server (a free port) in a thread; yields the base URL once the
server accepts connections and stops it on exit (bounded: it waits at most ``timeout`` seconds
for either). ``kvrag_serve(model_dir, cache_dir, ...)``: the command in a process of its own.
``llamaindex_usage()``: the ``usage`` field of every LlamaIndex chat answer given in a block."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import uvicorn

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def running(app, timeout: float = 30.0):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


@contextlib.contextmanager
def kvrag_serve(model_dir: str, cache_dir: str, *args: str, env_extra: dict | None = None, timeout: float = 180):
    """A ``python -m kvrag serve`` process on 127.0.0.1 (a free port) over ``model_dir`` and
    ``cache_dir`` (``env_extra``: variables added to its environment): yields (process, URL)
    once ``/ready`` answers 200; killed on exit if it is still running. The decode step is not
    compiled unless ``args`` say ``--compile``: a server's compile at start takes a minute of
    the suite's two cores, and one test (``test_serve_compiled``) covers that path. Decode reads
    the float32 weights unless ``args`` say ``--decode-weights``."""
    from helpers.redis_servers import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=_ROOT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "kvrag", "serve", "--model", model_dir, "--cache-dir", cache_dir]
    cmd += [*args, "--port", str(port), "--log-level", "warning"]
    if "--compile" not in args:
        cmd += ["--compile", "off"]
    if "--decode-weights" not in args:  # the library's default: answers compared with in-process ones
        cmd += ["--decode-weights", "float32"]
    p = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate(timeout=5)
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield p, url
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)


@contextlib.contextmanager
def llamaindex_usage():
    """Yields a list that collects the ``usage`` of every LlamaIndex chat answer that ends
    inside the block (the handler is removed on exit)."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

    seen: list = []

    class Usage(BaseEventHandler):
        @classmethod
        def class_name(cls) -> str:
            return "Usage"

        def handle(self, event, **kwargs) -> None:
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                seen.append(event.response.raw.usage)

    handler = Usage()
    get_dispatcher().add_event_handler(handler)
    try:
        yield seen
    finally:
        get_dispatcher().event_handlers.remove(handler)
