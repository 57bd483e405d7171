"""The HTTP face of ``kvrag serve``: a FastAPI app over one ``KVRag`` and its ``Scheduler``.

The app only translates: a request in OpenAI's wire format becomes a
:class:`kvrag.serve.scheduler.GenerationRequest`, the scheduler runs it through the library's
own query path (``KVRag.render``, segmentation, chunk lookup, fusion under the request's
policy, decoding), and the ticket's text deltas and ``Finished`` record become the response or
its SSE chunks. Nothing here segments, looks up or fuses: a second implementation would drift.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /v1/chunks`` (texts -> keys, computed by the library's background precomputer, as the
in-process ingestion hooks do), ``GET /v1/chunks/{key}``, ``GET /health``, ``GET /metrics``.
Every error is answered in OpenAI's shape (``protocol.APIError``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrag.errors import KVRagError
from kvrag.limits import max_chunk_chars
from kvrag.serve.metrics import CONTENT_TYPE, ServeMetrics
from kvrag.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChunksRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    usage,
)
from kvrag.serve.tools import call_schema, messages_for, native, parse_calls, wire_calls

log = logging.getLogger("kvrag.serve")

_KEY = re.compile(r"[0-9a-f]{64}")
#: Largest request body read (bytes, from Content-Length): a 1M-character prompt is ~1 MB, a
#: full /v1/chunks batch of long passages a few MB.
MAX_BODY_BYTES = 32 << 20


def create_app(
    rag,
    scheduler,
    *,
    model_name: str = "kvrag",
    api_key: str | None = None,
    precomputer=None,
    max_prompt_chars: int | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The app serving ``rag`` through ``scheduler`` (started and closed by the caller).

    model_name: the id ``/v1/models`` lists and responses carry (requests may name any
    model: one server, one model). api_key: when set, every ``/v1`` endpoint wants
    ``Authorization: Bearer <key>`` (``/health`` and ``/metrics`` stay open, for probes and
    scrapers). precomputer: the ``Precomputer`` ``POST /v1/chunks`` feeds (default: the
    KVRag's shared one, the one its in-process hooks use). max_prompt_chars: longest prompt
    read (default: ``kvrag.limits.max_chunk_chars``, the most characters the model's context
    can hold with this tokenizer, so a prompt that fits is never refused and a 1M-character
    one is refused before it is tokenized). max_body_bytes: largest
    request body (by its Content-Length; 413 past it)."""
    from kvrag.policies import get_policy
    from kvrag.serve.scheduler import GenerationRequest, SchedulerClosedError, SchedulerFullError

    metrics = ServeMetrics(lambda: scheduler.queue_depth, lambda: scheduler.running)
    scheduler.step_observers.append(metrics.observe_step)
    # A character takes at least one byte of the body: without a bound from the vocabulary,
    # the body limit is the bound.
    limit_chars = max_prompt_chars or max_chunk_chars(rag.tokenizer, rag.handle.max_context) or max_body_bytes
    app = FastAPI(title="kvrag serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.rag, app.state.scheduler, app.state.metrics = rag, scheduler, metrics

    # ---- errors, always in OpenAI's shape ---------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return _api_error_response(_validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _api_error_response(APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception):
        log.exception("kvrag serve: unexpected error on %s", request.url.path)
        return _api_error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    app.add_middleware(_CountResponses, metrics=metrics)

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or incorrect API key: send Authorization: Bearer <the server's --api-key>",
                code="invalid_api_key",
            )

    auth = [Depends(authorized)]

    # ---- requests -> the scheduler -------------------------------------------------------
    def generation(body, prompt, call: dict | None = None) -> Any:
        """The scheduler's request for ``body`` on ``prompt``; ``call``: the schema of the tool
        call the reply must be (``tool_choice`` "required" or named)."""
        bad = body.unsupported()
        if bad is not None:
            raise bad
        schema = body.json_schema()
        if call is not None and schema is not None:
            raise APIError(400, "a required tool call and a response_format: ask for one of them", param="tool_choice")
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        if chars > limit_chars:
            raise APIError(
                400,
                f"prompt of {chars:,} characters is over this server's limit of {limit_chars:,} "
                f"(the model reads at most {rag.handle.max_context:,} tokens)",
                param="messages" if isinstance(prompt, list) else "prompt",
                code="context_length_exceeded",
            )
        if body.n is not None and body.n > scheduler.max_concurrency:
            raise APIError(
                400,
                f"n={body.n}: each choice decodes in a slot of its own, and this server has "
                f"{scheduler.max_concurrency} (--max-concurrency)",
                param="n",
            )
        policy, params = body.policy()
        if policy is not None or params:
            try:
                get_policy(policy, **params)  # names the known policies / the bad parameters
            except (ValueError, TypeError, KVRagError) as e:
                raise APIError(400, f"kvrag: {e}", param="kvrag.policy") from None
        try:
            return GenerationRequest(
                prompt=prompt,
                max_new_tokens=body.max_new_tokens(),
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
                stop=body.stops(),
                policy=policy,
                policy_params=params,
                min_tokens=body.min_tokens or 0,
                ignore_eos=bool(body.ignore_eos),
                logprobs=body.logprob_count(),
                n=body.n or 1,
                json_schema=call if call is not None else schema,
                **body.adjustments(),
            )
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None

    async def admit(req):
        try:
            # The scheduler checks and tokenizes the prompt in the caller's thread: off the loop.
            return await asyncio.to_thread(scheduler.submit_choices, req)
        except SchedulerFullError as e:
            metrics.rejected.labels("queue_full").inc()
            retry = max(1, math.ceil(getattr(e, "retry_after_s", 1.0) or 1.0))
            raise APIError(
                503, f"server busy: {e}", type="server_busy", code="queue_full", headers={"Retry-After": str(retry)}
            ) from None
        except SchedulerClosedError as e:
            raise APIError(503, f"server shutting down: {e}", type="server_busy") from None
        except (ValueError, TypeError, KVRagError) as e:
            metrics.rejected.labels("invalid").inc()
            code = "context_length_exceeded" if "context" in str(e) else None
            raise APIError(400, str(e), code=code) from None

    def observe(fins, firsts) -> None:
        # The prompt, its prefill and TTFT are the request's, counted once; tokens per choice.
        for i, (fin, t_first) in enumerate(zip(fins, firsts)):
            metrics.observe_finished(fin, _tpot(t_first, fin), choice_only=i > 0)

    def total_usage(fins) -> dict:
        return usage(fins[0].prompt_tokens, sum(f.completion_tokens for f in fins), fins[0].cached_tokens)

    def reply(fin, tools) -> tuple[dict, str]:
        """A chat choice's ``message`` and ``finish_reason``: its calls, where it made any."""
        content, calls = parse_calls(fin.text, tools) if tools else (fin.text, [])
        if not calls:
            return {"role": "assistant", "content": fin.text}, fin.finish_reason
        return {"role": "assistant", "content": content, "tool_calls": wire_calls(calls)}, "tool_calls"

    async def respond(request: Request, body, prompt, chat: bool, tools=None, call=None):
        """Answer ``body`` on ``prompt``; ``tools``: those the reply may call (chat)."""
        req = generation(body, prompt, call)
        tickets = await admit(req)
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _events(tickets, rid, chat, include_usage, tools),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        watcher = asyncio.create_task(_cancel_on_disconnect(request, tickets))

        async def drain(ticket) -> float | None:
            t_first = None
            async for _ in ticket:
                if t_first is None:
                    t_first = time.perf_counter()
            return t_first

        try:
            firsts = await asyncio.gather(*(drain(t) for t in tickets))
            fins = [t.result(timeout=30) for t in tickets]
        except BaseException as e:
            for t in tickets:
                t.cancel()
            if isinstance(e, Exception):
                raise _failed(e) from None
            raise
        finally:
            watcher.cancel()
        observe(fins, firsts)
        choices = []
        for i, fin in enumerate(fins):
            choice = {"index": i, "finish_reason": fin.finish_reason, "logprobs": _logprobs(fin.logprobs, chat)}
            if chat:
                choice["message"], choice["finish_reason"] = reply(fin, tools)
            else:
                choice["text"] = fin.text
            choices.append(choice)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": model_name,
            "choices": choices,
            "usage": total_usage(fins),
            "system_fingerprint": None,
            "kvrag": _kvrag_info(fins[0]),
        }

    def _logprobs(entries, chat: bool, offset: int = 0) -> dict | None:
        if entries is None:
            return None
        return chat_logprobs(entries) if chat else completion_logprobs(entries, offset)

    async def _events(tickets, rid: str, chat: bool, include_usage: bool, tools=None) -> AsyncIterator[str]:
        """The SSE stream of a request's choices, their chunks in the order they were decoded.
        With ``tools`` a choice's reply is held back until it ends (whether it is a call is
        known then), and sent as one chunk: its text, or its calls."""
        created = now()
        kind = "chat.completion.chunk" if chat else "text_completion"
        wants_logprobs = tickets[0].request.logprobs is not None
        streamed = [{"chars": 0, "entries": 0} for _ in tickets]  # what each choice's chunks carried

        held: list[list] = [[] for _ in tickets]  # with tools: each choice's deltas, until it ends

        def chunk(
            i: int, delta: str | None, finish: str | None = None, role: bool = False, entries=None, calls=None
        ) -> str:
            lp = None
            if wants_logprobs and entries is not None:
                lp = _logprobs(entries, chat, streamed[i]["chars"])
                streamed[i]["entries"] += len(entries)
            streamed[i]["chars"] += len(delta or "")
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if delta is not None:
                    d = {"content": delta}
                if calls:
                    d = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                choice = {"index": i, "delta": d, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": i, "text": delta or "", "finish_reason": finish, "logprobs": lp}
            out = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return _sse(out)

        # Each choice's deltas, then its end (None), through one queue, as they come.
        events: asyncio.Queue = asyncio.Queue()

        async def feed(i: int, ticket) -> None:
            try:
                async for delta in ticket.adeltas():
                    await events.put((i, delta))
            except Exception as e:
                await events.put((i, e))
                return
            await events.put((i, None))

        feeders = [asyncio.create_task(feed(i, t)) for i, t in enumerate(tickets)]
        done = False
        firsts: list[float | None] = [None] * len(tickets)
        fins: list = [None] * len(tickets)
        try:
            if chat:
                for i in range(len(tickets)):
                    yield chunk(i, None, role=True)
            ended = 0
            while ended < len(tickets):
                i, item = await events.get()
                if isinstance(item, Exception):
                    # Admitted, then failed (a store fault, ...): the status line is sent
                    # already, so the error travels as an SSE event, as OpenAI's API sends
                    # mid-stream errors; the other choices stop with it.
                    for t in tickets:
                        t.cancel()
                    yield _sse(_failed(item).body())
                    yield "data: [DONE]\n\n"
                    done = True
                    return
                if item is not None:
                    if firsts[i] is None:
                        firsts[i] = time.perf_counter()
                    if tools:
                        held[i].append(item)
                    else:
                        yield chunk(i, item.text, entries=item.logprobs)
                    continue
                ended += 1
                fin = fins[i] = tickets[i].result(timeout=30)
                finish = fin.finish_reason
                if tools:
                    message, finish = reply(fin, tools)
                    if "tool_calls" in message:
                        yield chunk(i, None, calls=message["tool_calls"])
                    elif fin.text:
                        yield chunk(i, fin.text, entries=[e for d in held[i] for e in d.logprobs])
                # Tokens whose text never streamed (a stop string's) come with the last chunk.
                rest = fin.logprobs[streamed[i]["entries"] :] if fin.logprobs is not None else None
                yield chunk(i, None, finish=finish, entries=rest)
            observe(fins, firsts)
            if include_usage:
                yield _sse(
                    {
                        "id": rid,
                        "object": kind,
                        "created": created,
                        "model": model_name,
                        "choices": [],
                        "usage": total_usage(fins),
                        "kvrag": _kvrag_info(fins[0]),
                    }
                )
            yield "data: [DONE]\n\n"
            done = True
        finally:
            for f in feeders:
                f.cancel()
            # A client that went away (Starlette cancels the response) frees its decode slots
            # at the next step.
            if not done:
                metrics.finished.labels("cancelled").inc(len(tickets))
                for t in tickets:
                    t.cancel()

    def _failed(e: Exception) -> APIError:
        """The answer to a request that failed after admission (counted as finished "error")."""
        metrics.finished.labels("error").inc()
        if isinstance(e, APIError):
            return e
        if isinstance(e, (ValueError, KVRagError)):
            return APIError(400, str(e))
        log.error("kvrag serve: a request failed: %s: %s", type(e).__name__, e)
        return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        tools, choice = body.tool_setup()
        messages: list[dict] = []
        for m in body.messages:
            # "developer" is OpenAI's newer name for the system role; chat templates know "system".
            entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                entry["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.role == "tool":
                entry["tool_call_id"] = m.tool_call_id
            messages.append(entry)
        if tools is None and not any(m["role"] == "tool" or "tool_calls" in m for m in messages):
            return await respond(request, body, messages, chat=True)
        prompt = await asyncio.to_thread(_render_with_tools, rag.tokenizer, messages, tools)
        call = call_schema(tools, choice) if tools and choice not in ("none", "auto") else None
        return await respond(request, body, prompt, chat=True, tools=tools if choice != "none" else None, call=call)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request, body: CompletionRequest):
        return await respond(request, body, body.prompt_text(), chat=False)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": app.state.started,
                    "owned_by": "kvrag",
                    "max_model_len": rag.handle.max_context,
                }
            ],
        }

    # ---- chunks over HTTP -----------------------------------------------------------------
    def chunk_precomputer():
        from kvrag.precompute import Precomputer

        return precomputer if precomputer is not None else Precomputer.for_rag(rag)

    @app.post("/v1/chunks", dependencies=auth)
    async def add_chunks(body: ChunksRequest):
        metrics.chunks_submitted.inc(len(body.texts))
        data = await asyncio.to_thread(_submit_chunks, rag, chunk_precomputer(), body.texts, limit_chars)
        return {"object": "list", "data": data}

    @app.get("/v1/chunks/{key}", dependencies=auth)
    async def chunk_status(key: str):
        if not _KEY.fullmatch(key):
            raise APIError(400, f"not a chunk key (64 lowercase hex digits): {key[:80]!r}", param="key")
        stored = await asyncio.to_thread(rag.store.__contains__, key)
        return {"key": key, "stored": bool(stored)}

    # ---- operations -------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queue_depth": scheduler.queue_depth, "running": scheduler.running}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.state.started = now()
    return app


