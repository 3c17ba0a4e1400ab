"""Reading tool calls out of a model's answer (``talaria.api.tool_parsers``): each format,
whole and streamed (any split of the text gives the same content and calls), and what is
not a call staying content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.api.tool_parsers import (
    Piece,
    ToolCallStream,
    ToolFormat,
    format_for_template,
    parse,
    render_calls,
)
from tests.helpers import examples

NAMES = ("get_weather", "run_shell")
H = ToolFormat.HERMES


def calls_of(piece: Piece) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, json.loads(c.arguments)) for c in piece.calls]


def streamed(fmt: ToolFormat, parts: list[str], **kw: object) -> Piece:
    stream = ToolCallStream(fmt, NAMES, **kw)  # type: ignore[arg-type]
    pieces = [stream.feed(p) for p in parts] + [stream.finish()]
    return Piece("".join(p.content for p in pieces), tuple(c for p in pieces for c in p.calls))


def test_hermes_blocks_among_text() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "run_shell", "arguments": "{\\"command\\": \\"ls\\"}"}'
        "</tool_call>"
    )
    piece = parse(H, text, NAMES)
    assert piece.content == "Let me check."  # trailing whitespace goes with the calls
    assert calls_of(piece) == [("get_weather", {"city": "Paris"}), ("run_shell", {"command": "ls"})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in piece.calls)
    assert piece.calls[0].arguments == '{"city": "Paris"}'  # compact JSON text of an object


@pytest.mark.parametrize("end", ["\n", "\n</tool", "</"])
def test_hermes_last_block_without_closing_tag(end: str) -> None:
    text = '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls"}}' + end
    piece = parse(H, text, NAMES)
    assert piece.content == "" and calls_of(piece) == [("run_shell", {"command": "ls"})]


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',  # not a tool
        '<tool_call>{"name": "run_shell", "arguments": [1]}</tool_call>',  # not an object
        '<tool_call>{"city": "Paris", "weather": "sunny"}</tool_call>',  # no name
        '<tool_call>{"name": "run_shell", "arguments": {"command": "ls"}} and more</tool_call>',
        "<tool_call>{not json}</tool_call>",
        '<tool_call>\n{"city": "Berlin", "weather": "sunny, 24 C"}',  # cut short, no name
    ],
)
def test_what_is_not_a_call_stays_content(block: str) -> None:
    piece = parse(H, f"Sure. {block}", NAMES)
    assert piece.calls == () and piece.content == f"Sure. {block}"


def test_llama3_json_whole_answer_and_semicolons() -> None:
    fmt = ToolFormat.LLAMA3_JSON
    one = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert calls_of(parse(fmt, one, NAMES)) == [("get_weather", {"city": "Oslo"})]
    two = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "run_shell", "parameters": {"command": "pwd"}}'  # noqa: E501
    piece = parse(fmt, "  " + two, NAMES)
    assert piece.content == "" and [n for n, _ in calls_of(piece)] == ["get_weather", "run_shell"]
    prose = 'The answer is {"name": "get_weather", "parameters": {}}'
    assert parse(fmt, prose, NAMES) == Piece(prose)  # a call must be the whole answer


def test_mistral_and_json_formats() -> None:
    mistral = 'Calling.[TOOL_CALLS][{"name": "run_shell", "arguments": {"command": "ls"}}]'
    piece = parse(ToolFormat.MISTRAL, mistral, NAMES)
    assert piece.content == "Calling." and calls_of(piece) == [("run_shell", {"command": "ls"})]
    fenced = '```json\n[{"name": "run_shell", "arguments": {}}, {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]\n```'  # noqa: E501
    assert calls_of(parse(ToolFormat.JSON, fenced, NAMES)) == [
        ("run_shell", {}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert parse(ToolFormat.JSON, "no call here", NAMES) == Piece("no call here")


def test_stream_holds_back_only_what_may_start_a_call() -> None:
    stream = ToolCallStream(H, NAMES)
    assert stream.feed("Checking <tool") == Piece("Checking")  # the space waits for more
    assert stream.feed("kit>") == Piece(" <toolkit>")  # not a marker after all
    assert stream.feed('<tool_call>{"name": "run_shell", ') == Piece()
    piece = stream.feed('"arguments": {"command": "ls"}}</tool_call>')
    assert piece.content == "" and calls_of(piece) == [("run_shell", {"command": "ls"})]
    assert stream.calls_made == 1
    assert stream.finish() == Piece()
    with pytest.raises(ValueError):
        stream.feed("late")


def test_whitespace_around_calls_is_dropped_but_kept_without_calls() -> None:
    call = '<tool_call>{"name": "run_shell", "arguments": {}}</tool_call>'
    assert streamed(H, ["\n", call, "\n\n"]).content == ""
    assert streamed(H, ["\n", "  "]).content == "\n  "
    assert streamed(H, ["a", "\n", "b"]).content == "a\nb"


@pytest.mark.parametrize("fmt", [ToolFormat.LLAMA3_JSON, ToolFormat.JSON])
def test_an_answer_opening_like_a_call_keeps_its_leading_whitespace_when_none_parses(
    fmt: ToolFormat,
) -> None:
    """Found by the search profile: `` {`` lost its space, read as a call that did not parse.
    A call that parses still drops it."""
    assert parse(fmt, " {", NAMES) == Piece(" {")
    assert streamed(fmt, ["\n ", "{not json", "}"]).content == "\n {not json}"
    good = parse(fmt, ' \n{"name": "run_shell", "arguments": {"command": "ls"}}', NAMES)
    assert good.content == "" and calls_of(good) == [("run_shell", {"command": "ls"})]


def test_max_calls_keeps_the_first() -> None:
    call = '<tool_call>{"name": "run_shell", "arguments": {"command": "%s"}}</tool_call>'
    stream = ToolCallStream(H, NAMES, max_calls=1)
    first = stream.feed(call % "ls" + call % "pwd")
    assert calls_of(first) == [("run_shell", {"command": "ls"})] and first.content == ""
    assert stream.calls_dropped == 1


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_render_calls_reads_back(fmt: ToolFormat) -> None:
    calls = [("get_weather", {"city": "Rome"}), ("run_shell", {"command": "ls -l"})]
    if fmt is ToolFormat.JSON:
        one = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
        assert render_calls(fmt, calls[:1]) == one
    assert calls_of(parse(fmt, render_calls(fmt, calls), NAMES)) == calls


def test_hermes_rendering_is_what_the_model_writes() -> None:
    """The history's calls are written exactly as Hermes-style models write them, so the
    next prompt repeats the model's own tokens (its KV is reused)."""
    assert render_calls(H, [("get_weather", {"city": "Rome"})]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )


def test_format_for_template() -> None:
    qwen = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n"
    llama = "{%- if tools %}<|start_header_id|>ipython<|end_header_id|>{% endif %}"
    assert format_for_template(qwen) is ToolFormat.HERMES
    assert format_for_template(llama) is ToolFormat.LLAMA3_JSON
    assert format_for_template("{{ tools }}[TOOL_CALLS]") is ToolFormat.MISTRAL
    assert format_for_template("{% if tools %}{{ tools | tojson }}{% endif %}") is ToolFormat.JSON
    assert format_for_template("{{ messages }}") is ToolFormat.HERMES  # Talaria shows the tools
    assert format_for_template(None) is ToolFormat.HERMES


_ANSWERS = st.sampled_from(
    [
        'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call> then <tool_call>{bad}</tool_call> done <tool_",
        '<tool_call>{"name": "run_shell", "arguments": {"command": "echo <tool_call>"}}'
        "</tool_call>",
        "plain prose, no call at all",
        "",
    ]
)


@settings(max_examples=examples(200), deadline=None)
@given(text=_ANSWERS, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_any_split_of_the_stream_reads_the_same(text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    parts = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    whole = parse(H, text, NAMES)
    split = streamed(H, parts)
    assert split.content == whole.content
    assert [(c.name, c.arguments) for c in split.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]


@settings(max_examples=examples(300), deadline=None)
@given(text=st.text(max_size=60), fmt=st.sampled_from(list(ToolFormat)))
def test_arbitrary_text_never_raises_and_loses_nothing(text: str, fmt: ToolFormat) -> None:
    piece = parse(fmt, text, NAMES)
    if not piece.calls:
        assert piece.content == text
