"""The reuse policy a model runs when none is named (``policy="auto"``, the default).

Each packaged model gets the setting its held-out benchmark runs chose
(:mod:`kvrag.bench.pareto`: the fastest setting not measurably worse in gold log-likelihood
than the best one); ``benchmarks/choose_defaults.py`` writes the table to
``kvrag/assets/policy_defaults.json``, and this module only reads it. A model is recognised by
the digest of its weights (``ModelHandle.fingerprint_parts["weights"]``): the evidence holds
for those weights in any compute dtype, and for no other model. Every other model gets the
table's fallback, CacheBlend at its paper's ratio."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).resolve().parents[1] / "assets" / "policy_defaults.json"
TABLE_FORMAT = 1


@dataclass(frozen=True)
class DefaultPolicy:
    """A model's default: ``policy`` with ``params``, the ``model`` it was measured on (None
    for the fallback), ``why`` in one sentence, and whether the evidence was measured with the
    model's KVLink adapter applied (``needs_adapter``: without it the fallback runs instead)."""

    policy: str
    params: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    why: str = ""
    needs_adapter: bool = False

    @property
    def label(self) -> str:
        """``policy(k=v, ...)``, as ``kvrag bench`` labels a setting."""
        args = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.policy}({args})" if args else self.policy


@functools.lru_cache(maxsize=4)
def load_table(path: Path = TABLE_PATH) -> dict:
    """The table at ``path``: ``{"fallback": entry, "models": [entry + "weights", ...]}``."""
    table = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: not a policy-defaults table of format {TABLE_FORMAT}")
    return table


def _entry(e: dict, model: str | None) -> DefaultPolicy:
    return DefaultPolicy(
        policy=e["policy"],
        params=dict(e.get("params") or {}),
        model=model,
        why=e["why"],
        needs_adapter=bool(e.get("needs_adapter", False)),
    )


def fallback(table: dict | None = None) -> DefaultPolicy:
    """The default of a model without held-out evidence."""
    return _entry((table or load_table())["fallback"], None)


def default_for_weights(weights: str, *, adapter_applied: bool, table: dict | None = None) -> DefaultPolicy:
    """The default of the model whose weight digest is ``weights``; ``adapter_applied``: a
    KVLink adapter with LoRA weights can be applied to it (a setting measured with one needs it)."""
    table = table or load_table()
    for e in table["models"]:
        if e["weights"] == weights:
            chosen = _entry(e, e["name"])
            if chosen.needs_adapter and not adapter_applied:
                fb = fallback(table)
                why = (
                    f"{e['name']}'s measured default is {chosen.label} with its KVLink adapter, "
                    f"which is not applied here (kvlink_adapter); without evidence for this set-up, {fb.why}"
                )
                return DefaultPolicy(fb.policy, fb.params, None, why)
            return chosen
    return fallback(table)


def default_policy(handle, kvlink_adapter: Any = "default") -> DefaultPolicy:
    """The default policy of ``handle``'s model, as a ``KVRag(handle, kvlink_adapter=...)``
    would run it (``kvlink_adapter``: the KVRag option; None applies no adapter)."""
    from kvrag.policies.kvlink.adapter import LORA_FILE, find_adapter
    from kvrag.policies.kvlink.policy import ADAPTER_ATTR

    # A model that carries an adapter already (another KVRag's ``handle``) is judged as the
    # base model it was adapted from, with its adapter: what that KVRag runs.
    carried = getattr(handle.model, ADAPTER_ATTR, None)
    if carried is not None:
        weights = handle.load_info.get("base_weights", handle.fingerprint_parts["weights"])
        return default_for_weights(weights, adapter_applied=carried.has_lora)
    weights = handle.fingerprint_parts["weights"]
    applied = False
    if kvlink_adapter is not None and kvlink_adapter != "links":
        if kvlink_adapter == "default":
            found = find_adapter(handle)
            applied = found is not None and (found / LORA_FILE).is_file()
        else:  # an adapter named explicitly is applied whatever the policy
            applied = True
    return default_for_weights(weights, adapter_applied=applied)


def defaults_by_policy(table: dict | None = None) -> dict[str, list[str]]:
    """{policy: the models it is the default of}, ``"any other model"`` for the fallback's."""
    table = table or load_table()
    out: dict[str, list[str]] = {}
    for e in table["models"]:
        out.setdefault(e["policy"], []).append(f"{e['name']} ({_entry(e, None).label})")
    fb = fallback(table)
    out.setdefault(fb.policy, []).append(f"any other model ({fb.label})")
    return out