def _submit_chunks(rag, pc, texts: list[str], limit_chars: int) -> list[dict]:
    """Each text's key and what happened to it: "stored" (cached already), "queued" (the
    background precomputer computes it), "rejected" (never cacheable: empty, ...), "dropped"
    (the precompute queue stayed full: send it again later)."""
    from kvrag.errors import ChunkError
    from kvrag.precompute import QueueFullError

    out = []
    for i, text in enumerate(texts):
        item: dict[str, Any] = {"index": i}
        if len(text) > limit_chars:  # refused unread, as a prompt of that size is
            out.append({**item, "key": None, "status": "rejected", "error": f"{len(text):,} characters: too long"})
            continue
        try:
            item["key"] = rag.chunk_key(text)
        except (ChunkError, ValueError) as e:
            out.append({**item, "key": None, "status": "rejected", "error": str(e)})
            continue
        if item["key"] in rag.store:
            out.append({**item, "status": "stored"})
            continue
        try:
            # Waiting a while for queue room is the back-pressure the in-process hooks apply too.
            pc.submit(text, block=True, timeout=30)
            item["status"] = "queued"
        except ChunkError as e:
            item.update(status="rejected", error=str(e))
        except QueueFullError as e:
            item.update(status="dropped", error=str(e))
        out.append(item)
    return out


