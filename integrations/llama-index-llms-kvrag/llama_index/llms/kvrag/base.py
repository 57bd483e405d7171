"""kvrag for LlamaIndex: :class:`KVRagLLM`, an ``LLM`` that answers with kvrag. It finds the
precomputed chunks verbatim in the prompt the query engine renders and fuses their stored KV
caches under a reuse policy. Drop-in: ``index.as_query_engine(llm=KVRagLLM(...))``. The hooks
that precompute those chunks (at ingestion, after retrieval) are in
:mod:`llama_index.llms.kvrag.hooks`; they share the LLM's one
:class:`kvrag.precompute.Precomputer`, so ingestion and queries do not compete with two workers.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core import Settings
from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, create_model
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

from kvrag.defaults import AUTO_POLICY, DEFAULT_MAX_NEW_TOKENS
from kvrag.engine import Generation, KVRag
from kvrag.frameworks import (
    SHARED_FIELDS,
    UsageTotals,
    WrapsKVRag,
    aiter_in_thread,
    aopen_stream,
    arun_stream,
    call_options,
    check_options,
    check_shared_matches,
    foreground_steps,
    max_tokens_alias,
    open_stream,
    option_defaults,
    pydantic_option_fields,
    rag_policy,
    resolve_policy,
    shared_options,
    shared_settings,
    usage_counts,
)
from kvrag.layout.prompt import has_chat_template
from kvrag.precompute import Precomputer

__all__ = ["KVRagLLM"]

log = logging.getLogger("kvrag.llama_index")


# ---- prompt rendering ----------------------------------------------------------------------
def _message_text(m: ChatMessage) -> str:
    parts = []
    for b in m.blocks:
        if isinstance(b, TextBlock):
            parts.append(b.text)
        else:
            raise ValueError(f"KVRagLLM handles text only; a {m.role.value} message holds a {type(b).__name__}")
    return "".join(parts)


class _ChatTemplate:
    """messages -> prompt string with the model tokenizer's own chat template (what the
    model was trained on); node texts inside message contents are kept verbatim."""

    def __init__(self, rag: KVRag):
        self.rag = rag

    def __call__(self, messages: Sequence[ChatMessage]) -> str:
        return self.rag.render([{"role": m.role.value, "content": _message_text(m)} for m in messages])


class _UserTurn:
    """completion prompt -> one user turn in the chat template (an instruct model answers a
    bare string poorly); used for ``complete(prompt)`` with ``formatted=False``."""

    def __init__(self, rag: KVRag):
        self.rag = rag

    def __call__(self, prompt: str) -> str:
        return self.rag.render([{"role": "user", "content": prompt}])


_installed_tokenizer: Any = None


def _install_tokenizer(rag: KVRag) -> None:
    """Make ``rag``'s tokenizer LlamaIndex's global one, unless the user set their own.

    LlamaIndex packs retrieved nodes into prompts of ``metadata.context_window`` tokens counted
    with its global tokenizer (tiktoken by default), while the window counts this model's
    tokens: prompts it believes fit may not (kvrag refuses them with a ValueError that the
    refine synthesizer logs and skips, silently dropping those nodes), and its truncation cuts
    node texts where the model's tokens do not end."""
    global _installed_tokenizer
    import llama_index.core as core

    current = core.global_tokenizer
    if current is not None and current is not _installed_tokenizer and not _is_default_tokenizer(current):
        return  # the user's choice
    if _installed_tokenizer is not None and getattr(_installed_tokenizer, "__self__", None) is rag.handle:
        return
    _installed_tokenizer = rag.handle.encode
    Settings.tokenizer = _installed_tokenizer
    log.info(
        "KVRagLLM: LlamaIndex's global tokenizer is now the model's (Settings.tokenizer); "
        "pass set_tokenizer=False to keep LlamaIndex's default"
    )


