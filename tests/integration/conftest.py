"""Integration tests: a real Redis (the machine's at 127.0.0.1:6379, else one this session
starts; helpers.redis_servers), real models, processes talking over TCP."""

import uuid

import pytest
from helpers.redis_servers import RedisClusterServers, RedisServer, machine_redis, redis


@pytest.fixture(scope="session")
def redis_url():
    """URL of a Redis every test may use (with its own prefix): the machine's, or ours."""
    if machine_redis():
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


@pytest.fixture(scope="session")
def cluster_url():
    """URL (redis+cluster://) of a real 3-node Redis Cluster this test session starts."""
    cluster = RedisClusterServers().start()
    yield cluster.url
    cluster.close()


@pytest.fixture(params=["single", "cluster"])
def any_url(request):
    """The URL of a single server, then of a cluster: tests that must hold on both."""
    yield request.getfixturevalue("redis_url" if request.param == "single" else "cluster_url")


@pytest.fixture
def own_redis():
    """A redis-server of this test's own (it may be stopped and restarted)."""
    server = RedisServer().start()
    yield server
    server.close()
