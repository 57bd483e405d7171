"""Which policy an LLM wrapper runs and how per-call options merge into it (the same in every
framework adapter)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import types
import typing
from collections import abc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvrag.defaults import AUTO_POLICY
from kvrag.policies import get_policy, policy_class
from kvrag.query.decode import Sampling

log = logging.getLogger("kvrag.frameworks")

#: The per-call options a wrapper takes: the policy and every generation option, ``Sampling``'s
#: fields (a new option there is a new option here and in every wrapper).
GEN_KEYS: tuple[str, ...] = ("policy", *(f.name for f in dataclasses.fields(Sampling)))


@dataclass(frozen=True)
class OptionField:
    """A generation option as a wrapper's settings hold it: ``Sampling``'s field ``name`` with a
    JSON-friendly ``annotation`` (a list for a sequence, a dict for a mapping: what a wrapper's
    serialized settings load back as) and its ``default`` (or ``default_factory``)."""

    name: str
    annotation: Any
    default: Any = None
    default_factory: Callable[[], Any] | None = None


def _json_type(tp: Any) -> Any:
    """``tp`` with abstract containers made concrete: Sequence[X] -> list[X], Mapping[K, V] -> dict[K, V]."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return functools.reduce(operator.or_, [_json_type(a) for a in args])
    concrete: Any = {abc.Sequence: list, abc.Mapping: dict}.get(origin)
    return tp if concrete is None else concrete[args]


def option_fields() -> list[OptionField]:
    """Every generation option (``Sampling``'s fields, in order) as a wrapper's setting."""
    hints = typing.get_type_hints(Sampling)
    out = []
    for f in dataclasses.fields(Sampling):
        if f.default_factory is not dataclasses.MISSING:
            empty = f.default_factory()
            factory = list if isinstance(empty, tuple) else type(empty)
            # (None is taken too, as ``Sampling`` takes it: no stop strings, no biases.)
            out.append(OptionField(f.name, _json_type(hints[f.name]) | None, default_factory=factory))
        else:
            out.append(OptionField(f.name, _json_type(hints[f.name]), f.default))
    return out


def pydantic_option_fields() -> dict[str, Any]:
    """``option_fields`` as pydantic field definitions (``pydantic.create_model(**them)``): the
    settings of a framework's LLM class (LlamaIndex's and LangChain's are pydantic models).
    The values are checked by ``Sampling`` when a generation starts, with its messages."""
    from pydantic import Field

    return {
        o.name: (o.annotation, Field(default_factory=o.default_factory) if o.default_factory else o.default)
        for o in option_fields()
    }


def check_options(settings: Any) -> None:
    """ValueError naming a bad generation option among a wrapper's settings (``Sampling``'s
    checks, at the wrapper's construction rather than at its first call)."""
    Sampling(**{k: getattr(settings, k) for k in GEN_KEYS if k != "policy"})


def option_defaults(settings: Any) -> dict[str, Any]:
    """A wrapper's own generation options (its ``GEN_KEYS`` attributes), as ``call_options`` takes them."""
    return {k: getattr(settings, k) for k in GEN_KEYS}


def policy_param_names(policy) -> set[str]:
    """The hyper-parameter names of ``policy`` (a name or a Policy); ValueError if unknown."""
    return {f.name for f in dataclasses.fields(policy_class(policy).Params)}


def rag_policy(rag) -> tuple[str, dict[str, Any]]:
    """The (policy name, parameters) a KVRag runs by default (what ``rag.generate`` runs)."""
    own = rag.policy
    return own.name, {f.name: _as_json(getattr(own.params, f.name)) for f in dataclasses.fields(own.params)}


