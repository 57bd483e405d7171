"""Tool calls (OpenAI's ``tools``) for any chat model ``kvrag serve`` runs.

The prompt: a chat template that knows tools (its source names ``tools``: Qwen2.5, Llama 3.1+,
SmolLM3, Hermes-style templates) renders them, the assistant's earlier calls and the tools'
results itself. A template that does not gets them as text: the tools in a system message with
the form of a call (one JSON object, ``{"name": ..., "arguments": {...}}``), the earlier calls
in that form, and each result as a user turn. Either way the retrieved texts a tool returned
stand verbatim in the prompt, so their chunks are found and reused like any passage.

The reply, by ``tool_choice``:

* ``"required"`` or a named function: the reply is held to a call (``call_schema``: a JSON
  document whose ``name`` is a tool's and whose ``arguments`` follow its ``parameters``), so
  it is always one, valid.
* ``"auto"``: the model chooses; a reply that is a call in a form models are trained to write
  (``parse_calls``: ``<tool_call>{...}</tool_call>`` blocks, or the whole reply one JSON call
  or a list of them, bare or in a code fence) naming a tool is returned as ``tool_calls``,
  anything else as text.
* ``"none"``: text, the tools still described.

Pure Python and JSON: nothing here imports torch or a web framework.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def native(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools itself."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def functions(tools: Sequence[Mapping]) -> list[dict]:
    """The ``function`` parts of OpenAI's ``tools`` (``{"type": "function", "function": {...}}``)."""
    return [dict(t["function"]) for t in tools]


def _arguments(call: Mapping) -> dict:
    """A call's arguments as a dict (OpenAI sends them as a JSON string)."""
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return {"_": args}
    return dict(args or {})


def _described(tools: Sequence[Mapping]) -> str:
    lines = [json.dumps({k: f[k] for k in ("name", "description", "parameters") if k in f}) for f in functions(tools)]
    return (
        "You can call these tools:\n"
        + "\n".join(lines)
        + '\nTo call a tool, reply with only a JSON object: {"name": <the tool\'s name>, "arguments": '
        "{<its arguments>}}. Otherwise reply normally."
    )


def messages_for(tokenizer, messages: Sequence[Mapping], tools: Sequence[Mapping] | None) -> list[dict]:
    """Chat messages (OpenAI's: ``tool_calls`` on assistant turns, ``tool`` turns with
    ``tool_call_id``) as the tokenizer's template takes them: in its own terms where it knows
    tools (arguments as dicts, each result named by its call), else as text."""
    names = {
        c.get("id"): c["function"]["name"] for m in messages for c in (m.get("tool_calls") or []) if "function" in c
    }
    knows = native(tokenizer)
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            if knows:
                fns = [{"name": c["function"]["name"], "arguments": _arguments(c["function"])} for c in calls]
                out.append(
                    {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": [{"type": "function", "function": f} for f in fns],
                    }
                )
            else:
                text = "\n".join(
                    json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"])}) for c in calls
                )
                out.append({"role": "assistant", "content": f"{content}\n{text}".strip()})
        elif role == "tool":
            name = names.get(m.get("tool_call_id")) or m.get("name") or "tool"
            if knows:
                out.append({"role": "tool", "name": name, "content": content})
            else:
                out.append({"role": "user", "content": f"Result of {name}:\n{content}"})
        else:
            out.append({"role": role, "content": content})
    if tools and not knows:
        described = _described(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def call_schema(tools: Sequence[Mapping], choice: str | Mapping) -> dict:
    """The JSON schema a reply that must be a call is held to: ``{"name", "arguments"}`` of
    one of ``tools`` (the named one, for a named ``choice``)."""
    fns = functions(tools)
    if isinstance(choice, Mapping):
        fns = [f for f in fns if f["name"] == choice["function"]["name"]]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in fns
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _as_calls(value: Any, names: set[str]) -> list[dict] | None:
    """``value`` (parsed JSON) as calls of ``names``, or None if it is not one or a list of them."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append({"name": item["name"], "arguments": json.dumps(args)})
    return calls or None


def parse_calls(text: str, tools: Sequence[Mapping]) -> tuple[str | None, list[dict]]:
    """(the reply's text outside its calls, or None; the calls ``[{"name", "arguments": JSON
    string}]``) of a reply; no calls: ``(text, [])``."""
    names = {f["name"] for f in functions(tools)}
    blocks = _BLOCK.findall(text)
    if blocks:
        calls: list[dict] = []
        for block in blocks:
            try:
                found = _as_calls(json.loads(block), names)
            except json.JSONDecodeError:
                found = None
            if found is None:
                return text, []
            calls += found
        rest = _BLOCK.sub("", text).strip()
        return rest or None, calls
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        found = _as_calls(json.loads(body), names) if body[:1] in "{[" and body else None
    except json.JSONDecodeError:
        found = None
    return (None, found) if found else (text, [])


def wire_calls(calls: Sequence[Mapping]) -> list[dict]:
    """OpenAI's ``message.tool_calls`` for parsed ``calls``."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for c in calls
    ]
