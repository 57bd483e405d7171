"""Prometheus metrics of one ``kvrag serve`` app (``GET /metrics``), on ``prometheus-client``.

Each app has its own ``CollectorRegistry``: two apps in one process (tests, replicas in one
process) never mix their counts, and the process-wide default registry stays the host's.

Where vLLM charts the same quantity, the name is vLLM's with ``kvrag_`` for ``vllm:``
(``kvrag_time_to_first_token_seconds``, ``kvrag_inter_token_latency_seconds``,
``kvrag_e2e_request_latency_seconds``, ``kvrag_prefix_cache_queries_total`` /
``kvrag_prefix_cache_hits_total``), so a vLLM dashboard's panels read a kvrag server by that
substitution; docs/serve.md lists the counterparts.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401  (re-exported for the app)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# TTFT of a RAG prompt runs from ~10 ms (cached chunks on a GPU) to seconds (full prefill of
# thousands of tokens on a CPU).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServeMetrics:
    """What the server counts. ``queue_depth`` / ``running``: callables read at each scrape
    (the scheduler's own counts, never a copy that can drift)."""

    def __init__(self, queue_depth=None, running=None):
        self._lock = threading.Lock()
        self._prompt_total = self._cached_total = 0
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvrag_requests", "HTTP requests answered, by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "kvrag_time_to_first_token_seconds",
            "From the request's admission to its first generated token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvrag_time_per_output_token_seconds",
            "Mean time per generated token after the first, per request",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvrag_inter_token_latency_seconds",
            "Time to each generated token after the first: the batched decode step that produced it",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvrag_e2e_request_latency_seconds",
            "From the request's admission to its last generated token",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        # vLLM's prefix-cache pair, in tokens as vLLM counts them: prompt tokens looked up, and
        # those whose K/V was read (chunk caches and the prompt prefix cache) instead of computed.
        self.cache_queries = Counter(
            "kvrag_prefix_cache_queries", "Prompt tokens looked up in the chunk and prefix caches", registry=r
        )
        self.cache_hits = Counter(
            "kvrag_prefix_cache_hits", "Prompt tokens read from the chunk and prefix caches", registry=r
        )
        self.prompt_tokens = Counter("kvrag_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            "kvrag_cached_prompt_tokens", "Prompt tokens served from chunk caches (not prefilled)", registry=r
        )
        self.completion_tokens = Counter("kvrag_completion_tokens", "Generated tokens", registry=r)
        share = Gauge(
            "kvrag_cached_token_share", "Share of all prompt tokens so far served from chunk caches", registry=r
        )
        share.set_function(self._share)
        self.chunk_hits = Counter("kvrag_chunk_hits", "Chunks found in a prompt and served from a cache", registry=r)
        self.chunk_misses = Counter(
            "kvrag_chunk_misses", "Chunks found in a prompt but not served (evicted, unreadable)", registry=r
        )
        self.chunk_hot = Counter("kvrag_chunk_hot_hits", "Chunk hits served from the in-memory hot tier", registry=r)
        self.finished = Counter(
            "kvrag_finished_requests", "Generations ended, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "kvrag_rejected_requests", "Requests refused before admission, by reason", ["reason"], registry=r
        )
        depth = Gauge("kvrag_queue_depth", "Requests admitted and waiting for a decode slot", registry=r)
        depth.set_function(queue_depth or (lambda: 0))
        run = Gauge("kvrag_running_requests", "Requests decoding now", registry=r)
        run.set_function(running or (lambda: 0))
        self.decode_batch = Histogram(
            "kvrag_decode_batch_size",
            "Requests in each batched decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.decode_step = Histogram(
            "kvrag_decode_step_seconds", "Wall time of each batched decode step", buckets=_TPOT_BUCKETS, registry=r
        )
        self.chunks_submitted = Counter("kvrag_chunks_submitted", "Chunk texts received on /v1/chunks", registry=r)

    def _share(self) -> float:
        with self._lock:
            return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def observe_finished(self, fin, tpot_s: float | None = None, choice_only: bool = False) -> None:
        """Count one finished generation (a ``Finished``); ``tpot_s``: its mean time per token
        after the first, as the client received them. ``choice_only``: a further choice of a
        request counted already: its end and its tokens, not the prompt, prefill or TTFT
        they share."""
        self.finished.labels(fin.finish_reason).inc()
        self.completion_tokens.inc(fin.completion_tokens)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if choice_only:
            return
        with self._lock:
            self._prompt_total += fin.prompt_tokens
            self._cached_total += fin.cached_tokens
        self.prompt_tokens.inc(fin.prompt_tokens)
        self.cached_tokens.inc(fin.cached_tokens)
        self.cache_queries.inc(fin.prompt_tokens)
        self.cache_hits.inc(fin.cached_tokens)
        stats = fin.stats
        if fin.ttft_s is not None:
            self.ttft.observe(fin.ttft_s)
            self.e2e.observe(fin.ttft_s + (stats.decode_s if stats is not None else 0.0))
        if stats is not None:
            self.chunk_hits.inc(stats.chunks_hit)
            self.chunk_misses.inc(stats.chunks_missed)
            self.chunk_hot.inc(stats.chunks_hot)

    def observe_step(self, batch_size: int, seconds: float) -> None:
        """One batched decode step of ``batch_size`` requests that took ``seconds``: one token
        for each of them, each that long in coming."""
        self.decode_batch.observe(batch_size)
        self.decode_step.observe(seconds)
        for _ in range(batch_size):
            self.itl.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
