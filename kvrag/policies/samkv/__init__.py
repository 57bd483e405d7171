"""SamKV: sparse attention across multiple-context KV caches (Cao et al. 2025).

``policy`` is the reuse policy (registered as ``"samkv"``: its parameters, the per-chunk memo,
the hooks), ``preliminary`` the pass that computes the generic and local queries and the
attention recomputation ranks by, ``selection`` the block selection (eq. 1-3 and the
cross-context filter)."""

from kvrag.policies.samkv.policy import SamKV

__all__ = ["SamKV"]
