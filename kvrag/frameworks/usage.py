"""The OpenAI-style ``usage`` of a generation and the running totals an LLM wrapper keeps."""

from __future__ import annotations

import threading
from typing import Any


class UsageTotals:
    """Thread-safe running totals of an LLM wrapper's generations (``WrapsKVRag.usage_totals``)."""

    FIELDS = (
        "calls",
        "calls_with_hit",
        "prompt_tokens",
        "cached_tokens",
        "recomputed_tokens",
        "completion_tokens",
        "chunks_hit",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(self.FIELDS, 0)

    def add(self, stats) -> None:
        with self._lock:
            n = self._n
            n["calls"] += 1
            n["calls_with_hit"] += stats.chunks_hit > 0
            n["prompt_tokens"] += stats.prompt_tokens
            n["cached_tokens"] += stats.read_tokens
            n["recomputed_tokens"] += stats.recomputed_tokens
            n["completion_tokens"] += stats.new_tokens
            n["chunks_hit"] += stats.chunks_hit

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._n)
        out["cache_hit_rate"] = out["cached_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
        return out

    def reset(self) -> None:
        with self._lock:
            self._n = dict.fromkeys(self.FIELDS, 0)

    def __deepcopy__(self, memo: dict) -> UsageTotals:
        new = UsageTotals()
        new._n = self.snapshot()
        del new._n["cache_hit_rate"]
        return new


def usage_counts(stats) -> dict[str, Any]:
    """One generation's token counts in the OpenAI ``usage`` form, which LlamaIndex's
    ``TokenCountingHandler`` reads from ``raw["usage"]`` (``prompt_tokens_details.cached_tokens``:
    prompt tokens served from the KV cache: chunks and the prompt prefix)."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.read_tokens},
    }
