"""The RAG prompt layout kvrag's demo, benchmark and KVLink training use (CacheBlend-style:
a fixed instruction, the passages, then the question), as chat messages -- or, for a model
whose tokenizer has no chat template (a base model), as plain text.

Passages are separated by blank lines and appear verbatim, so each one is found in the
rendered prompt and served from its precomputed chunk."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


def rag_prompt(
    tokenizer, passages: Sequence[str], question: str, instruction: str = DEFAULT_INSTRUCTION
) -> list[dict] | str:
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


def render_messages(tokenizer, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None) -> str:
    """Render chat ``messages`` to the prompt string the model will see (generation prompt
    added); ``tools``: OpenAI-style function tools, for a template that renders them.

    Segmentation then runs on this string, so chunk texts must appear in it exactly as they were
    registered (a template that strips or escapes message content changes them)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: nothing to render")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"message {i} must be a dict with a 'role' key, got {m!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template, so chat messages cannot be "
            "rendered; pass the prompt as a string instead, or set tokenizer.chat_template"
        )
    messages = list(messages)
    extra = {"tools": list(tools)} if tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError, raised by the template itself
        # Some templates (Mistral-Instruct v0.1/v0.2, Gemma-style) accept no system role: the
        # instruction then goes in front of the first user message, which is what those
        # models were trained with. Any other refusal is the caller's to fix.
        if not (len(messages) > 1 and messages[0].get("role") == "system" and messages[1].get("role") == "user"):
            raise ValueError(f"the tokenizer's chat template refused these messages: {e}") from e
        merged = {**messages[1], "content": f"{messages[0].get('content', '')}\n\n{messages[1].get('content', '')}"}
        try:
            text = tokenizer.apply_chat_template(
                [merged, *messages[2:]], tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as e2:  # noqa: BLE001
            raise ValueError(
                f"the tokenizer's chat template refused these messages: {e2} "
                f"(also with the system message folded into the first user message)"
            ) from e2
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected the rendered str")
    return text


def render_prompt(tokenizer, prompt: str | Sequence[Mapping]) -> str:
    """What ``KVRag.generate`` takes -> the prompt string: a string as is, chat messages
    rendered with the tokenizer's chat template (``render_messages``). Checked to be text a
    tokenizer can read."""
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be a str or a list of chat messages, got bytes: decode it first")
    if not isinstance(prompt, (str, Sequence)):
        raise TypeError(f"prompt must be a str or a list of chat messages, got {type(prompt).__name__}")
    text = prompt if isinstance(prompt, str) else render_messages(tokenizer, list(prompt))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # the tokenizer would fail with an obscure TypeError
        raise ValueError(
            f"prompt contains an unpaired surrogate {text[e.start]!r} at character {e.start}: not "
            "valid Unicode text; decode its source with errors='replace'"
        ) from None
    return text
