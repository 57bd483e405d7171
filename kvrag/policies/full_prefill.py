"""``full_prefill``: no reuse — the model's own forward over every token (quality upper bound)."""

from kvrag.policies.base import Policy
from kvrag.policies.registry import register


@register
class FullPrefill(Policy):
    name = "full_prefill"
    summary = "exact: ignore the cache and prefill every token with the model's own forward"
    uses_cache = False
