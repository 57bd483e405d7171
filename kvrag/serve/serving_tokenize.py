"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes, for context budgeting.

A prompt (or chat messages, rendered exactly as ``/v1/chat/completions`` renders them) in, the
ids the model reads out -- BOS included, so ``count`` is the ``usage.prompt_tokens`` a
completion of the same prompt reports -- with ``max_model_len``, the context they share with
the reply. ``/detokenize`` turns ids back into text.
"""

from __future__ import annotations

import asyncio
import copy
import threading

from pydantic import BaseModel, ConfigDict, Field

from kvrag.serve.protocol import APIError, ChatCompletionRequest, Message, Tool
from kvrag.serve.serving_chat import ChatServing

#: The most ids one ``/detokenize`` reads: a few contexts' worth of the largest models'.
MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(BaseModel):
    """vLLM's two forms: ``prompt`` (a string), or ``messages`` (with ``tools``) rendered with
    the chat template, generation prompt included (``add_generation_prompt``: only true, the
    prompt a chat completion reads). ``add_special_tokens``: the BOS ids the model reads
    before the text (false: the text's own ids only)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


class TokenizeServing:
    """Both endpoints over ``rag``'s tokenizer (a copy of its own, under a lock: a fast
    tokenizer is not safe to share between threads); ``chat``: the chat serving whose
    rendering of messages ``/tokenize`` reuses; ``limit_chars``: the longest prompt read."""

    def __init__(self, rag, chat: ChatServing, *, limit_chars: int):
        self.rag, self.chat, self.limit_chars = rag, chat, limit_chars
        self._tok = copy.deepcopy(rag.tokenizer)
        self._lock = threading.Lock()

    async def tokenize(self, body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt (a string) or messages (a chat), not both or neither")
        if not body.add_generation_prompt:
            raise APIError(
                400,
                "add_generation_prompt=false: kvrag serve renders a chat as its chat completions read it, "
                "with the generation prompt",
                param="add_generation_prompt",
            )
        if body.prompt is not None:
            prompt: str | list[dict] = body.prompt
            if len(prompt) > self.limit_chars:
                raise APIError(
                    400,
                    f"prompt of {len(prompt):,} characters is over this server's limit of {self.limit_chars:,}",
                    param="prompt",
                    code="context_length_exceeded",
                )
        else:
            # The chat serving bounds the messages (and their tool calls) before it renders them.
            chat_body = ChatCompletionRequest(messages=body.messages or [], tools=body.tools)
            prompt = (await self.chat.turn(chat_body)).prompt
        ids = await asyncio.to_thread(self._ids, prompt, body.add_special_tokens)
        out: dict = {"count": len(ids), "max_model_len": self.rag.handle.max_context, "tokens": ids}
        out["token_strs"] = self._tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return out

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        vocab = self.rag.handle.config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(self._text, body.tokens)}

    def _ids(self, prompt: str | list[dict], special: bool) -> list[int]:
        """The ids the model reads for ``prompt`` (as the scheduler renders and tokenizes it)."""
        from kvrag.layout.align import prompt_prefix
        from kvrag.layout.prompt import render_prompt

        with self._lock:
            try:
                text = render_prompt(self._tok, prompt)
            except (TypeError, ValueError) as e:
                raise APIError(400, str(e), param="messages" if isinstance(prompt, list) else "prompt") from None
            ids = self.rag.tokenize(text, self._tok)[0]
        return (prompt_prefix(self.rag.handle, text) if special else []) + list(ids)

    def _text(self, ids: list[int]) -> str:
        with self._lock:
            return self._tok.decode(ids)
