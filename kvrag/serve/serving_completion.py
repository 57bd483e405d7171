"""``POST /v1/completions``: a prompt string in, its continuation out (the legacy API's shape,
log-probabilities as parallel lists with each token's offset in the reply)."""

from __future__ import annotations

from collections.abc import Sequence

from kvrag.serve.protocol import CompletionRequest, completion_logprobs
from kvrag.serve.serving import GenerationServing, Turn
from kvrag.serve.ticket import Finished


class CompletionServing(GenerationServing):
    response_object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    async def turn(self, body: CompletionRequest) -> Turn:
        return Turn(body.prompt_text())

    def choice(self, index: int, fin: Finished, tools: list[dict] | None) -> dict:
        return {
            "index": index,
            "finish_reason": fin.finish_reason,
            "logprobs": self.choice_logprobs(fin),
            "text": fin.text,
        }

    def stream_choice(
        self, index: int, text: str | None, finish: str | None, logprobs: dict | None, role: bool, calls: list | None
    ) -> dict:
        return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}

    def logprobs(self, entries: Sequence, offset: int = 0) -> dict:
        return completion_logprobs(entries, offset)
