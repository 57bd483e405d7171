"""``naive_reuse``: concatenate the cached chunks at their global positions, recompute nothing.

The fastest possible fusion and the quality floor: each chunk was encoded alone, blind to the
others (A3's "FullReuse" row)."""

from kvrag.policies.base import Policy
from kvrag.policies.registry import register


@register
class NaiveReuse(Policy):
    name = "naive_reuse"
    summary = "concatenate cached K/V at global positions; compute only the non-cached tokens"
