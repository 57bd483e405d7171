"""Reaching the shared tier's server: its URL, the redis-py client, and what a failure means.

Servers: ``redis://``/``rediss://`` (TLS)/``unix://`` URLs reach one server (Redis or Valkey),
``redis+cluster://``/``rediss+cluster://`` a Redis (or Valkey) Cluster through redis-py's
``RedisCluster``. A password is never required in the URL: without one, ``connect`` takes it
from ``$KVRAG_REDIS_PASSWORD``, so URLs can be logged and serialized (``public_url``).

``RedisConnection`` is one server's client (made lazily for a cluster) with its outage breaker
(``kvrag.store.outage``): the ``RedisStore`` and the precompute queues on it share one, so they
back off and warn together. A failed command is either an outage (``SharedStoreDown``: the
server cannot be reached) or an error reply (``SharedStoreRefused``: OOM, READONLY, WRONGTYPE,
...), told apart by ``error_cause``.

Only what needs redis imports it (inside the functions): URL handling and the errors do not, so
kvrag without a shared tier never imports redis.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from kvrag.errors import StoreError
from kvrag.store.outage import Outage

#: The logger of the whole Redis tier (the store, its index, its outages): one name to
#: configure, whichever module of the tier speaks.
LOG_NAME = "kvrag.store.redis_store"

#: URL schemes of a Redis Cluster (redis-py's ``RedisCluster``), and the plain scheme each maps to.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
#: The password of a URL that has none (so a URL never has to carry it, see ``public_url``).
PASSWORD_ENV = "KVRAG_REDIS_PASSWORD"


class SharedStoreDown(StoreError):
    """The shared store's server cannot be reached (or timed out)."""


class SharedStoreRefused(SharedStoreDown):
    """The shared store's server answered a command with an error (OOM, READONLY, WRONGTYPE,
    ...): for the caller, like an outage -- the write did not happen."""


def error_cause(e: BaseException) -> str:
    """A short name of what a Redis error reply says (``OOM``, ``READONLY``, ``WRONGTYPE``,
    ``NOGROUP``, ...), one per kind of trouble: warnings are said once per cause."""
    import redis

    name = type(e).__name__
    if type(e) is not redis.ResponseError and isinstance(e, redis.ResponseError):
        return name  # redis-py's own class for the reply (ReadOnlyError, OutOfMemoryError, ...)
    word = str(e).split(" ", 1)[0]
    return word if word.isupper() and word.isalpha() else name


def routing_error(e: BaseException) -> bool:
    """A cluster's own errors (down, moved, cross-slot, try again): not a value that is not
    kvrag's, so never taken for one."""
    from redis import exceptions as x

    return isinstance(e, (x.ClusterError, x.AskError, x.TryAgainError, x.ClusterCrossSlotError))


def parse_url(url: str) -> tuple[str, bool]:
    """(the URL redis-py takes, whether it names a cluster) for a shared store URL; ValueError
    with the accepted forms for anything else."""
    from urllib.parse import urlsplit

    forms = (
        "redis://host:6379/0 (redis://[[user]:password@]host:port/db), rediss:// (TLS), "
        "unix:///path.sock, or redis+cluster://host:6379 (rediss+cluster://) for a Redis Cluster"
    )
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"shared store URL must look like {forms}; got {url!r}")
    scheme, rest = url.split("://", 1)
    if scheme.lower() in CLUSTER_SCHEMES:
        plain = f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}"
        try:
            parts = urlsplit(plain)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as e:
            raise ValueError(f"bad shared store URL {redact(url)}: {e}") from None
        if not parts.hostname:
            raise ValueError(f"bad shared store URL {redact(url)}: a cluster URL names one of its nodes (host:port)")
        if parts.path.strip("/") not in ("", "0") or "db=" in parts.query:
            raise ValueError(f"bad shared store URL {redact(url)}: a Redis Cluster has only database 0")
        return plain, True
    if scheme.lower() not in ("redis", "rediss", "unix"):
        raise ValueError(f"shared store URL must look like {forms}; got scheme {scheme!r} in {redact(url)}")
    return url, False


def connect(url: str, *, socket_timeout: float = 2.0):
    """A redis-py client for ``url`` (see ``parse_url``): a ``Redis``, or a ``RedisCluster``
    for ``redis+cluster://``, which asks the node it names for the cluster's slot map (so it
    raises ``redis.ConnectionError`` when no node answers). Imported here so kvrag without a
    shared tier never imports redis."""
    plain, cluster = parse_url(url)
    try:
        import redis
        from redis.cluster import RedisCluster
        from redis.exceptions import RedisClusterException
    except ImportError as e:  # pragma: no cover - redis is a core dependency
        raise StoreError("a shared store needs redis-py: pip install 'redis[hiredis]'") from e
    opts: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
    if os.environ.get(PASSWORD_ENV):
        opts["password"] = os.environ[PASSWORD_ENV]  # a password in the URL wins (redis-py)
    try:
        if not cluster:
            return redis.Redis.from_url(plain, health_check_interval=30, **opts)
        try:
            return RedisCluster.from_url(plain, **opts)
        except RedisClusterException as e:  # no node answered: an outage like any other
            raise redis.ConnectionError(str(e)) from e
    except ValueError as e:
        raise ValueError(f"bad shared store URL {redact(url)}: {e}") from None


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    head, sep, tail = url.partition("://")
    if "@" in tail:
        cred, _, host = tail.rpartition("@")
        user = cred.split(":", 1)[0]
        return f"{head}{sep}{user + ':' if user else ''}***@{host}"
    return url


def public_url(url: str) -> str:
    """``url`` with its password removed (not masked; also a ``password=`` query option): what
    a serialized wrapper records; the password then comes from ``$KVRAG_REDIS_PASSWORD`` when
    the URL is used again."""
    from urllib.parse import parse_qsl, urlencode

    head, sep, tail = url.partition("://")
    tail, q, query = tail.partition("?")
    if "@" in tail:
        cred, _, host = tail.rpartition("@")
        user = cred.split(":", 1)[0]
        tail = f"{user + '@' if user else ''}{host}"
    kept = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k.lower() != "password"]
    return f"{head}{sep}{tail}" + ("?" + urlencode(kept) if q and kept else "")


class RedisConnection:
    """One shared-tier server: its redis-py client and its ``Outage`` breaker.

    url: see ``parse_url`` (a bad URL fails here, before any connection). socket_timeout:
    seconds per command (short: a dead server must cost a query little). retry_s: after a
    failure, seconds during which the server is not tried. client: a redis-py client to use
    instead of one made from ``url``."""

    def __init__(self, url: str, *, socket_timeout: float = 2.0, retry_s: float = 2.0, client=None) -> None:
        _, self.cluster = parse_url(url)
        self.url = url
        self.socket_timeout = socket_timeout
        self._client = client
        if client is None and not self.cluster:
            self._client = connect(url, socket_timeout=socket_timeout)  # connects lazily itself
        self.outage = Outage(f"shared KV store {redact(url)}", retry_s, logging.getLogger(LOG_NAME))
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RedisConnection({redact(self.url)!r})"

    @property
    def client(self):
        """The redis-py client. A cluster's is made at first use (making it asks a node for
        the slot map): a replica starts while the cluster is down, and its first command
        then fails like any command of an outage (``redis.ConnectionError``)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = connect(self.url, socket_timeout=self.socket_timeout)
        return self._client

    def close(self) -> None:
        if self._client is None:
            return
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing must not fail on a dead connection
            pass
