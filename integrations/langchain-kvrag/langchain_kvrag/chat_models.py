"""``ChatKVRag``: a LangChain chat model backed by kvrag's fused KV-cache prefill."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, create_model, model_validator

from kvrag.defaults import AUTO_POLICY
from kvrag.engine import Generation, KVRag
from kvrag.frameworks import (
    SHARED_FIELDS,
    UsageTotals,
    WrapsKVRag,
    aiter_in_thread,
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
    stop_list,
)
from kvrag.layout.prompt import has_chat_template, plain_chat_prompt

__all__ = ["ChatKVRag", "to_kvrag_messages"]

log = logging.getLogger("kvrag.langchain")

# The (model, cache_dir) each KVRag a ChatKVRag built was made from. LangChain rebuilds a model
# from all its fields (``configurable_fields``, ``with_config``), the built ``rag`` together
# with the ``model``/``cache_dir`` it came from: that is the same KVRag, not a conflict.
_BUILT_FROM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _content_text(m: BaseMessage) -> str:
    c = m.content
    if isinstance(c, str):
        return c
    parts = []
    for block in c:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatKVRag handles text only; a {m.type} message holds a {kind!r} block")
    return "".join(parts)


def to_kvrag_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages -> ``[{"role", "content"}]`` for the model's chat template."""
    out = []
    for m in messages:
        if isinstance(m, SystemMessage):
            role = "system"
        elif isinstance(m, HumanMessage):
            role = "user"
        elif isinstance(m, AIMessage):
            role = "assistant"
        elif isinstance(m, ChatMessage):
            role = m.role
        elif isinstance(m, (ToolMessage, FunctionMessage)):
            role = "tool"
        else:
            raise ValueError(f"ChatKVRag: unsupported message type {type(m).__name__}")
        out.append({"role": role, "content": _content_text(m)})
    return out


def _usage(stats) -> UsageMetadata:
    """LangChain ``UsageMetadata``: cache_read = prompt tokens served from the KV cache (chunks
    and the prompt prefix);
    recomputed = those of them the policy recomputed anyway (a kvrag-specific key)."""
    # cast: the details carry a kvrag key (recomputed) beside the ones LangChain declares.
    return cast(
        UsageMetadata,
        {
            "input_tokens": stats.prompt_tokens,
            "output_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "input_token_details": {"cache_read": stats.read_tokens, "recomputed": stats.recomputed_tokens},
        },
    )


