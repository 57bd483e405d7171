"""The RAG prompt layout kvrag's demo, benchmark and KVLink training use (CacheBlend-style:
a fixed instruction, the passages, then the question), as chat messages -- or, for a model
whose tokenizer has no chat template (a base model), as plain text.

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


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def rag_prompt(tokenizer, passages: Sequence[str], question: str,
               instruction: str = DEFAULT_INSTRUCTION) -> list[dict] | str:
    """The RAG prompt for ``tokenizer``'s model: ``rag_messages`` when it has a chat template,
    else the same layout as plain text (instruction, passages, question, ``Answer:``), which a
    base model continues. Both are what ``KVRag.generate`` takes."""
    if has_chat_template(tokenizer):
        return rag_messages(passages, question, instruction)
    body = "\n\n".join(passages)
    return f"{instruction}\n\nPassages:\n\n{body}\n\nQuestion: {question}\nAnswer:"


def plain_chat_prompt(messages: Sequence[dict]) -> str:
    """Chat messages ``[{"role", "content"}]`` as plain text for a model without a chat
    template: one ``role: content`` line each, then ``assistant: `` for the reply (the layout
    of LlamaIndex's generic ``messages_to_prompt``). Contents stay verbatim, so the chunks in
    them are still found."""
    return "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages) + "\nassistant: "
