"""What every framework adapter (LlamaIndex, LangChain) does the same way, kept in the core so
the adapters stay thin and cannot drift apart. Imports no framework.

``options`` (the policy an LLM wrapper runs, per-call option merging), ``shared_tier`` (the
Redis settings a wrapper records and rebuilds), ``wrapper`` (``WrapsKVRag``, the LLM mixin),
``usage`` (``UsageTotals``, ``usage_counts``), ``hooks`` (a hook's target and what it submits
to, scheduling retrieved texts), ``server_chunks`` (``ServerChunks``: the hooks' ``server=``
client of a ``kvrag serve``), ``streaming`` (stepping a stream in the foreground, from threads and async code).
The names below are the adapters' API."""

from kvrag.frameworks.hooks import chunk_service, hook_target, precomputer_of, schedule_retrieved
from kvrag.frameworks.options import (
    GEN_KEYS,
    call_options,
    check_options,
    max_tokens_alias,
    option_defaults,
    option_fields,
    policy_param_names,
    pydantic_option_fields,
    rag_policy,
    resolve_policy,
    stop_list,
)
from kvrag.frameworks.server_chunks import ServerChunks, ServerChunksError
from kvrag.frameworks.shared_tier import SHARED_FIELDS, check_shared_matches, shared_options, shared_settings
from kvrag.frameworks.streaming import (
    END,
    ThreadStepper,
    aiter_in_thread,
    aopen_stream,
    arun_stream,
    foreground,
    foreground_steps,
    open_stream,
)
from kvrag.frameworks.usage import UsageTotals, usage_counts
from kvrag.frameworks.wrapper import WrapsKVRag

__all__ = [
    "END",
    "GEN_KEYS",
    "SHARED_FIELDS",
    "ServerChunks",
    "ServerChunksError",
    "ThreadStepper",
    "UsageTotals",
    "WrapsKVRag",
    "aiter_in_thread",
    "aopen_stream",
    "arun_stream",
    "call_options",
    "check_options",
    "chunk_service",
    "check_shared_matches",
    "foreground",
    "foreground_steps",
    "hook_target",
    "max_tokens_alias",
    "open_stream",
    "option_defaults",
    "option_fields",
    "policy_param_names",
    "pydantic_option_fields",
    "precomputer_of",
    "rag_policy",
    "resolve_policy",
    "schedule_retrieved",
    "shared_options",
    "shared_settings",
    "stop_list",
    "usage_counts",
]
