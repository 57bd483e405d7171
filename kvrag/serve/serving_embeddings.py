"""``POST /v1/embeddings``: texts in, their sentence embeddings out, in OpenAI's shape.

The embeddings come from a sentence-transformers model named when the server starts
(``kvrag serve --embedding-model``), so one server is a RAG pipeline's whole model side: its
retriever's embeddings (LlamaIndex ``OpenAILikeEmbedding``, LangChain ``OpenAIEmbeddings``)
and its generation. sentence-transformers is imported by ``Embedder.load`` only: a server
without an embedding model, and ``import kvrag``, never load it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvrag.errors import KVRagError
from kvrag.serve.protocol import APIError

#: OpenAI's limit on inputs in one request.
MAX_INPUTS = 2048
#: Sentences encoded per forward pass.
BATCH_SIZE = 32


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body. ``input``: a text or a list of texts (OpenAI's token-id forms
    are refused by ``texts``: ids of OpenAI's tokenizer mean nothing to this model's).
    ``dimensions``: accepted only at the model's own size (this server does not shorten
    embeddings). ``user``: bookkeeping, ignored. Types are strict, as the completions' bodies'
    are (``true`` is no integer)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def texts(self, limit_chars: int) -> list[str]:
        """The texts to embed, each checked: non-empty, at most ``limit_chars`` characters."""
        items: list[Any] = [self.input] if isinstance(self.input, str) else list(self.input)
        if not items:
            raise APIError(400, "input is empty: send a text or a list of texts", param="input")
        if len(items) > MAX_INPUTS:
            raise APIError(400, f"input: at most {MAX_INPUTS} texts per request, got {len(items):,}", param="input")
        for i, text in enumerate(items):
            if not isinstance(text, str):
                raise APIError(
                    400,
                    "input as token ids is not supported: send the texts (LangChain OpenAIEmbeddings: "
                    "check_embedding_ctx_length=False)",
                    param="input",
                )
            if not text:
                raise APIError(400, f"input[{i}] is an empty string: nothing to embed", param="input")
            if len(text) > limit_chars:
                raise APIError(
                    400, f"input[{i}] has {len(text):,} characters, over the limit of {limit_chars:,}", param="input"
                )
        return items


class Embedder:
    """A sentence-transformers model and what the endpoint reads of it: ``name`` (the id
    responses carry and ``/v1/models`` lists), ``dimensions`` and ``max_tokens`` (the longest
    input it reads; sentence-transformers truncates longer ones). Encoding is serialised: one
    batch at a time keeps a CPU server's cores for the generation."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name
        self.dimensions = int(model.get_embedding_dimension())
        self.max_tokens = int(model.max_seq_length)
        self._lock = threading.Lock()

    @classmethod
    def load(cls, name_or_path: str, device: str = "cpu", name: str | None = None) -> Embedder:
        """The sentence-transformers model at ``name_or_path`` (a folder, or a name in the local
        Hugging Face cache), on ``device``."""
        from sentence_transformers import SentenceTransformer

        try:
            model = SentenceTransformer(name_or_path, device=device)
        except (OSError, ValueError) as e:
            raise KVRagError(f"embedding model {name_or_path!r} could not be loaded: {e}") from e
        return cls(model, name or os.path.basename(os.path.normpath(name_or_path)))

    def embed(self, texts: list[str]):
        """Embeddings [len(texts), dimensions] (float32 numpy) and the tokens read (special
        tokens included, each text cut at ``max_tokens`` as the model reads it)."""
        with self._lock:
            enc = self.model.tokenizer(texts, truncation=True, max_length=self.max_tokens)
            vectors = self.model.encode(texts, batch_size=BATCH_SIZE, convert_to_numpy=True, show_progress_bar=False)
        return vectors.astype("float32", copy=False), sum(len(ids) for ids in enc["input_ids"])


class EmbeddingsServing:
    """``POST /v1/embeddings`` over ``embedder`` (None: the server has no embedding model, and
    every request is answered 404 saying how to start one). ``limit_chars``: the longest text
    read, refused before it is tokenized."""

    def __init__(self, embedder: Embedder | None, *, limit_chars: int):
        self.embedder, self.limit_chars = embedder, limit_chars

    async def create(self, body: EmbeddingRequest) -> dict:
        emb = self.embedder
        if emb is None:
            raise APIError(
                404,
                "this server has no embedding model: start it with kvrag serve --embedding-model PATH_OR_NAME "
                "(a sentence-transformers model)",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        if body.dimensions is not None and body.dimensions != emb.dimensions:
            raise APIError(
                400,
                f"dimensions={body.dimensions}: {emb.name} embeds in {emb.dimensions} dimensions and this server "
                "does not shorten embeddings (leave dimensions out)",
                param="dimensions",
            )
        texts = body.texts(self.limit_chars)
        vectors, tokens = await asyncio.to_thread(emb.embed, texts)
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        return {
            "object": "list",
            "data": data,
            "model": emb.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _encoded(vector, encoding_format: str) -> list[float] | str:
    """One embedding as the request asked: a list of floats, or OpenAI's base64 of its
    little-endian float32 bytes (what the ``openai`` client asks for and decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
