"""The OpenAI wire format ``kvrag serve`` speaks: request and response models, the error shape.

Requests are pydantic models whose fields are the ones kvrag implements, plus the fields every
OpenAI client sends with harmless defaults (``user``, ``echo=false``, ``best_of=1``,
...): those are accepted only at their no-op value, and any other value -- or a field
kvrag does not know -- is refused with a 400 naming it, never ignored (a client asking for
tools or JSON mode must learn it got neither). ``generation_options`` maps a checked body onto
the generation options (``kvrag.query.decode.Sampling``); the serving classes
(``kvrag.serve.serving``) build the scheduler's request from it. Importing this module imports
no torch and no web framework, only pydantic.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvrag.defaults import AUTO_POLICY, MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS

if TYPE_CHECKING:  # pragma: no cover
    from kvrag.query.decode import Sampling
    from kvrag.serve.logprobs import TokenLogprob

#: OpenAI's limit on stop sequences.
MAX_STOP = 4
#: OpenAI's limit on ``logit_bias`` entries.
MAX_LOGIT_BIAS_ENTRIES = 300
#: ``seed``'s range: a signed 64-bit integer, as OpenAI and torch's generators take it.
SEED_RANGE = (-(2**63), 2**63 - 1)


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # Unknown fields are kept (extra="allow") so the server can name them in its 400 instead of
    # pydantic's generic message; ``unsupported`` lists them.
    model_config = ConfigDict(extra="allow")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    #: An assistant turn's calls, and a tool turn's answer to one (OpenAI's tool messages).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema a reply is held to (``name``, ``description``
    and ``strict`` are accepted: a reply is always held to the schema, strictly)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


#: Fields accepted only at these values (what clients send by default): name -> allowed values.
#: ``None`` is always allowed (a client that serializes unset fields as null).
_NOOP_VALUES: dict[str, tuple] = {
    "functions": ([],),
    "function_call": ("none",),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}
#: Fields any value of which changes nothing kvrag does (bookkeeping on OpenAI's side).
_IGNORABLE = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key")


class GenerationBody(_Strict):
    """What both generating endpoints take: the sampling options (``generation_options``
    maps them), the choices, streaming, and kvrag's own ``kvrag`` extension.

    Types are strict, as OpenAI's API checks them: ``true`` is no integer, ``"5"`` no number,
    ``1`` no boolean -- a request means what its JSON says or is refused naming the field --
    and the whole body is checked here, before anything is queued, so a streamed request is
    refused exactly as a whole one is."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    #: vLLM's sampling extras (``extra_body={"min_tokens": 64, "ignore_eos": True}``): EOS barred
    #: before ``min_tokens`` tokens; ``ignore_eos`` decodes past EOS to the token limit.
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    #: OpenAI's adjustments (``kvrag.query.decode.Sampling``): penalties in [-2, 2] on the
    #: tokens generated so far, and biases in [-100, 100] by token id (as a string key), at
    #: most ``MAX_LOGIT_BIAS_ENTRIES`` of them.
    presence_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    #: Structured output: a JSON object, or a document valid under a JSON schema.
    response_format: ResponseFormat | None = None
    #: Choices drawn from the one prompt (each a decode slot of the server's).
    n: int | None = Field(default=None, ge=1)
    #: vLLM's extra: sample from the k most likely tokens only (0 or -1: all).
    top_k: int | None = Field(default=None, ge=-1)
    #: kvrag's own options, sent by OpenAI clients as ``extra_body={"kvrag": {...}}``:
    #: ``{"policy": "epic", "k_head": 8}`` (the policy's parameters beside its name).
    kvrag: dict[str, Any] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _few_biases(cls, v):
        # Counted before the entries are checked one by one: a million of them cost seconds.
        if isinstance(v, dict) and len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries (token id -> bias), got {len(v):,}")
        return v

    def unsupported(self) -> APIError | None:
        """The first field this server does not implement, as the 400 to answer, or None."""
        for name, value in (self.model_extra or {}).items():
            if name in _IGNORABLE or value is None:
                continue
            allowed = _NOOP_VALUES.get(name)
            if allowed is None:
                return APIError(400, f"unsupported field {name!r}: kvrag serve does not implement it", param=name)
            # Equal and of the same JSON type: 0 is no false, true no 1, 1.0 no 1.
            if not any(type(a) is type(value) and a == value for a in allowed):
                shown = " or ".join(repr(a) for a in allowed)
                return APIError(
                    400,
                    f"unsupported {name}={value!r}: kvrag serve implements only {name}={shown} (or leaving it out)",
                    param=name,
                )
        if self.stream_options is not None and not self.stream:
            return APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        return None

    def logprob_count(self) -> int | None:
        """Alternatives to report per generated token (None: no log-probabilities), read from
        the endpoint's own form of the field."""
        raise NotImplementedError

    def policy(self) -> tuple[str | None, dict]:
        """(policy name or None for the server's own, its parameters) from ``kvrag``;
        ``"auto"`` is the server's own, as ``KVRag.generate(policy="auto")`` is the KVRag's."""
        opts = dict(self.kvrag or {})
        name = opts.pop("policy", None)
        if name is not None and not isinstance(name, str):
            raise APIError(400, f"kvrag.policy must be a policy name (a string), got {name!r}", param="kvrag.policy")
        if name == AUTO_POLICY:
            name = None
        if name is None and opts:
            raise APIError(
                400,
                f"kvrag: parameters {sorted(opts)} without a policy: name it (kvrag.policy) beside its parameters",
                param="kvrag",
            )
        return name, opts


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationBody):
    messages: list[Message] = Field(min_length=1)
    #: Functions the model may call (``kvrag.serve.tools``), and whether it must.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def tool_setup(self) -> tuple[list[dict] | None, str | dict]:
        """(the tools as dicts, or None when there are none; the choice: "none", "auto",
        "required" or a named function as a dict). OpenAI's default is "auto" with tools."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []] or None
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if not tools or choice.function.name not in {t["function"]["name"] for t in tools}:
                raise APIError(
                    400, f"tool_choice names {choice.function.name!r}, not one of the tools", param="tool_choice"
                )
            return tools, choice.model_dump()
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice='required' without tools", param="tool_choice")
        return tools, choice or ("auto" if tools else "none")

    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprob_count(self) -> int | None:
        """Alternatives to report per token (None: no log-probabilities); OpenAI's rule: a
        ``top_logprobs`` needs ``logprobs=true``."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class CompletionRequest(GenerationBody):
    prompt: str | list[str]
    #: The legacy API's form: how many alternatives per token (0: the chosen token's alone).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _count_not_flag(cls, v):
        # ``false`` is what a client sends for "none"; ``true`` names no count (pydantic would
        # read it as 1, a guess).
        if v is False:
            return None
        if v is True:
            raise ValueError(f"logprobs here is a count of alternatives per token (0 to {MAX_TOP_LOGPROBS}), not true")
        return v

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(
                    400, f"prompt: kvrag serve takes one prompt per request, got {len(self.prompt)}", param="prompt"
                )
            return self.prompt[0]
        return self.prompt


