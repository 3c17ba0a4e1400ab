"""A chat request's tools (``talaria.api.tool_choice``): checks with typed errors, the plan
of each ``tool_choice``, the conversation as the template sees it, and reading an answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from talaria.api.tool_choice import (
    AnswerReader,
    Choice,
    call_grammar,
    plan_tools,
    render_messages,
)
from talaria.api.tool_parsers import Piece, ToolFormat
from talaria.errors import BadRequest, ToolCallFailed

H = ToolFormat.HERMES
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SHELL = {"type": "function", "function": {"name": "run_shell"}}
NAMED = {"type": "function", "function": {"name": "run_shell"}}
SMOLLM2 = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{% endfor %}"
QWEN = "{% if tools %}{{ tools }}{% endif %}{% if message.tool_calls %}<tool_call>{% endif %}"


def test_plans_for_each_tool_choice() -> None:
    auto = plan_tools([WEATHER, SHELL], None, None, H)
    assert auto is not None and auto.choice is Choice.AUTO and auto.grammar is None
    assert auto.names == {"get_weather", "run_shell"} and auto.max_calls is None
    assert plan_tools([WEATHER], "none", None, H) is None
    assert plan_tools(None, None, None, H) is None
    assert plan_tools([], "auto", None, H) is None
    required = plan_tools([WEATHER, SHELL], "required", False, H)
    assert required is not None and required.max_calls == 1
    assert required.grammar == call_grammar(H, [WEATHER, SHELL])
    lark = required.grammar.source
    assert lark.startswith('start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {"anyOf"')
    named = plan_tools([WEATHER, SHELL], NAMED, None, ToolFormat.LLAMA3_JSON)
    assert named is not None and named.choice is Choice.NAMED and named.forced == "run_shell"
    assert named.grammar == call_grammar(ToolFormat.LLAMA3_JSON, [SHELL])
    assert named.grammar.source.startswith('start: "" call ""\ncall: %json {"type": "object"')
    assert '"parameters": {"type": "object"}' in named.grammar.source  # SHELL has no schema


def test_a_schema_the_grammar_library_refuses_constrains_to_any_object() -> None:
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "nonsense"}}}
    plan = plan_tools([odd], "required", None, H)
    assert plan is not None and plan.grammar == call_grammar(H, [odd], loose=True)


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "words"),
    [
        ("get_weather", None, None, "must be a list"),
        ([{"type": "retrieval"}], None, None, "type 'function'"),
        ([{"type": "function"}], None, None, "function must be an object"),
        ([{"type": "function", "function": {"name": "has space"}}], None, None, "letters"),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, None, "1 to 64"),
        ([SHELL, SHELL], None, None, "two tools are named"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, None, "schema"),
        ([SHELL] * 129, None, None, "at most 128"),
        ([WEATHER], "sometimes", None, "tool_choice must be"),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}, None, "not in tools"),
        (None, "required", None, "needs tools"),
        ([WEATHER], "auto", "yes", "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_are_typed_errors(
    tools: Any, choice: Any, parallel: Any, words: str
) -> None:
    with pytest.raises(BadRequest, match=words):
        plan_tools(tools, choice, parallel, H)


def history() -> list[dict[str, Any]]:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    return [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


def test_template_without_tools_gets_them_described_and_calls_written_as_text() -> None:
    messages = history()
    out = render_messages(messages, SMOLLM2, H, [WEATHER])
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert json.dumps(WEATHER) in out[0]["content"]
    assert "<tool_call>\n" in out[0]["content"]  # how to call, in the model's format
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert messages == history()  # not mutated
    with_system = render_messages(
        [{"role": "system", "content": "Be brief."}, *messages], SMOLLM2, H, [WEATHER]
    )
    assert with_system[0]["content"].startswith("Be brief.\n\nYou are a function calling")
    assert len(with_system) == 4


def test_template_with_tools_renders_them_itself() -> None:
    out = render_messages(history(), QWEN, H, [WEATHER])
    assert len(out) == 3 and out[1]["content"] is None  # no preamble, no text calls
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}  # an object
    assert render_messages(history(), SMOLLM2, H, None)[0]["role"] == "user"  # no tools shown


@pytest.mark.parametrize(
    ("calls", "words"),
    [
        ("c1", "must be a list"),
        ([{"function": {"arguments": "{}"}}], "must be"),
        ([{"function": {"name": "f", "arguments": "{oops"}}], "not valid JSON"),
        ([{"function": {"name": "f", "arguments": "[1]"}}], "must be a JSON object"),
    ],
)
def test_bad_history_calls_are_typed_errors(calls: Any, words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        render_messages([{"role": "assistant", "tool_calls": calls}], SMOLLM2, H, None)


def test_answer_reader_finish_reasons() -> None:
    auto = plan_tools([WEATHER], "auto", None, H)
    reader = AnswerReader(auto)
    first = reader.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert first == Piece()
    rest, reason = reader.finish("stop")
    assert reason == "tool_calls" and [c.name for c in rest.calls] == ["get_weather"]
    prose = AnswerReader(auto)
    assert prose.feed("It rains.") == Piece("It rains.")
    assert prose.finish("length") == (Piece(), "length")
    plain = AnswerReader(None)
    assert plain.feed("<tool_call>x") == Piece("<tool_call>x") and plain.finish("stop")[1] == "stop"


def test_required_call_not_made_is_a_typed_error() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = plan_tools([WEATHER], choice, None, H)
    reader = AnswerReader(named)
    reader.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": ')
    with pytest.raises(ToolCallFailed, match="cut off by max_tokens"):
        reader.finish("length")
    made = AnswerReader(named)
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    piece = made.feed(whole)  # whole once its closing tag came
    assert made.finish("stop") == (Piece(), "tool_calls")
    assert json.loads(piece.calls[0].arguments) == {"city": "Oslo"} and made.calls_made == 1
