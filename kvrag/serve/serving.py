"""What every generating endpoint of ``kvrag serve`` does, whatever its wire shape.

``GenerationServing`` takes a checked body to the scheduler and back, each step once per
request: the body becomes a :class:`kvrag.serve.scheduler.GenerationRequest` (wire-only
fields refused, the generation options mapped by ``protocol.generation_options`` onto a
``Sampling``, which checks them, the policy resolved), the scheduler admits it
(``submit_choices``: what needs the model -- the vocabulary, the schema, the policy against
the model, the prompt's tokens against the context, the choices' slots -- then one ticket
per choice), and the tickets' deltas and ``Finished`` records become the whole response or
its SSE chunks.
What differs by endpoint (the prompt a body holds, a choice's shape) is the subclasses'
(``serving_chat``, ``serving_completion``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvrag.errors import KVRagError
from kvrag.policies import Policy, get_policy
from kvrag.serve.metrics import ServeMetrics
from kvrag.serve.protocol import APIError, GenerationBody, generation_options, new_id, now, usage
from kvrag.serve.scheduler import GenerationRequest, SchedulerClosedError, SchedulerFullError
from kvrag.serve.ticket import Finished, Ticket

log = logging.getLogger("kvrag.serve")

#: Seconds a ticket that ended is waited on for its ``Finished`` record.
_RESULT_TIMEOUT_S = 30
#: The scheduler's refusals (``RequestError.param``) whose field the wire's 400 names, as the
#: wire field: the others are answered with ``param`` null, as the server always answered them.
_WIRE_PARAMS = {"n": "n"}
#: The answer to a request the server ended before its reply did (its drain deadline passed).
_CUT = "server shutting down: the reply was cut at the end of the drain; retry it"


@dataclass(frozen=True)
class Turn:
    """What a body asks the model: ``prompt`` (a string, or chat messages the scheduler
    renders), the ``tools`` the reply may call (chat), and ``call``: the schema of the tool
    call the reply must be (``tool_choice`` "required" or named)."""

    prompt: str | list[dict]
    tools: list[dict] | None = None
    call: dict | None = None


class GenerationServing:
    """One endpoint family's requests, from checked body to response (subclasses: its wire
    shape). ``limit_chars``: the longest prompt read, refused before it is tokenized."""

    #: The response's ``object``, a streamed chunk's ``object``, the prefix of response ids.
    response_object: ClassVar[str]
    #: The body field that holds a prompt string (the limit's 400 names it).
    prompt_param: ClassVar[str] = "prompt"
    chunk_object: ClassVar[str]
    id_prefix: ClassVar[str]

    def __init__(self, rag, scheduler, metrics: ServeMetrics, *, model_name: str, limit_chars: int):
        self.rag, self.scheduler, self.metrics = rag, scheduler, metrics
        self.model_name, self.limit_chars = model_name, limit_chars

    # ---- what an endpoint defines -----------------------------------------------------
    async def turn(self, body) -> Turn:
        """The prompt (and tools) ``body`` asks about; APIError for a bad one."""
        raise NotImplementedError

    def choice(self, index: int, fin: Finished, tools: list[dict] | None) -> dict:
        """A whole response's choice ``index``, ended as ``fin``."""
        raise NotImplementedError

    def stream_choice(
        self, index: int, text: str | None, finish: str | None, logprobs: dict | None, role: bool, calls: list | None
    ) -> dict:
        """A streamed chunk's choice: ``text`` (None: no text), the ``finish`` reason at the
        end, ``role``: the chunk announcing the speaker (chat), ``calls``: tool calls."""
        raise NotImplementedError

    def logprobs(self, entries: Sequence, offset: int = 0) -> dict:
        """``logprobs`` of a choice's tokens ``entries``; ``offset``: characters before them."""
        raise NotImplementedError

    def choice_logprobs(self, fin: Finished) -> dict | None:
        """A whole response's choice's ``logprobs`` (None: not asked for)."""
        return self.logprobs(fin.logprobs) if fin.logprobs is not None else None

    def opening(self, stream: SSEStream) -> list[str]:
        """Chunks sent before any token (chat: each choice's role)."""
        return []

    def on_delta(self, stream: SSEStream, index: int, delta) -> list[str]:
        """The chunks of a choice's delta (text and its tokens' logprobs), as it is decoded."""
        return [stream.chunk(index, delta.text, entries=delta.logprobs)]

    def on_end(self, stream: SSEStream, index: int, fin: Finished) -> list[str]:
        """The chunks of a choice that ended as ``fin``: by default its last (``last``)."""
        return [stream.last(index, fin, fin.finish_reason)]

    # ---- one request ------------------------------------------------------------------
    async def create(self, request: Request, body: GenerationBody) -> dict | StreamingResponse:
        """Answer ``body``: the whole response, or a stream of SSE chunks."""
        turn = await self.turn(body)
        tickets = await self.admit(self.generation_request(body, turn))
        rid = new_id(self.id_prefix)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self.events(SSEStream(self, tickets, rid, include_usage, turn.tools)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        fins, firsts = await self._drain(request, tickets)
        self._observe(fins, firsts)
        if any(f.finish_reason == "cancelled" for f in fins):  # the client is still here: the server cut it
            raise APIError(503, _CUT, type="server_busy", headers={"Retry-After": "1"})
        return {
            "id": rid,
            "object": self.response_object,
            "created": now(),
            "model": self.model_name,
            "choices": [self.choice(i, fin, turn.tools) for i, fin in enumerate(fins)],
            "usage": _total_usage(fins),
            "system_fingerprint": None,
            "kvrag": _kvrag_info(fins[0]),
        }

    def generation_request(self, body: GenerationBody, turn: Turn) -> GenerationRequest:
        """The scheduler's request for ``body`` on ``turn``. Refused here: what only the wire
        knows (fields kvrag does not implement, a prompt past the server's character limit,
        a policy in its own words) and options ``Sampling`` refuses; the prompt's tokens, the
        model-bound options and the choices' slots are the scheduler's to check."""
        bad = body.unsupported()
        if bad is not None:
            raise bad
        try:
            sampling = generation_options(body, turn.call)
        except (ValueError, TypeError) as e:
            self.metrics.rejected.labels("invalid").inc()
            raise APIError(400, str(e)) from None
        prompt = turn.prompt
        if isinstance(prompt, str):
            self.check_length(len(prompt), self.prompt_param)
        return GenerationRequest(
            prompt=prompt, sampling=sampling, policy=self.policy(body), logprobs=body.logprob_count(), n=body.n or 1
        )

    def check_length(self, chars: int, param: str) -> None:
        """Refuse a prompt of ``chars`` characters past the server's limit, before it is
        rendered or tokenized (``param``: the field that holds it)."""
        if chars > self.limit_chars:
            raise APIError(
                400,
                f"{param}: prompt of {chars:,} characters is over this server's limit of {self.limit_chars:,} "
                f"(the model reads at most {self.rag.handle.max_context:,} tokens)",
                param=param,
                code="context_length_exceeded",
            )

    @staticmethod
    def policy(body: GenerationBody) -> Policy | None:
        """The policy ``body`` names with its parameters (``kvrag``), resolved once, or None:
        the server's own."""
        name, params = body.policy()
        if name is None:
            return None
        try:
            return get_policy(name, **params)  # names the known policies / the bad parameters
        except (ValueError, TypeError, KVRagError) as e:
            raise APIError(400, f"kvrag: {e}", param="kvrag.policy") from None

    async def admit(self, req: GenerationRequest) -> list[Ticket]:
        """Queue ``req`` with the scheduler: its tickets, one per choice; a refusal as the
        APIError the client gets (503 when busy or closing, 400 for a bad request)."""
        try:
            # The scheduler checks and tokenizes the prompt in the caller's thread: off the loop.
            return await asyncio.to_thread(self.scheduler.submit_choices, req)
        except SchedulerFullError as e:
            self.metrics.rejected.labels("queue_full").inc()
            retry = max(1, math.ceil(getattr(e, "retry_after_s", 1.0) or 1.0))
            raise APIError(
                503, f"server busy: {e}", type="server_busy", code="queue_full", headers={"Retry-After": str(retry)}
            ) from None
        except SchedulerClosedError as e:
            raise APIError(503, f"server shutting down: {e}", type="server_busy") from None
        except (ValueError, TypeError, KVRagError) as e:
            self.metrics.rejected.labels("invalid").inc()
            code = getattr(e, "code", None) or ("context_length_exceeded" if "context" in str(e) else None)
            param = _WIRE_PARAMS.get(getattr(e, "param", None) or "")
            raise APIError(400, str(e), param=param, code=code) from None

    async def _drain(self, request: Request, tickets: list[Ticket]) -> tuple[list[Finished], list[float | None]]:
        """Wait for every choice of a whole (non-streamed) response: their ``Finished``
        records and the times their first tokens came; a client gone away cancels them."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, tickets))

        async def drain(ticket: Ticket) -> float | None:
            t_first = None
            async for _ in ticket:
                if t_first is None:
                    t_first = time.perf_counter()
            return t_first

        try:
            firsts = await asyncio.gather(*(drain(t) for t in tickets))
            return [t.result(timeout=_RESULT_TIMEOUT_S) for t in tickets], list(firsts)
        except BaseException as e:
            for t in tickets:
                t.cancel()
            if isinstance(e, Exception):
                raise self._failed(e) from None
            raise
        finally:
            watcher.cancel()

    async def events(self, stream: SSEStream) -> AsyncIterator[str]:
        """The SSE stream of a request's choices, their chunks in the order they were decoded."""
        tickets = stream.tickets
        # Each choice's deltas, then its end (None), through one queue, as they come.
        queue: asyncio.Queue = asyncio.Queue()

        async def feed(i: int, ticket: Ticket) -> None:
            try:
                async for delta in ticket.adeltas():
                    await queue.put((i, delta))
            except Exception as e:  # noqa: BLE001 - a choice's failure goes to the stream that reports it
                await queue.put((i, e))
                return
            await queue.put((i, None))

        feeders = [asyncio.create_task(feed(i, t)) for i, t in enumerate(tickets)]
        done = False
        firsts: list[float | None] = [None] * len(tickets)
        fins: list = [None] * len(tickets)
        try:
            for chunk in self.opening(stream):
                yield chunk
            ended = 0
            while ended < len(tickets):
                i, item = await queue.get()
                if isinstance(item, Exception):
                    # Admitted, then failed (a store fault, ...): the status line is sent
                    # already, so the error travels as an SSE event, as OpenAI's API sends
                    # mid-stream errors; the other choices stop with it.
                    for t in tickets:
                        t.cancel()
                    yield _sse(self._failed(item).body())
                    yield "data: [DONE]\n\n"
                    done = True
                    return
                if item is not None:
                    if firsts[i] is None:
                        firsts[i] = time.perf_counter()
                    for chunk in self.on_delta(stream, i, item):
                        yield chunk
                    continue
                ended += 1
                fins[i] = tickets[i].result(timeout=_RESULT_TIMEOUT_S)
                if fins[i].finish_reason == "cancelled":  # by the server (a client gone reads nothing)
                    for t in tickets:
                        t.cancel()
                    yield _sse(APIError(503, _CUT, type="server_busy").body())
                    yield "data: [DONE]\n\n"
                    done = True
                    return
                for chunk in self.on_end(stream, i, fins[i]):
                    yield chunk
            self._observe(fins, firsts)
            if stream.include_usage:
                yield _sse(
                    {
                        "id": stream.rid,
                        "object": self.chunk_object,
                        "created": stream.created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": _total_usage(fins),
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
                self.metrics.finished.labels("cancelled").inc(len(tickets))
                for t in tickets:
                    t.cancel()

    def _observe(self, fins: list[Finished], firsts: list[float | None]) -> None:
        # The prompt, its prefill and TTFT are the request's, counted once; tokens per choice.
        for i, (fin, t_first) in enumerate(zip(fins, firsts)):
            self.metrics.observe_finished(fin, _tpot(t_first, fin), choice_only=i > 0)

    def _failed(self, e: Exception) -> APIError:
        """The answer to a request that failed after admission (counted as finished "error")."""
        self.metrics.finished.labels("error").inc()
        if isinstance(e, APIError):
            return e
        if isinstance(e, (ValueError, KVRagError)):
            return APIError(400, str(e))
        log.error("kvrag serve: a request failed: %s: %s", type(e).__name__, e)
        return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")


class SSEStream:
    """One streamed response: its id and creation time, and what each choice's chunks
    carried so far (characters, for the completion log-probabilities' offsets; log-probability
    entries, for those the last chunk still owes). ``held``: each choice's deltas a serving
    holds back until the choice ends (chat with tools)."""

    def __init__(self, serving: GenerationServing, tickets: list[Ticket], rid: str, include_usage: bool, tools):
        self.serving, self.tickets, self.rid, self.tools = serving, tickets, rid, tools
        self.include_usage = include_usage
        self.created = now()
        self.wants_logprobs = tickets[0].request.logprobs is not None
        self.sent_chars = [0] * len(tickets)
        self.sent_entries = [0] * len(tickets)
        self.held: list[list] = [[] for _ in tickets]

    def chunk(
        self,
        i: int,
        text: str | None,
        finish: str | None = None,
        role: bool = False,
        entries: Sequence | None = None,
        calls: list | None = None,
    ) -> str:
        """The SSE event of one chunk of choice ``i``."""
        lp = None
        if self.wants_logprobs and entries is not None:
            lp = self.serving.logprobs(entries, self.sent_chars[i])
            self.sent_entries[i] += len(entries)
        self.sent_chars[i] += len(text or "")
        choice = self.serving.stream_choice(i, text, finish, lp, role, calls)
        out: dict[str, Any] = {
            "id": self.rid,
            "object": self.serving.chunk_object,
            "created": self.created,
            "model": self.serving.model_name,
            "choices": [choice],
        }
        if self.include_usage:
            out["usage"] = None
        return _sse(out)

    def last(self, i: int, fin: Finished, finish: str) -> str:
        """Choice ``i``'s last chunk: its ``finish`` reason, with the log-probabilities of the
        tokens whose text never streamed (a stop string's)."""
        rest = fin.logprobs[self.sent_entries[i] :] if fin.logprobs is not None else None
        return self.chunk(i, None, finish=finish, entries=rest)


def _total_usage(fins: list[Finished]) -> dict:
    return usage(fins[0].prompt_tokens, sum(f.completion_tokens for f in fins), fins[0].cached_tokens)


def _tpot(t_first: float | None, fin: Finished) -> float | None:
    if t_first is None or fin.completion_tokens < 2:
        return None
    return (time.perf_counter() - t_first) / (fin.completion_tokens - 1)


def _kvrag_info(fin: Finished) -> dict:
    """kvrag's own account of the request (clients ignore fields they do not know)."""
    s = fin.stats
    info: dict[str, Any] = {"ttft_s": fin.ttft_s, "cached_tokens": fin.cached_tokens}
    if s is not None:
        info.update(policy=s.policy, chunks_hit=s.chunks_hit, chunks_missed=s.chunks_missed)
    return info


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(request: Request, tickets: list[Ticket]) -> None:
    """Cancel ``tickets`` (a request's choices) when the client of a non-streaming request goes
    away (its body is read already, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for t in tickets:
                t.cancel()
            return