def resolve_policy(policy, policy_params: dict | None, flat: dict[str, Any], rag, owner: str):
    """The (policy name, parameters) a wrapper runs by default.

    No ``policy`` given and an existing KVRag ``rag``: that KVRag's own policy and parameters
    (what ``rag.generate`` runs), so a wrapper of ``KVRag(policy="kvlink")`` runs kvlink, not a
    silent default; ``policy_params`` then update them. No ``policy`` and no ``rag``: ``"auto"``,
    the model's own default, which the KVRag the wrapper builds resolves (the wrapper then takes
    it with :func:`rag_policy`). ``flat``: the keyword arguments the wrapper does not know
    itself, taken as policy parameters, as ``KVRag(policy=..., recompute_ratio=...)`` takes
    them; any other name is a typo, reported here rather than dropped (pydantic models would
    drop it silently)."""
    has_own = getattr(rag, "policy", None) is not None
    inherited = rag_policy(rag)[1] if has_own else {}
    params: dict[str, Any] = {}
    if policy is None and has_own:
        policy, params = rag_policy(rag)
    elif policy is None:
        policy = AUTO_POLICY
    if policy == AUTO_POLICY:
        given = sorted({**(policy_params or {}), **flat})
        if given:
            raise ValueError(
                f"{owner} got policy parameter(s) {given} without a policy: the default policy is "
                "chosen per model (policy='auto'), so name the one they are for, e.g. policy='cacheblend'"
            )
        return AUTO_POLICY, {}
    names = policy_param_names(policy)
    # A wrapper rebuilt with another policy (LangChain's ``configurable_fields(policy=...)``
    # passes all fields back) carries the parameters it inherited from the KVRag: those the
    # new policy lacks are dropped, while parameters the user set stay checked.
    params.update(
        {k: v for k, v in (policy_params or {}).items() if k in names or k not in inherited or inherited[k] != v}
    )
    unknown = sorted(set(flat) - names)
    if unknown:
        raise ValueError(
            f"{owner} got unknown option(s) {unknown}: neither an option of {owner} nor a "
            f"parameter of policy {policy!r} (its parameters: {sorted(names) or 'none'})"
        )
    params.update(flat)
    pol = get_policy(policy, **params)  # fail now, with the registry's message, on a bad value
    arch = getattr(rag, "arch", None)
    if arch is not None:
        pol.check_model(arch)  # and on a policy the wrapped model cannot run (a2ats, no codebook)
    return policy, {k: _as_json(v) for k, v in params.items()}


def _as_json(value: Any) -> Any:
    """A parameter value as JSON holds it (a tuple as a list): a wrapper serialized and loaded
    again has the same settings, and compares equal to them."""
    return list(value) if isinstance(value, tuple) else value


def max_tokens_alias(kwargs: dict[str, Any], owner: str) -> None:
    """In place: ``max_tokens`` (the name most LLM classes use) becomes ``max_new_tokens``."""
    if kwargs.get("max_tokens") is None:
        kwargs.pop("max_tokens", None)
        return
    mt = kwargs.pop("max_tokens")
    if kwargs.get("max_new_tokens") not in (None, mt):
        raise ValueError(f"{owner}: max_tokens={mt} and max_new_tokens={kwargs['max_new_tokens']} disagree; pass one")
    kwargs["max_new_tokens"] = mt


def call_options(
    defaults: dict[str, Any], policy_params: dict[str, Any], kwargs: dict[str, Any], owner: str, log: logging.Logger
) -> dict[str, Any]:
    """Keyword arguments for ``KVRag.stream``: the wrapper's ``defaults`` (the ``GEN_KEYS``)
    and ``policy_params``, overridden by a call's ``kwargs``. A call naming another policy
    without ``policy_params`` drops the wrapper's (they belong to its own policy); policy
    parameters may come flat; other keywords (frameworks forward their own) are ignored."""
    opts = dict(defaults)
    kwargs = dict(kwargs)
    max_tokens_alias(kwargs, owner)
    params = dict(policy_params)
    flat = {}
    for k, v in kwargs.items():
        if k in GEN_KEYS:
            opts[k] = v
        elif k == "policy_params":
            if v is not None and not isinstance(v, Mapping):
                raise TypeError(f"{owner}: policy_params must be a dict of policy parameters, got {type(v).__name__}")
            params = dict(v or {})
        else:
            flat[k] = v
    if opts["policy"] == AUTO_POLICY:  # the wrapper's own, as KVRag.generate(policy="auto")
        opts["policy"] = defaults["policy"]
    if opts["policy"] != defaults["policy"] and "policy_params" not in kwargs:
        params = {}
    names = policy_param_names(opts["policy"]) if flat else set()
    for k, v in flat.items():
        if k in names:
            params[k] = v
        else:
            log.debug("%s: ignoring unsupported option %r", owner, k)
    opts["stop"] = stop_list(opts.get("stop"))
    return {**opts, **params}


def stop_list(stop) -> list:
    """Stop strings as a list: None -> [], one string -> [it] (``list("Paris")`` would stop at
    any of its letters), any other iterable -> its items (checked by ``Sampling``)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (bytes, bytearray, Mapping)) or not isinstance(stop, Iterable):
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    return list(stop)
