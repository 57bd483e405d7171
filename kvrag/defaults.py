"""Defaults the library and the command line share, in one place.

Torch-free and importing nothing of kvrag: the CLI builds its parsers (and ``--help``) from
these before torch loads, and ``KVRag``, the policy registry and the framework adapters read
the same values, so a default changes in one line."""

from __future__ import annotations

#: The reuse policy ``KVRag``, the LLM wrappers and ``kvrag`` commands run when none is named:
#: ``"auto"`` is the model's own default, chosen from its held-out benchmarks
#: (``kvrag.policies.model_defaults``), and CacheBlend for a model without any.
AUTO_POLICY = "auto"
#: The format stored K/V are kept in (``KVRag(storage_dtype=...)``, ``--storage-dtype``).
DEFAULT_STORAGE_DTYPE = "float16"
#: Every storage format: float dtypes, and packed codes with per-group scales
#: (``kvrag.store.kv_format``, which defines them).
STORAGE_DTYPES = ("float16", "bfloat16", "float32", "int8", "int4", "float8_e4m3fn")
#: The compute dtype a model is loaded in (``KVRag(dtype=...)``, ``--dtype``).
DEFAULT_COMPUTE_DTYPE = "float32"
#: Whether decoding runs through the compiled step (``KVRag(compile=...)``, ``kvrag serve
#: --compile``; ``kvrag.query.compiled``): "auto" lets the device and the process decide.
COMPILE_CHOICES = ("auto", "on", "off")
DEFAULT_COMPILE = "auto"
#: What a one-row (decode) product reads on a float32 model (``KVRag(decode_weights=...)``,
#: ``kvrag serve --decode-weights``; ``kvrag.model.gemv``): its float32 weights, half-precision
#: copies of them, or "auto": the format this machine's one-row products measured fastest.
DECODE_WEIGHTS = ("float32", "float16", "bfloat16", "auto")
DEFAULT_DECODE_WEIGHTS = "float32"
#: ``kvrag serve``'s: a server's answers are decoded for a long time after it starts.
DEFAULT_SERVE_DECODE_WEIGHTS = "auto"
#: The key prefix of a shared (Redis) store (``RedisStore(prefix=...)``, ``--prefix``).
DEFAULT_SHARED_PREFIX = "kvrag:"
#: What chunks are precomputed behind (``KVRag(chunk_anchor=...)``): the model's own first token.
DEFAULT_CHUNK_ANCHOR = "auto"
#: Bytes of exact prompt-prefix K/V a ``KVRag`` keeps in memory (``KVRag(prefix_cache=...)``):
#: a system prompt of a few hundred tokens even at an 8B shape (~128 KiB a token in bf16).
DEFAULT_PREFIX_CACHE = 64 << 20
#: The answer length cap when none is named (the library, the server and the framework
#: wrappers alike), cut to the room the prompt leaves in the model's context (``Sampling.budget``).
DEFAULT_MAX_NEW_TOKENS = 256
#: The most alternatives per generated token ``kvrag serve`` reports (``logprobs``): OpenAI's
#: limit for chat, read by the wire format and the scheduler.
MAX_TOP_LOGPROBS = 20
#: OpenAI's ranges for its sampling adjustments: presence/frequency penalties and logit biases.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0

#: Tokens per forward pass when chunks are precomputed together (``KVRag.precompute``, the
#: ingestion path and ``kvrag worker``): packing amortises the weights' reads over chunks.
DEFAULT_BATCH_TOKENS = 2048