def _closed(schema: Any) -> Any:
    """``schema`` (JSON) with every object that lists its properties closed to others
    (``additionalProperties: false`` where it says nothing)."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _closed(sub) for name, sub in value.items()}  # names -> schemas
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value  # data, not schemas
        else:
            out[key] = _closed(value)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# The generation options (``kvrag.query.decode.Sampling``'s fields: ``max_new_tokens``,
# ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``, the penalties, ``logit_bias``,
# ``min_tokens``, ``ignore_eos``, ``json_schema``) are settings of the chat model, derived from
# them rather than listed here.
_WithOptions: Any = create_model("_WithOptions", __base__=BaseChatModel, **pydantic_option_fields())


class ChatKVRag(WrapsKVRag, _WithOptions):
    """A LangChain chat model that answers with kvrag.

    ``ChatKVRag(cache_dir="./kv", policy="cacheblend")`` loads the default model
    (SmolLM2-135M-Instruct) or ``model=`` (HF directory / .gguf); ``ChatKVRag(rag=rag)`` wraps
    an existing :class:`kvrag.engine.KVRag`. ``policy="full_prefill"`` is the plain model.
    Messages are rendered with the tokenizer's chat template (as ``role: content`` lines for a
    model without one); the retrieved chunks found
    verbatim in it are served from their precomputed KV caches. Policy parameters may be passed
    flat (``ChatKVRag(rag=rag, recompute_ratio=0.3)``); another unknown keyword is a ValueError.
    Without ``policy``, ``ChatKVRag(rag=rag)`` runs the wrapped KVRag's own policy and
    parameters. LangChain's ``max_tokens`` is ``max_new_tokens``.

    Every ``AIMessage`` carries ``usage_metadata`` (``input_token_details.cache_read``: tokens
    served from the cache, ``.recomputed``: of those, recomputed by the policy) and
    ``response_metadata`` (``ttft_s``, ``policy``, ``finish_reason``, ``kvrag_stats``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rag: Any = Field(
        default=None, exclude=True, description="A kvrag.engine.KVRag (built from model/cache_dir if None)."
    )
    model: str | None = Field(
        default=None,
        description="HF model directory or .gguf (None: SmolLM2-135M-Instruct); "
        "filled in with the path the KVRag loaded (None for a model built in memory).",
    )
    cache_dir: str | None = Field(
        default=None, description="KV store directory (None: $KVRAG_HOME/store); filled in with the KVRag's store."
    )
    shared: str | None = Field(
        default=None,
        description="The shared tier's URL, without its password (filled "
        "in; loaded again with the password from $KVRAG_REDIS_PASSWORD).",
    )
    shared_prefix: str | None = Field(default=None, description="The shared tier's key prefix (filled in).")
    precompute_via: str = Field(default="local", description="'local' or 'queue' (filled in from the KVRag).")
    policy: str = AUTO_POLICY
    policy_params: dict[str, Any] = Field(default_factory=dict)
    precompute_options: dict[str, Any] = Field(default_factory=dict, description="Precomputer(...) options.")
    fingerprint: str | None = Field(
        default=None,
        description="The cache fingerprint of the model "
        "(filled in; a serialized chat model checks it when loaded again).",
    )
    streaming: bool = Field(
        default=False,
        description="LangChain's convention: invoke() goes through the "
        "streaming path. Tokens reach on_llm_new_token callbacks either way.",
    )

    _precomputer: Any = PrivateAttr(default=None)
    _last: Any = PrivateAttr(default=None)
    _usage: Any = PrivateAttr(default_factory=UsageTotals)

    @model_validator(mode="before")
    @classmethod
    def _policy_and_aliases(cls, data: Any) -> Any:
        """``max_tokens`` -> ``max_new_tokens``; flat policy parameters; the wrapped KVRag's
        policy when none is given (see ``_resolve_policy``). Checked before a model is loaded."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        max_tokens_alias(data, "ChatKVRag")
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        flat = {k: data.pop(k) for k in list(data) if k not in known}
        data["policy"], data["policy_params"] = resolve_policy(
            data.get("policy"), data.get("policy_params"), flat, data.get("rag"), "ChatKVRag"
        )
        return data

    @model_validator(mode="after")
    def _build(self) -> ChatKVRag:
        check_options(self)
        if self.rag is None and self.model is None and self.fingerprint is not None:
            # Serialization always records the model's path; none means it was built in memory.
            raise ValueError(
                "this ChatKVRag was serialized from a model built in memory, which cannot be loaded "
                "from its settings: pass rag= with that model's KVRag"
            )
        given = self.rag is not None
        if self.rag is None:
            # The chat model's policy is also the KVRag's: a KVRag built for kvlink loads the
            # KVLink model (trained adapter) where one exists for this model.
            self.rag = KVRag(
                self.model,
                cache_dir=self.cache_dir,
                policy=self.policy,
                **self.policy_params,
                **shared_options(self.shared, self.shared_prefix, self.precompute_via),
            )
            if self.policy == AUTO_POLICY:  # what the model's default resolved to
                self.policy, self.policy_params = rag_policy(self.rag)
        elif not isinstance(self.rag, KVRag):
            raise TypeError(f"rag must be a kvrag.engine.KVRag, got {type(self.rag).__name__}")
        elif (self.model is not None or self.cache_dir is not None) and _BUILT_FROM.get(self.rag) != (
            self.model,
            self.cache_dir,
        ):
            raise ValueError(
                "pass either an existing `rag` or `model`/`cache_dir`, not both "
                "(`model`/`cache_dir` are not configurable fields: they load another model)"
            )
        if given:
            check_shared_matches({k: getattr(self, k) for k in SHARED_FIELDS}, self.rag, "ChatKVRag")
        # ``model`` and ``cache_dir`` name what the KVRag was loaded from (LangChain's
        # convention: ``model`` holds the model's id; a serialized chat model loads them again).
        source = getattr(self.rag.handle, "source", None)
        if self.fingerprint is not None and self.fingerprint != self.rag.fingerprint:
            raise ValueError(
                f"ChatKVRag was given fingerprint {self.fingerprint[:16]}..., but model "
                f"{source or '(in memory)'} has {self.rag.fingerprint[:16]}...: it was serialized from another model "
                "(or one built in memory, which cannot be loaded from settings: pass rag=)"
            )
        self.model = str(source) if source else None
        self.cache_dir = str(self.rag.cache_dir)
        self.fingerprint = self.rag.fingerprint
        for k, v in shared_settings(self.rag).items():  # never its password
            setattr(self, k, v)
        _BUILT_FROM[self.rag] = (self.model, self.cache_dir)
        return self

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """``dumpd(llm)`` records the settings, ``model`` and ``cache_dir`` included, never the
        loaded KVRag (``rag`` is excluded); ``load`` builds the model again from them."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_kvrag", "chat_models"]

    def to_json(self):
        out = super().to_json()
        # Serializable records the constructor's keywords; the model and store it resolved
        # belong in it too (the defaults would load another model over another store), and the
        # fingerprint, checked on load (LangChain's LLM cache also keys answers on this record).
        if out.get("type") == "constructor":
            out["kwargs"] = {
                k: v
                for k, v in {
                    **out["kwargs"],
                    "model": self.model,
                    "cache_dir": self.cache_dir,
                    "fingerprint": self.fingerprint,
                    **{k: getattr(self, k) for k in SHARED_FIELDS},
                }.items()
                if k != "rag"
            }
        return out

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvrag"
        if not isinstance(kwargs.get("model"), str):  # a per-call model= is what the trace reports
            params["ls_model_name"] = self._identifying_params["model"] or "in-memory"
        return params

    # ---- kvrag objects ---------------------------------------------------------------
    def _precompute_options(self) -> dict[str, Any]:
        return self.precompute_options

    @property
    def max_tokens(self) -> int | None:
        """LangChain's name for ``max_new_tokens`` (read by its tracing; None: unnamed, the
        default cut to the room the prompt leaves)."""
        return self.max_new_tokens

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` by the model's own tokenizer (LangChain's fallback is GPT-2's,
        which counts wrong, or nothing offline)."""
        return self.rag.handle.encode(text)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Prompt tokens of ``messages`` as the model reads them (chat template included), so
        ``trim_messages(token_counter=llm)`` trims to the real budget."""
        if tools:
            raise NotImplementedError("ChatKVRag does not support tools")
        return self.rag.count_tokens(self._prompt(messages))

    def bind_tools(self, tools, **kwargs):
        raise NotImplementedError("ChatKVRag does not support tools (tool calling): it answers from text only")

    def with_structured_output(self, schema, *, include_raw: bool = False, method: str = "json_schema", **kwargs):
        """Answers parsed into ``schema`` (a pydantic model, a TypedDict, or a JSON schema as a
        dict), each held while it is generated to a JSON document valid under the schema
        (``KVRag.generate(json_schema=...)``), so it always parses unless the token budget ends
        it first. ``method``: "json_schema" (the default; "function_calling" is taken as it,
        since the answer is the same document) or "json_mode" (any JSON object, parsed as a
        dict). ``include_raw``: ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``, as
        LangChain's chat models return it."""
        from operator import itemgetter

        from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
        from langchain_core.runnables import RunnableMap, RunnablePassthrough
        from langchain_core.utils.function_calling import convert_to_json_schema
        from pydantic import BaseModel as PydanticModel

        if kwargs:
            raise ValueError(f"ChatKVRag.with_structured_output got unsupported option(s) {sorted(kwargs)}")
        if method not in ("json_schema", "function_calling", "json_mode"):
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        pydantic = isinstance(schema, type) and issubclass(schema, PydanticModel)
        if method == "json_mode":
            json_schema: dict[str, Any] = {"type": "object"}
        elif isinstance(schema, dict) and "parameters" not in schema:
            json_schema = schema  # a JSON schema already (LangChain's converter wants a title on it)
        else:
            json_schema = convert_to_json_schema(schema)
        if pydantic and method != "json_mode":
            # A pydantic model drops fields it does not declare: barring them from the document
            # changes no parse, and keeps a small model from adding keys until its budget ends.
            json_schema = _closed(json_schema)
        parser = (
            PydanticOutputParser(pydantic_object=schema) if pydantic and method != "json_mode" else JsonOutputParser()
        )
        llm = self.bind(json_schema=json_schema)
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    @property
    def _llm_type(self) -> str:
        return "kvrag-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        source = getattr(self.rag.handle, "source", None)
        # Everything that changes the answer: LangChain's LLM cache keys on these (plus a call's
        # own options), so two models differing only in max_new_tokens must not share answers.
        return {
            "model": os.path.basename(str(source)) if source else None,
            "policy": self.policy,
            "policy_params": self.policy_params,
            "fingerprint": self.rag.fingerprint[:16],
            # Not "stop": LangChain overwrites that key with the call's own stop list.
            **{("default_stop" if k == "stop" else k): v for k, v in option_defaults(self).items() if k != "policy"},
        }

    # ---- core --------------------------------------------------------------------------
    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        opts = call_options(option_defaults(self), self.policy_params, kwargs, "ChatKVRag", log)
        opts["stop"] = opts["stop"] + stop_list(stop)  # LangChain's per-call stop adds to ours
        return opts

    def _prompt(self, messages: list[BaseMessage]) -> str:
        """The prompt string: the messages rendered with the chat template, or, for a model
        without one (a base model), as ``role: content`` lines (``kvrag.layout.prompt.plain_chat_prompt``)."""
        msgs = to_kvrag_messages(messages)
        if not has_chat_template(self.rag.tokenizer):
            return plain_chat_prompt(msgs)
        return self.rag.render(msgs)

    def _metadata(self, gen: Generation) -> dict[str, Any]:
        return {
            "model_name": self._identifying_params["model"],
            "policy": gen.stats.policy,
            "ttft_s": gen.stats.ttft_s,
            # Recorded by the decoder: EOS or a stop string on the last allowed token is "stop".
            "finish_reason": gen.finish_reason,
            "kvrag_stats": gen.stats.as_dict(),
        }

    def _iterate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
        whole: bool = False,
    ) -> Iterator[tuple[str, Any]]:
        """The one generation path (``langchain-ollama``'s ``_iterate_over_stream``): yields
        (delta, None) per text delta -- reported to ``run_manager`` as a new token, so callbacks
        see tokens from ``invoke`` too -- then ("", Generation) once at the end.

        ``whole``: the caller holds the precomputer's foreground for the whole answer (invoke);
        otherwise (a stream, read at its consumer's pace) each step holds it while it computes."""
        s = open_stream(self.rag, self._prompt(messages), self._options(stop, kwargs), self._foreground)
        try:
            for delta in s if whole else foreground_steps(s, self._foreground):
                if run_manager is not None:
                    run_manager.on_llm_new_token(
                        delta, chunk=ChatGenerationChunk(message=AIMessageChunk(content=delta))
                    )
                yield delta, None
        finally:
            # Closed early (a cancelled ainvoke, a consumer that stopped reading): stop decoding
            # and free the decode cache now, not at garbage collection.
            s.close()
        gen = s.generation()
        self._record(gen)
        yield "", gen

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with self._foreground():  # the whole answer holds background precompute back
            for _, gen in self._iterate(messages, stop, run_manager, kwargs, whole=True):  # noqa: B007 - the last is the answer
                pass
        return self._result(gen)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # LangChain's default runs ``_generate`` in an executor, which a cancelled ``ainvoke``
        # (a client that went away) cannot stop: it decoded up to max_new_tokens in the
        # background. Stepped here, it stops after the step in flight.
        with self._foreground():  # the whole answer holds background precompute back
            steps = aiter_in_thread(self._iterate(messages, stop, _sync(run_manager), kwargs, whole=True))
            async for _, gen in steps:  # noqa: B007 - the last is the answer
                pass
        return self._result(gen)

    def _result(self, gen: Generation) -> ChatResult:
        meta = self._metadata(gen)
        msg = AIMessage(content=gen.text, usage_metadata=_usage(gen.stats), response_metadata=meta)
        return ChatResult(
            generations=[ChatGeneration(message=msg, generation_info={"finish_reason": meta["finish_reason"]})],
            llm_output={"model_name": meta["model_name"], "policy": meta["policy"]},
        )

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for delta, gen in self._iterate(messages, stop, run_manager, kwargs):
            if gen is None:
                yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
                continue
            meta = self._metadata(gen)
            yield ChatGenerationChunk(
                message=AIMessageChunk(
                    content="", usage_metadata=_usage(gen.stats), response_metadata=meta, chunk_position="last"
                ),
                generation_info={"finish_reason": meta["finish_reason"]},
            )

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # LangChain's default steps ``_stream`` in an executor too, but a cancelled consumer
        # leaves the generator open until garbage collection; here it raises CancelledError
        # and the generator is closed as soon as the step in flight returns.
        async for chunk in aiter_in_thread(self._stream(messages, stop, _sync(run_manager), **kwargs)):
            yield chunk


def _sync(run_manager: AsyncCallbackManagerForLLMRun | None) -> CallbackManagerForLLMRun | None:
    """The sync handle of an async run manager, for the generation stepped in a worker thread."""
    return run_manager.get_sync() if run_manager is not None else None
