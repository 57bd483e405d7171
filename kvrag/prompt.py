"""The RAG prompt layout kvrag's demo and benchmark use (CacheBlend-style: a fixed
instruction, the passages, then the question), as chat messages.

Passages are separated by blank lines and appear verbatim, so each one is found in the
rendered prompt and served from its precomputed chunk."""
from __future__ import annotations

from collections.abc import Sequence

DEFAULT_INSTRUCTION = (
    "You will be asked a question after reading several passages. "
    "Answer the question using the passages. Reply with a short answer only."
)


def rag_messages(passages: Sequence[str], question: str, instruction: str = DEFAULT_INSTRUCTION) -> list[dict]:
    """[system: instruction, user: passages + question] chat messages."""
    body = "\n\n".join(passages)
    return [
        {"role": "system", "content": instruction},
        {"role": "user", "content": f"Passages:\n\n{body}\n\nQuestion: {question}\nAnswer:"},
    ]
