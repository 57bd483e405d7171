"""The HTTP face of ``kvrag serve``: a FastAPI app over one ``KVRag`` and its ``Scheduler``.

Routes and error handlers only. Each endpoint family has a serving class that does its work
(``serving_chat``, ``serving_completion``: request body -> ``GenerationRequest``, admission,
response or SSE stream; ``serving_chunks``: chunks over HTTP; ``serving_embeddings``,
``serving_tokenize``: the embedding model's vectors, the tokenizer's ids); the scheduler runs a request
through the library's own query path (``KVRag.prefill``: segmentation, chunk lookup, fusion
under the request's policy; then decoding). Nothing in the server segments, looks up or fuses:
a second implementation would drift.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /v1/chunks`` (texts -> keys, computed by the library's background precomputer, as the
in-process ingestion hooks do), ``GET /v1/chunks/{key}``, ``GET /health`` (liveness),
``GET /ready`` (readiness: 503 while starting or draining, ``lifecycle``), ``GET /metrics``,
``POST /v1/embeddings`` (with an embedding model), ``POST /tokenize``, ``POST /detokenize``.
Every error is answered in OpenAI's shape (``protocol.APIError``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrag.limits import max_chunk_chars
from kvrag.serve.lifecycle import Lifecycle
from kvrag.serve.metrics import CONTENT_TYPE, ServeMetrics
from kvrag.serve.middleware import Admission, BodyLimit, CountResponses, api_key_check, error_response
from kvrag.serve.protocol import APIError, ChatCompletionRequest, ChunksRequest, CompletionRequest, now
from kvrag.serve.serving_chat import ChatServing
from kvrag.serve.serving_chunks import ChunksServing
from kvrag.serve.serving_completion import CompletionServing
from kvrag.serve.serving_embeddings import Embedder, EmbeddingRequest, EmbeddingsServing
from kvrag.serve.serving_tokenize import DetokenizeRequest, TokenizeRequest, TokenizeServing

log = logging.getLogger("kvrag.serve")

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
    lifecycle: Lifecycle | None = None,
    embedder: Embedder | None = None,
) -> FastAPI:
    """The app serving ``rag`` through ``scheduler`` (started and closed by the caller).

    model_name: the id ``/v1/models`` lists and responses carry (requests may name any model:
    one server, one model). api_key: when set, every ``/v1`` endpoint (and ``/tokenize``,
    ``/detokenize``) wants ``Authorization: Bearer <key>`` (``/health``, ``/ready`` and
    ``/metrics`` stay open, for probes and scrapers). precomputer: the ``Precomputer`` ``POST /v1/chunks`` feeds
    (default: the KVRag's shared one, the one its in-process hooks use). max_prompt_chars:
    longest prompt read (default: ``kvrag.limits.max_chunk_chars``, the most characters the
    model's context can hold with this tokenizer, so a prompt that fits is never refused and a
    1M-character one is refused before it is tokenized). max_body_bytes: largest
    request body (by its Content-Length, or counted as a chunked one comes; 413 past it).
    lifecycle: the server's state, which ``/ready`` reports and the API's admission follows
    (default: ready for its whole life; ``kvrag serve`` starts it "starting" and drains it).
    embedder: the ``serving_embeddings.Embedder`` ``POST /v1/embeddings`` answers with (None:
    that endpoint answers 404, naming the option that configures one)."""
    metrics = ServeMetrics(lambda: scheduler.queue_depth, lambda: scheduler.running)
    scheduler.step_observers.append(metrics.observe_step)
    # A character takes at least one byte of the body: without a bound from the vocabulary,
    # the body limit is the bound.
    limit_chars = max_prompt_chars or max_chunk_chars(rag.tokenizer, rag.handle.max_context) or max_body_bytes
    app = FastAPI(title="kvrag serve", docs_url=None, redoc_url=None, openapi_url=None)
    lifecycle = lifecycle or Lifecycle()
    app.state.rag, app.state.scheduler, app.state.metrics = rag, scheduler, metrics
    app.state.lifecycle = lifecycle
    for error, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(Admission, lifecycle=lifecycle)
    app.add_middleware(CountResponses, metrics=metrics)
    auth = api_key_check(api_key)
    chat = ChatServing(rag, scheduler, metrics, model_name=model_name, limit_chars=limit_chars)
    completion = CompletionServing(rag, scheduler, metrics, model_name=model_name, limit_chars=limit_chars)
    chunks = ChunksServing(rag, metrics, precomputer=precomputer, limit_chars=limit_chars)
    embeddings = EmbeddingsServing(embedder, limit_chars=limit_chars)
    tokens = TokenizeServing(rag, chat, limit_chars=limit_chars)

    _generation_routes(app, chat, completion, auth)
    _model_routes(app, embeddings, tokens, auth, model_name=model_name, embedder=embedder)
    _chunk_routes(app, chunks, auth)
    _probe_routes(app, model_name=model_name)
    app.state.started = now()
    return app


# ---- routes, one function per endpoint family -------------------------------------------------
def _generation_routes(app: FastAPI, chat: ChatServing, completion: CompletionServing, auth: list) -> None:
    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await chat.create(request, body)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request, body: CompletionRequest):
        return await completion.create(request, body)


def _model_routes(
    app: FastAPI,
    embeddings: EmbeddingsServing,
    tokens: TokenizeServing,
    auth: list,
    *,
    model_name: str,
    embedder: Embedder | None,
) -> None:
    """The models served, and what their tokenizer and the embedding model answer."""
    rag = app.state.rag

    @app.get("/v1/models", dependencies=auth)
    async def models():
        card = {"id": model_name, "object": "model", "created": app.state.started, "owned_by": "kvrag"}
        cards = [{**card, "max_model_len": rag.handle.max_context}]
        if embedder is not None:
            cards.append({**card, "id": embedder.name, "max_model_len": embedder.max_tokens})
        return {"object": "list", "data": cards}

    @app.post("/v1/embeddings", dependencies=auth)
    async def create_embeddings(body: EmbeddingRequest):
        return await embeddings.create(body)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest):
        return await tokens.tokenize(body)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest):
        return await tokens.detokenize(body)


def _chunk_routes(app: FastAPI, chunks: ChunksServing, auth: list) -> None:
    @app.post("/v1/chunks", dependencies=auth)
    async def add_chunks(body: ChunksRequest):
        return await chunks.add(body)

    @app.get("/v1/chunks/{key}", dependencies=auth)
    async def chunk_status(key: str):
        return await chunks.status(key)


def _probe_routes(app: FastAPI, *, model_name: str) -> None:
    """Liveness, readiness and the Prometheus scrape: open even with an API key."""
    scheduler, lifecycle, metrics = app.state.scheduler, app.state.lifecycle, app.state.metrics

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queue_depth": scheduler.queue_depth, "running": scheduler.running}

    @app.get("/ready")
    async def ready():
        body = {"status": lifecycle.state, "model": model_name}
        return JSONResponse(body, status_code=200 if lifecycle.ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)


# ---- errors, always in OpenAI's shape -------------------------------------------------------
async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return error_response(e)


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(_validation_error(e))


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(APIError(e.status_code, str(e.detail), type=kind))


async def _server_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("kvrag serve: unexpected error on %s", request.url.path)
    return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))


_ERROR_HANDLERS: dict[type[Exception], Callable[..., Awaitable[JSONResponse]]] = {
    APIError: _api_error,
    RequestValidationError: _invalid,
    StarletteHTTPException: _http_error,
    Exception: _server_error,
}


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
