"""How a Messages API body becomes the chat the in-process API runs
(``talaria.server.anthropic_requests``): system prompts, blocks, tool calls and results,
tools and tool_choice, and the fields accepted and ignored. Pure: no server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from talaria.generation import SamplingParams
from talaria.server.anthropic_requests import CountTokensRequest, MessagesRequest
from talaria.server.errors import HttpError

USE = {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo"}}


def parse(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 5, **fields}
    request = MessagesRequest.model_validate_json(json.dumps(body))
    request.check()
    return request


def test_a_claude_code_conversation_becomes_chat_messages() -> None:
    cached = {"type": "ephemeral"}
    request = parse(
        system=[
            {"type": "text", "text": "You are Claude Code.", "cache_control": cached},
            {"type": "text", "text": "Be brief."},
        ],
        messages=[
            {"role": "system", "content": "Reminder: use tools."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Weather?", "cache_control": cached}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    USE,
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_a",
                        "is_error": True,
                        "content": [{"type": "text", "text": "timeout"}],
                    },
                    {"type": "text", "text": "Try again."},
                    {"type": "text", "text": "Please."},
                ],
            },
        ],
        thinking={"type": "enabled", "budget_tokens": 1024},
        context_management={"edits": []},
        output_config={"effort": "high"},
        cache_control=cached,
        metadata={"user_id": "u"},
    )
    call = {
        "id": "toolu_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})},
    }
    assert request.chat_messages() == [
        {"role": "system", "content": "You are Claude Code.\n\nBe brief."},
        {"role": "system", "content": "Reminder: use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_a", "content": "Error: timeout"},
        {"role": "user", "content": "Try again.\n\nPlease."},
    ]
    assert request.unknown_fields() == []
    assert request.sampling_params() == SamplingParams(max_tokens=5)


@pytest.mark.parametrize(
    ("choice", "openai", "parallel"),
    [
        (None, "auto", None),
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "none"}, "none", None),
        (
            {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            {"type": "function", "function": {"name": "get_weather"}},
            False,
        ),
    ],
)
def test_tools_and_tool_choice_become_openais(
    choice: dict[str, Any] | None, openai: Any, parallel: bool | None
) -> None:
    tool = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}
    bare = {"name": "now", "cache_control": {"type": "ephemeral"}}
    fields: dict[str, Any] = {"tools": [tool, bare], "messages": [{"role": "user", "content": "x"}]}
    if choice is not None:
        fields["tool_choice"] = choice
    request = parse(**fields)
    tools, got = request.chat_tools()
    assert tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather",
                "parameters": {"type": "object"},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "now",
                "description": "",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]
    assert got == openai and request.parallel_tool_calls() is parallel


def test_no_tools_no_tool_choice() -> None:
    request = parse(messages=[{"role": "user", "content": "x"}], stop_sequences=["END"])
    assert request.chat_tools() == (None, None)
    assert request.sampling_params().stop == ("END",)


def test_a_tool_result_before_its_tool_use_is_a_400() -> None:
    result = {"type": "tool_result", "tool_use_id": "toolu_a", "content": "4"}
    request = parse(
        messages=[
            {"role": "user", "content": [result]},
            {"role": "assistant", "content": [USE]},
        ]
    )
    with pytest.raises(HttpError) as caught:
        request.chat_messages()
    assert caught.value.status == 400 and "toolu_a" in caught.value.message


def test_count_tokens_takes_no_max_tokens_and_lists_unknown_fields() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "speed": "fast"}
    request = CountTokensRequest.model_validate_json(json.dumps(body))
    assert request.unknown_fields() == ["speed"]
    assert request.chat_messages() == [{"role": "user", "content": "x"}]