def _render_with_tools(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt of a chat with tools or tool turns (``kvrag.serve.tools``)."""
    from kvrag.query.prompt import render_messages

    try:
        return render_messages(
            tokenizer, messages_for(tokenizer, messages, tools), tools if native(tokenizer) else None
        )
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param="messages") from None


def _tpot(t_first: float | None, fin) -> float | None:
    if t_first is None or fin.completion_tokens < 2:
        return None
    return (time.perf_counter() - t_first) / (fin.completion_tokens - 1)


def _kvrag_info(fin) -> dict:
    """kvrag's own account of the request (clients ignore fields they do not know)."""
    s = fin.stats
    info = {"ttft_s": fin.ttft_s, "cached_tokens": fin.cached_tokens}
    if s is not None:
        info.update(policy=s.policy, chunks_hit=s.chunks_hit, chunks_missed=s.chunks_missed)
    return info


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(request: Request, tickets) -> None:
    """Cancel ``tickets`` (a request's choices) when the client of a non-streaming request goes
    away (its body is read already, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for t in tickets:
                t.cancel()
            return


def _api_error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _validation_error(e: RequestValidationError) -> APIError:
    """pydantic's first complaint, as OpenAI words a bad request: what, and which field."""
    errors = e.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')}")
    if first.get("type") == "missing" and not loc:
        return APIError(400, "missing request body (a JSON object)")
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return APIError(400, f"{param or 'body'}: {first.get('msg')}{more}", param=param)


class _BodyLimit:
    """ASGI middleware: a request whose Content-Length is over ``limit`` gets a 413 (OpenAI's
    error shape) before its body is read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = dict(scope.get("headers") or []).get(b"content-length", b"0")
            if length.isdigit() and int(length) > self.limit:
                e = APIError(413, f"request body of {int(length):,} bytes is over the limit ({self.limit:,})")
                return await _api_error_response(e)(scope, receive, send)
        return await self.app(scope, receive, send)


class _CountResponses:
    """ASGI middleware: counts every HTTP response by route and status (``kvrag_requests``)."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = "/v1/chunks/{key}" if path.startswith("/v1/chunks/") else path
        known = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/chunks", "/v1/chunks/{key}")
        if endpoint not in (*known, "/health", "/metrics"):
            endpoint = "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
