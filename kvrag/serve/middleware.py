"""What runs around every request of ``kvrag serve``, before its route: the body-size limit,
the response counter (``kvrag_requests``), admission by the server's state (503 while starting
or draining), and the API-key check of the ``/v1`` routes."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hmac

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrag.serve.lifecycle import Lifecycle
from kvrag.serve.metrics import ServeMetrics
from kvrag.serve.protocol import APIError

#: The routes counted by name (``/v1/chunks/{key}`` for any key); any other path is "other".
ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/chunks",
    "/v1/chunks/{key}",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
)


def error_response(e: APIError) -> JSONResponse:
    """``e`` as OpenAI answers it: its status, ``{"error": {...}}``, its headers."""
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def api_key_check(api_key: str | None) -> list:
    """The route dependencies of a ``/v1`` endpoint: with ``api_key`` set, a request without
    ``Authorization: Bearer <api_key>`` gets a 401."""

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

    return [Depends(authorized)]


#: Bodies from this size on are followed by handing the memory their parse took back to the OS.
TRIM_AFTER_BYTES = 1 << 20


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library: nothing to do)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_memory() -> None:
    """Return the C heap's free memory to the OS. A large JSON body parsed into Python objects
    and freed leaves glibc's heaps holding the pages for reuse -- measured: a 23 MB body (a
    million ``logit_bias`` entries, refused) left the server's RSS ~200 MB above its level for
    good; after a trim it is back within a few percent."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class BodyLimit:
    """ASGI middleware: a request whose Content-Length is over ``limit`` gets a 413 (OpenAI's
    error shape) before its body is read; a body sent without one (chunked) is counted as it
    comes and gets the 413 once it passes the limit. After a request whose body was large
    (``TRIM_AFTER_BYTES``) the memory its parse took goes back to the OS (``release_memory``)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            e = APIError(413, f"request body of {int(length):,} bytes is over the limit ({self.limit:,})")
            return await error_response(e)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                # The route reading the body answers an HTTPException as is (the app's handler
                # gives it OpenAI's shape); any other error it would call a parse failure.
                raise StarletteHTTPException(413, f"request body is over the limit ({self.limit:,} bytes)")
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if seen >= TRIM_AFTER_BYTES:
                release_memory()


#: The API's paths (what a drain stops taking): ``/v1/...`` and vLLM's tokenizer endpoints.
ADMITTED_PATHS = ("/v1/", "/tokenize", "/detokenize")


class Admission:
    """ASGI middleware: the API's requests (``ADMITTED_PATHS``) are admitted while the server is ready
    (``Lifecycle``) and counted while in flight, so a drain knows when every answer is sent;
    starting or draining, they get a 503 with ``Retry-After`` (a load balancer retries them on
    another replica). The probes and ``/metrics`` are always answered."""

    def __init__(self, app, lifecycle: Lifecycle):
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith(ADMITTED_PATHS):
            return await self.app(scope, receive, send)
        state = self.lifecycle.state
        if state != "ready":
            why = "shutting down" if state == "draining" else "starting"
            e = APIError(503, f"server {why}: not taking requests", type="server_busy", headers={"Retry-After": "1"})
            return await error_response(e)(scope, receive, send)
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


class CountResponses:
    """ASGI middleware: counts every HTTP response by route and status (``kvrag_requests``)."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = "/v1/chunks/{key}" if path.startswith("/v1/chunks/") else path
        if endpoint not in (*ROUTES, "/health", "/ready", "/metrics"):
            endpoint = "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