def _is_default_tokenizer(tok: Any) -> bool:
    """LlamaIndex's own default (``get_tokenizer()`` installs a tiktoken ``partial`` lazily)."""
    owner = getattr(getattr(tok, "func", None), "__self__", None)
    return isinstance(tok, functools.partial) and type(owner).__module__.split(".")[0] == "tiktoken"


def _has_chat_template(rag: KVRag) -> bool:
    return has_chat_template(rag.tokenizer)


def _info(gen: Generation) -> dict[str, Any]:
    """What a response carries in ``additional_kwargs``: the headline numbers + all stats."""
    s = gen.stats
    return {
        "finish_reason": gen.finish_reason,
        "ttft_s": s.ttft_s,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "recomputed_tokens": s.recomputed_tokens,
        "recompute_fraction": s.recompute_fraction,
        "chunks_hit": s.chunks_hit,
        "completion_tokens": s.new_tokens,
        "kvrag_stats": s.as_dict(),
    }


def _raw(gen: Generation) -> dict[str, Any]:
    """``raw`` of a response: the token ids, and ``usage`` in the OpenAI form LlamaIndex's
    ``TokenCountingHandler`` reads (without it, it re-counts the prompt string with its own
    tokenizer, and never sees the cached tokens)."""
    return {"token_ids": gen.token_ids, "prompt_ids": gen.prompt_ids, "usage": usage_counts(gen.stats)}


#: ``model`` of a KVRagLLM whose model was built in memory (no path to load it from again).
IN_MEMORY = "<in-memory model>"


# ---- the LLM -------------------------------------------------------------------------------
# The generation options (``kvrag.query.decode.Sampling``'s fields: ``max_new_tokens``,
# ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``, the penalties, ``logit_bias``,
# ``min_tokens``, ``ignore_eos``, ``json_schema``) are settings of the LLM, derived from them
# rather than listed here.
_WithOptions: Any = create_model("_WithOptions", __base__=LLM, **pydantic_option_fields())


