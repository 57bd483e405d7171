"""Tool calls (``kvrag.serve.tools``): the prompt a template with and without tool support
gets, the schema a required call is held to, and the call forms read from a free reply."""

import copy
import json

import pytest

from kvrag.layout.prompt import render_messages
from kvrag.serve.tools import call_schema, messages_for, native, parse_calls
from kvrag.testing import smollm2_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
    },
    {"type": "function", "function": {"name": "count", "description": "Count things"}},
]
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where does the fox live?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "fox"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "The red fox lives in the northern forest."},
]
# A template that renders tools and tool turns itself, as Qwen's and Llama's do.
NATIVE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}{% if m.role == 'tool' %} ({{ m.name }}){% endif %}{% endfor %}"
    "<assistant>"
)


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_a_template_without_tools_gets_them_as_text_and_the_result_verbatim(tok):
    assert not native(tok)
    prompt = render_messages(tok, messages_for(tok, TURNS, TOOLS))
    assert "Be brief." in prompt and '"name": "search"' in prompt and "Count things" in prompt
    assert '{"name": "search", "arguments": {"q": "fox"}}' in prompt  # the earlier call, as the form asked for
    assert "Result of search:\nThe red fox lives in the northern forest." in prompt


def test_a_template_with_tools_renders_them_in_its_own_terms(tok):
    own = copy.deepcopy(tok)
    own.chat_template = NATIVE
    assert native(own)
    prompt = render_messages(own, messages_for(own, TURNS, TOOLS), TOOLS)
    assert prompt.startswith("TOOLS:search;count;<system>Be brief.")
    assert 'CALL search {"q": "fox"}' in prompt  # arguments handed over as a dict
    assert "<tool>The red fox lives in the northern forest. (search)" in prompt
    assert "You can call" not in prompt


def test_a_required_call_is_one_of_the_tools_and_a_named_one_that_one():
    either = call_schema(TOOLS, "required")
    assert [o["properties"]["name"]["const"] for o in either["anyOf"]] == ["search", "count"]
    assert either["anyOf"][0]["properties"]["arguments"] == TOOLS[0]["function"]["parameters"]
    named = call_schema(TOOLS, {"type": "function", "function": {"name": "count"}})
    assert named["properties"]["name"] == {"const": "count"} and named["properties"]["arguments"] == {"type": "object"}


@pytest.mark.parametrize(
    "reply,content,calls",
    [
        ('{"name": "search", "arguments": {"q": "x"}}', None, [("search", {"q": "x"})]),
        ('```json\n{"name": "count", "parameters": {}}\n```', None, [("count", {})]),
        (
            '[{"name": "search", "arguments": "{\\"q\\": 1}"}, {"name": "count", "arguments": {}}]',
            None,
            [("search", {"q": 1}), ("count", {})],
        ),
        (
            'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "y"}}\n</tool_call>',
            "Let me look.",
            [("search", {"q": "y"})],
        ),
        ('<tool_call>{"name": "search", "arguments": {}}', None, [("search", {})]),  # cut at the budget's end
        ('{"name": "delete_all", "arguments": {}}', '{"name": "delete_all", "arguments": {}}', []),  # not a tool
        ("The fox lives in the forest.", "The fox lives in the forest.", []),
        (
            '<tool_call>{"name": "search", "arguments": </tool_call>',
            '<tool_call>{"name": "search", "arguments": </tool_call>',
            [],
        ),
    ],
)
def test_calls_are_read_in_the_forms_models_write_them(reply, content, calls):
    got_content, got = parse_calls(reply, TOOLS)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