def generation_options(body: GenerationBody, call: dict | None = None) -> Sampling:
    """The one mapping from OpenAI's body onto the generation options
    (:class:`kvrag.query.decode.Sampling`, whose construction checks them: ValueError names a
    bad one). OpenAI's defaults where a field is absent (temperature 1, top-p 1, the server's
    own answer length); ``call``: the schema of the tool call the reply must be (chat), which
    excludes a ``response_format``.

    An unnamed token limit is the server's default, cut to what the context leaves (OpenAI's
    default is "up to the context"; a RAG answer rarely needs more, and an unbounded default
    would let one request hold a slot for thousands of steps); a named limit past the context
    is refused (OpenAI and vLLM answer 400)."""
    from kvrag.query.decode import Sampling

    schema = _json_schema(body.response_format)
    if call is not None and schema is not None:
        raise APIError(400, "a required tool call and a response_format: ask for one of them", param="tool_choice")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        if body.max_tokens != body.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree: send one of them", param="max_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop: at most {MAX_STOP} sequences, got {len(stop)}", param="stop")
    if any(not s for s in stop):
        raise APIError(400, "stop: sequences must be non-empty strings", param="stop")
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.strip().isdigit():
            raise APIError(400, f"logit_bias: keys are token ids, got {key!r}", param="logit_bias")
        bias[int(key)] = value
    return Sampling(
        max_new_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),  # vLLM's -1, as 0: every token
        stop=tuple(stop),
        seed=body.seed,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias,
        min_tokens=body.min_tokens or 0,
        ignore_eos=bool(body.ignore_eos),
        json_schema=call if call is not None else schema,
    )


def _json_schema(fmt: ResponseFormat | None) -> dict | None:
    """The schema ``response_format`` holds the reply to: None for text, any object for
    ``json_object``."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format.json_schema")
    return fmt.json_schema.schema_


class ChunksRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[str] = Field(min_length=1, max_length=4096)


# ---- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    """A chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}],
    "refusal": None}``."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _token_bytes(e.token),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": _token_bytes(t)} for t, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict:
    """A completion choice's ``logprobs`` in the legacy shape: parallel lists ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (one dict text -> logprob per token) and
    ``text_offset`` (where each token starts in the reply; ``offset``: the characters streamed
    before these tokens)."""
    starts = []
    for e in entries:
        starts.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": starts,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt tokens whose K/V came
    from chunk caches or the prompt prefix cache (``FusionStats.read_tokens``),
    the field OpenAI uses for its prompt cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