class KVRagLLM(WrapsKVRag, _WithOptions):
    """A LlamaIndex LLM backed by :class:`kvrag.engine.KVRag`.

    ``KVRagLLM(cache_dir="./kv", policy="cacheblend", policy_params={"recompute_ratio": 0.15})``
    loads the default model (SmolLM2-135M-Instruct) or ``model=`` (HF directory / .gguf);
    ``KVRagLLM(rag)`` wraps an existing KVRag. ``policy="full_prefill"`` is the plain model
    (exact HF forward, no cache). Chat messages are rendered with the tokenizer's chat
    template. After each call, :attr:`last_stats` holds the prefill stats (TTFT, cached and
    recomputed tokens); every response carries them in ``additional_kwargs``.

    Policy parameters may be passed flat (``KVRagLLM(rag, recompute_ratio=0.3)``), as ``KVRag``
    takes them; another unknown keyword is a ValueError. Without ``policy``, ``KVRagLLM(rag)``
    runs the wrapped KVRag's own policy and parameters. ``max_tokens`` = ``max_new_tokens``.

    Per-call overrides: ``llm.complete(prompt, policy="naive_reuse", max_new_tokens=32,
    policy_params={...})``."""

    policy: str = Field(default=AUTO_POLICY, description="kvrag reuse policy (see `kvrag policies`).")
    policy_params: dict[str, Any] = Field(default_factory=dict, description="Hyper-parameters of the policy.")
    model: str | None = Field(
        default=None,
        description="The model loaded: HF directory or .gguf path "
        "(filled in from the KVRag; what from_dict loads again).",
    )
    cache_dir: str | None = Field(default=None, description="The KV store directory (filled in from the KVRag).")
    shared: str | None = Field(
        default=None,
        description="The shared tier's URL, without its password (filled in "
        "from the KVRag; loaded again with the password from $KVRAG_REDIS_PASSWORD).",
    )
    shared_prefix: str | None = Field(default=None, description="The shared tier's key prefix (filled in).")
    precompute_via: str = Field(default="local", description="'local' or 'queue' (filled in from the KVRag).")

    _rag: Any = PrivateAttr(default=None)
    _precomputer: Any = PrivateAttr(default=None)
    _precompute_options_: dict = PrivateAttr(default_factory=dict)
    _last: Any = PrivateAttr(default=None)
    _usage: Any = PrivateAttr(default_factory=UsageTotals)

    def __init__(
        self,
        rag: KVRag | None = None,
        *,
        model: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        precomputer: Precomputer | None = None,
        precompute_options: dict[str, Any] | None = None,
        rag_options: dict[str, Any] | None = None,
        set_tokenizer: bool = True,
        **kwargs: Any,
    ) -> None:
        if rag is not None and (model is not None or cache_dir is not None or rag_options):
            raise ValueError("pass either an existing `rag` or `model`/`cache_dir`/`rag_options`, not both")
        if rag is not None and not isinstance(rag, KVRag):
            raise TypeError(f"rag must be a kvrag.engine.KVRag, got {type(rag).__name__}")
        shared = {k: kwargs.pop(k, None) for k in SHARED_FIELDS}
        if rag is not None:
            check_shared_matches(shared, rag, "KVRagLLM")
        max_tokens_alias(kwargs, "KVRagLLM")
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k not in type(self).model_fields}
        # Checked before a model is loaded.
        kwargs["policy"], kwargs["policy_params"] = resolve_policy(
            kwargs.get("policy"), kwargs.get("policy_params"), flat, rag, "KVRagLLM"
        )
        if rag is None:
            # The LLM's policy is also the KVRag's: a KVRag built for kvlink loads the KVLink
            # model (trained adapter) where one exists for this model.
            rag_options = {
                "policy": kwargs["policy"],
                **kwargs["policy_params"],
                **shared_options(**shared),
                **(rag_options or {}),
            }
            rag = KVRag(model, cache_dir=cache_dir, **rag_options)
            if kwargs["policy"] == AUTO_POLICY:  # what the model's default resolved to
                kwargs["policy"], kwargs["policy_params"] = rag_policy(rag)
        chat = _has_chat_template(rag)
        if kwargs.get("messages_to_prompt") is None:
            kwargs["messages_to_prompt"] = _ChatTemplate(rag) if chat else generic_messages_to_prompt
        if kwargs.get("completion_to_prompt") is None and chat:
            kwargs["completion_to_prompt"] = _UserTurn(rag)
        # What the wrapped KVRag was loaded from, so that to_dict()/from_dict() rebuild it and
        # not a default model over the default store.
        source = getattr(rag.handle, "source", None)
        kwargs["model"] = str(source) if source else IN_MEMORY
        kwargs["cache_dir"] = str(rag.cache_dir)
        kwargs.update(shared_settings(rag))  # never its password
        super().__init__(**kwargs)
        check_options(self)
        if set_tokenizer:
            _install_tokenizer(rag)
        self._rag = rag
        self._precomputer = precomputer
        self._precompute_options_ = dict(precompute_options or {})

    @classmethod
    def class_name(cls) -> str:
        return "KVRagLLM"

    @classmethod
    def from_dict(cls, data: dict[str, Any], **kwargs: Any) -> KVRagLLM:
        """Rebuild from ``to_dict()``: loads ``model`` again over the store in ``cache_dir`` and
        the shared tier ``shared`` (its password from ``$KVRAG_REDIS_PASSWORD``, or pass
        ``shared=`` with it again as a keyword)."""
        data = {**data, **kwargs}
        if data.get("model") == IN_MEMORY:
            raise ValueError(
                "this KVRagLLM wrapped a model built in memory, which cannot be loaded again from "
                "its settings: pass KVRagLLM(rag) with that KVRag instead"
            )
        data.pop("class_name", None)
        return cls(**data)

    # ---- kvrag objects ---------------------------------------------------------------
    @property
    def rag(self) -> KVRag:
        return self._rag

    def _precompute_options(self) -> dict[str, Any]:
        return self._precompute_options_

    @property
    def metadata(self) -> LLMMetadata:
        handle = self._rag.handle
        source = getattr(handle, "source", None)
        return LLMMetadata(
            context_window=handle.max_context,
            num_output=self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            is_chat_model=_has_chat_template(self._rag),
            model_name=f"kvrag:{os.path.basename(str(source)) if source else type(handle.model).__name__}",
        )

    # ---- core --------------------------------------------------------------------------
    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return call_options(option_defaults(self), self.policy_params, kwargs, "KVRagLLM", log)

    def _generate(self, prompt: str, kwargs: dict[str, Any]) -> Generation:
        with self._foreground():
            gen = self._rag.generate(prompt, **self._options(kwargs))
        self._record(gen)
        return gen

    async def _agenerate(self, prompt: str, kwargs: dict[str, Any]) -> Generation:
        """``_generate`` for async callers: steps in a worker thread, stopped when cancelled."""
        s = await aopen_stream(self._rag, prompt, self._options(kwargs), self._foreground)  # bad input raises here
        await arun_stream(s, self._foreground)
        gen = s.generation()
        self._record(gen)
        return gen

    def _stream(self, prompt: str, kwargs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        """Yields (delta, None) per text delta, then ("", Generation) once at the end."""
        s = open_stream(self._rag, prompt, self._options(kwargs), self._foreground)
        for delta in foreground_steps(s, self._foreground):
            yield delta, None
        gen = s.generation()
        self._record(gen)
        yield "", gen

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    def _complete_impl(self, prompt: str, formatted: bool, kwargs) -> CompletionResponse:
        return self._completion_response(self._generate(self._completion_prompt(prompt, formatted), kwargs))

    @staticmethod
    def _completion_response(gen: Generation) -> CompletionResponse:
        return CompletionResponse(text=gen.text, additional_kwargs=_info(gen), raw=_raw(gen))

    def _stream_complete_impl(self, prompt: str, formatted: bool, kwargs) -> CompletionResponseGen:
        text = self._completion_prompt(prompt, formatted)

        def gen() -> CompletionResponseGen:
            acc = ""
            for delta, final in self._stream(text, kwargs):
                acc += delta
                if final is None:
                    yield CompletionResponse(text=acc, delta=delta)
                else:
                    yield CompletionResponse(text=acc, delta="", additional_kwargs=_info(final), raw=_raw(final))

        return gen()

    # ---- LlamaIndex API ------------------------------------------------------------------
    # Chat renders the messages (``messages_to_prompt``: the chat template) and completes the
    # rendered prompt, as LlamaIndex's HuggingFaceLLM does: one generation path.
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete_impl(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete_impl(prompt, formatted, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _as_chat(self.complete(self.messages_to_prompt(messages), formatted=True, **kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return _as_chat_stream(self.stream_complete(self.messages_to_prompt(messages), formatted=True, **kwargs))

    # Async: the model runs in a worker thread so the event loop stays responsive; a cancelled
    # call stops after the step in flight (arun_stream).
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion_response(await self._agenerate(self._completion_prompt(prompt, formatted), kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return aiter_in_thread(self._stream_complete_impl(prompt, formatted, kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _as_chat(await self.acomplete(self.messages_to_prompt(messages), formatted=True, **kwargs))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        parts = await self.astream_complete(self.messages_to_prompt(messages), formatted=True, **kwargs)

        async def gen() -> ChatResponseAsyncGen:
            async for part in parts:
                yield _as_chat(part)

        return gen()


def _as_chat(resp: CompletionResponse) -> ChatResponse:
    """A completion of the rendered chat as the assistant's reply; kvrag's stats stay in
    ``additional_kwargs`` of the response (LlamaIndex's generic converter moves them into the
    message)."""
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=resp.text),
        delta=resp.delta,
        additional_kwargs=resp.additional_kwargs,
        raw=resp.raw,
    )


def _as_chat_stream(parts: CompletionResponseGen) -> ChatResponseGen:
    for part in parts:
        yield _as_chat(part)
