"""Reuse policies. Importing this package registers every built-in policy."""

import importlib
import pkgutil

from kvrag.policies.base import Policy, param
from kvrag.policies.registry import describe, get_policy, policy_class, policy_names, register

# Every module in this package registers its policy on import; discovering them keeps this
# file free of policy names (adding a policy = adding a module).
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Policy", "param", "register", "get_policy", "policy_class", "policy_names", "describe"]
