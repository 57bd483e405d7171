"""``POST /v1/chat/completions``: chat messages in, an assistant message (or its tool calls) out.

A chat without tools goes to the scheduler as its messages (the scheduler renders them with
the model's chat template). A chat with tools, or with earlier calls and tool results, is
rendered here (``kvrag.serve.tools``: in the template's own terms where it knows tools, as
text otherwise); with ``tool_choice`` "required" or a named function the reply is held to a
call's schema. With tools a reply is a call or text, known only when it ends: a streamed
choice's deltas are held back until then and sent as one chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvrag.serve.protocol import APIError, ChatCompletionRequest, chat_logprobs
from kvrag.serve.serving import GenerationServing, SSEStream, Turn
from kvrag.serve.ticket import Finished
from kvrag.serve.tools import call_schema, messages_for, native, parse_calls, wire_calls


class ChatServing(GenerationServing):
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    async def turn(self, body: ChatCompletionRequest) -> Turn:
        tools, choice = body.tool_setup()
        # Bounded before the chat template renders them and the tokenizer reads the result:
        # every message takes at least one token of the context, and every character of
        # them counts against the prompt's limit.
        context = self.rag.handle.max_context
        if len(body.messages) > context:
            raise APIError(
                400,
                f"messages: {len(body.messages):,} messages cannot fit the model's context of {context:,} tokens "
                "(each takes at least one)",
                param="messages",
                code="context_length_exceeded",
            )
        messages: list[dict] = []
        for m in body.messages:
            # "developer" is OpenAI's newer name for the system role; chat templates know "system".
            entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                entry["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.role == "tool":
                entry["tool_call_id"] = m.tool_call_id
            messages.append(entry)
        self.check_length(sum(len(m["content"]) + len(str(m.get("tool_calls") or "")) for m in messages), "messages")
        if tools is None and not any(m["role"] == "tool" or "tool_calls" in m for m in messages):
            return Turn(messages)
        prompt = await asyncio.to_thread(self._render_with_tools, messages, tools)
        call = call_schema(tools, choice) if tools and choice not in ("none", "auto") else None
        return Turn(prompt, tools if choice != "none" else None, call)

    def _render_with_tools(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The prompt of a chat with tools or tool turns (``kvrag.serve.tools``)."""
        from kvrag.layout.prompt import render_messages

        tokenizer = self.rag.tokenizer
        try:
            return render_messages(
                tokenizer, messages_for(tokenizer, messages, tools), tools if native(tokenizer) else None
            )
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="messages") from None

    def choice(self, index: int, fin: Finished, tools: list[dict] | None) -> dict:
        choice = {"index": index, "finish_reason": fin.finish_reason, "logprobs": self.choice_logprobs(fin)}
        choice["message"], choice["finish_reason"] = _reply(fin, tools)
        return choice

    def stream_choice(
        self, index: int, text: str | None, finish: str | None, logprobs: dict | None, role: bool, calls: list | None
    ) -> dict:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta = {"content": text}
        if calls:
            delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

    def logprobs(self, entries: Sequence, offset: int = 0) -> dict:
        return chat_logprobs(entries)

    def opening(self, stream: SSEStream) -> list[str]:
        return [stream.chunk(i, None, role=True) for i in range(len(stream.tickets))]

    def on_delta(self, stream: SSEStream, index: int, delta) -> list[str]:
        if stream.tools:
            stream.held[index].append(delta)
            return []
        return super().on_delta(stream, index, delta)

    def on_end(self, stream: SSEStream, index: int, fin: Finished) -> list[str]:
        if not stream.tools:
            return super().on_end(stream, index, fin)
        # The whole reply, now that it is known to be a call or text: one chunk of either.
        message, finish = _reply(fin, stream.tools)
        out = []
        if "tool_calls" in message:
            out.append(stream.chunk(index, None, calls=message["tool_calls"]))
        elif fin.text:
            out.append(stream.chunk(index, fin.text, entries=[e for d in stream.held[index] for e in d.logprobs]))
        out.append(stream.last(index, fin, finish))
        return out


def _reply(fin: Finished, tools: list[dict] | None) -> tuple[dict, str]:
    """A chat choice's ``message`` and ``finish_reason``: its calls, where it made any."""
    content, calls = parse_calls(fin.text, tools) if tools else (fin.text, [])
    if not calls:
        return {"role": "assistant", "content": fin.text}, fin.finish_reason
    return {"role": "assistant", "content": content, "tool_calls": wire_calls(calls)}, "tool_calls"
