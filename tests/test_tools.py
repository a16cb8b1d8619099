"""Tools (function calling, tools.py): the request's shapes and their one-line errors, the grammar
each tool_choice makes, reading a model's Hermes blocks back into OpenAI's tool_calls, and the
chat template given the tools and a conversation's calls and results."""

from __future__ import annotations

import json

import pytest

from specdec import GenerationConfig
from specdec.errors import FieldError
from specdec.models.chat import render
from specdec.tools import check_choice, check_tools, grammar, held_back, history, parse

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tool_choice_words():
    tools = check_tools([WEATHER, TIME])
    assert check_choice(None, tools) == "auto" and check_choice(None, []) == "none"
    assert check_choice("required", tools) == "required"
    assert check_choice({"type": "function", "function": {"name": "get_time"}}, tools) == "get_time"


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ("get_weather", None, "tools must be a list"),
        ([{"type": "code_interpreter"}], None, "must be"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "letters, digits"),
        ([WEATHER, WEATHER], None, "given twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "JSON Schema object"),
        ([WEATHER], "sometimes", "tool_choice must be none, auto, required"),
        ([], "required", "needs tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        ([WEATHER], {"function": "get_weather"}, "tool_choice must be a word or"),
    ],
)
def test_bad_tools_are_one_line_field_errors(tools, choice, message):
    with pytest.raises(FieldError, match=message) as e:
        GenerationConfig(tools=tools, tool_choice=choice)
    assert "\n" not in str(e.value) and e.value.param in ("tools", "tool_choice")


def test_tools_and_a_response_format_are_not_both_given():
    with pytest.raises(FieldError, match="not both"):
        GenerationConfig(tools=[WEATHER], response_format={"type": "json_object"})
    cfg = GenerationConfig(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"})
    assert cfg.template_tools is None and cfg.constraint.kind == "json_schema"


def test_each_tool_choice_makes_its_grammar():
    tools = [WEATHER, TIME]
    assert grammar(tools, "none") is None
    auto = grammar(tools, "auto").text
    assert auto.startswith("start: TEXT | TEXT? calls") and "get_time" in auto
    required = grammar(tools, "required", parallel=False).text
    assert required.startswith("start: calls") and "calls: call\n" in required and "anyOf" in required
    named = grammar(tools, "get_weather").text
    assert '"const": "get_weather"' in named and "get_time" not in named
    assert 'call ("\\n" call)*' in grammar(tools, "required").text  # parallel: several calls


def test_calls_are_read_back_and_malformed_ones_stay_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    cut = '<tool_call>\n{"name": "get_weather", "argum'  # cut by max_tokens
    assert parse(cut) == (cut, [])
    assert parse("no calls here") == ("no calls here", [])


@pytest.mark.parametrize(
    "text, held", [("Hello", 0), ("Hello <tool", 5), ("Hi <tool_call>\n{", 13), ("a <", 1), ("<tool_call", 10)]
)
def test_streamed_text_is_held_back_from_a_calls_opening(text, held):
    assert held_back(text) == held


def test_the_template_renders_the_tools_and_a_conversation_of_calls_and_results():
    """Qwen2.5's own template (as its GGUF holds it, in part): tools in the system turn, the
    assistant's call with its arguments as an object, the tool's result as a tool_response."""
    template = (
        "{%- if tools %}<tools>{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}</tools>{%- endif %}"
        "{%- for m in messages %}{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
        "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{%- endfor %}"
        "{%- elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
        "{%- else %}<{{ m.role }}>{{ m.content }}{%- endif %}{%- endfor %}<assistant>"
    )
    turns = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "content": "4 C, rain", "tool_call_id": "c1"},
    ]
    out = render(template, history(turns), tools=[WEATHER])
    assert '"name": "get_weather"' in out.split("</tools>")[0]
    assert '<tool_call>get_weather {"city": "Oslo"}</tool_call>' in out  # an object, not a string of JSON
    assert out.endswith("<tool_response>4 C, rain</tool_response><assistant>")
