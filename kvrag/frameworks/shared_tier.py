"""What an LLM wrapper records of its KVRag's shared (Redis) tier, and how it rebuilds it from
those settings."""

from __future__ import annotations

from typing import Any

#: The settings a serialized wrapper records of its KVRag's shared tier (``shared_settings``).
SHARED_FIELDS = ("shared", "shared_prefix", "precompute_via")


def shared_settings(rag) -> dict[str, Any]:
    """What a serialized LLM wrapper records of ``rag``'s shared tier: ``shared``, its URL with
    the password removed (a password is never serialized: when the URL is used again it comes
    from ``$KVRAG_REDIS_PASSWORD``, or is passed again), ``shared_prefix`` and
    ``precompute_via``. None/"local" without a shared tier, or with one that has no URL (a
    ChunkStore of the caller's, which cannot be rebuilt from settings)."""
    far = getattr(rag.store, "far", None)
    url = getattr(far, "url", None)
    if far is None or not isinstance(url, str):
        return {"shared": None, "shared_prefix": None, "precompute_via": "local"}
    from kvrag.store.redis_connection import public_url  # imports no redis

    return {
        "shared": public_url(url),
        "shared_prefix": far.prefix,
        "precompute_via": "local" if rag.queue is None else "queue",
    }


def shared_options(shared: str | None, shared_prefix: str | None, precompute_via: str | None) -> dict[str, Any]:
    """``KVRag`` keyword arguments that rebuild the shared tier ``shared_settings`` recorded
    (bad values fail in ``KVRag`` with its own messages)."""
    opts: dict[str, Any] = {}
    if precompute_via not in (None, "local"):
        opts["precompute_via"] = precompute_via
    if shared is not None:
        from kvrag.store import open_shared

        opts["shared"] = open_shared(shared, prefix=shared_prefix) if shared_prefix else shared
    return opts


def check_shared_matches(given: dict[str, Any], rag, owner: str) -> None:
    """A wrapper given an existing ``rag`` and shared settings: they must be that KVRag's (a
    rebuilt wrapper passes them back), else it is the 'pass either rag or settings' mistake."""
    given = {k: v for k, v in given.items() if v not in (None, "local")}
    if isinstance(given.get("shared"), str):
        from kvrag.store.redis_connection import public_url

        given["shared"] = public_url(given["shared"])
    have = shared_settings(rag)
    if any(have[k] != v for k, v in given.items()):
        raise ValueError(
            f"{owner}: pass either an existing `rag` or the shared-tier settings "
            f"{sorted(given)} to build one, not both (the KVRag has {have})"
        )
