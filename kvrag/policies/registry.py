"""Name -> policy class registry (``policy="cacheblend", recompute_ratio=0.15``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvrag.policies.base import Policy

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy selectable by its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def get_policy(policy: str | Policy, **params: Any) -> Policy:
    """A policy instance from a name (+ hyper-parameters) or an instance (returned as is)."""
    if isinstance(policy, Policy):
        if params:
            return type(policy)(**{**dataclasses.asdict(policy.params), **params})
        return policy
    return policy_class(policy)(**params)


def policy_class(policy: str | Policy) -> type[Policy]:
    """The class registered under a name (or an instance's class)."""
    if isinstance(policy, Policy):
        return type(policy)
    try:
        return _REGISTRY[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def describe() -> list[dict[str, Any]]:
    """One record per policy: name, summary, and its parameters with defaults and help."""
    out = []
    for name in policy_names():
        cls = _REGISTRY[name]
        params = [
            {
                "name": f.name,
                "default": f.default if f.default is not dataclasses.MISSING else None,
                "help": f.metadata.get("help", ""),
            }
            for f in dataclasses.fields(cls.Params)
        ]
        out.append(
            {
                "name": name,
                "summary": cls.summary,
                "params": params,
                "setup": cls.setup,
            }
        )
    return out
