"""OpenAI tool calling over HTTP with the plain ``openai`` client, on a real ``Talaria``
(SmolLM2-135M): the model's own output becomes ``message.tool_calls`` (whole and as
``delta.tool_calls``), each ``tool_choice`` is honoured, the history's calls and tool
results are rendered for the model's template (its KV reused across the call), and bad tool
fields are typed 400s.

SmolLM2's chat template shows no tools, so the server describes them in a system message
(Hermes' words) and writes the history's calls in Hermes' ``<tool_call>`` form. Two earlier
turns in the history (each a call, its result and an answer) make the 135M model write a
well-formed call for a new city with greedy decoding; ``required`` and a named function
decode the answer under the call's grammar (the tools' names and argument schemas)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from talaria.api import TalariaConfig
from talaria.server.app import app_for_config
from talaria.session.gaps import GapPredictor
from tests.server.conftest import requires_smollm2, sse
from tests.server.server_fakes import live_server

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SHELL = {"type": "function", "function": {"name": "run_shell", "description": "Run a command"}}

pytestmark = requires_smollm2


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = TalariaConfig(
        models=(MODEL,), device_memory_bytes=10**9, host_memory_bytes=10**9, shutdown_grace_s=5.0
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_server_live: shared cores
    try:
        with live_server(app_for_config(config)) as base:
            yield base
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def turn(city: str, weather: str, call_id: str) -> list[dict[str, Any]]:
    """One earlier turn: the question, the model's call, the tool's result, the answer."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"weather": weather})},
        {"role": "assistant", "content": f"It is {weather} in {city}."},
    ]


def ask(city: str) -> list[dict[str, Any]]:
    history = turn("Rome", "sunny", "call_1") + turn("Oslo", "rainy", "call_2")
    return [*history, {"role": "user", "content": f"What is the weather in {city}?"}]


def arguments(call: Any) -> Any:
    return json.loads(call.function.arguments)


def create(client: openai.OpenAI, messages: list[dict[str, Any]], **fields: Any) -> Any:
    """One greedy chat call (40 tokens unless said) with ``get_weather`` and ``run_shell``
    unless ``tools`` says otherwise."""
    fields = {"tools": [WEATHER, SHELL], "temperature": 0, "max_tokens": 40, **fields}
    return client.chat.completions.create(model=MODEL, messages=messages, **fields)


def test_the_models_call_comes_back_as_tool_calls(client: openai.OpenAI) -> None:
    r = create(client, ask("Paris"), extra_headers={"X-Session-ID": "tools-auto"})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    assert arguments(calls[0]) == {"city": "Paris"}
    assert calls[0].id.startswith("call_") and calls[0].type == "function"

    # the tool's result goes back; the server renders the call and the result for the
    # template, and the prompt the model computed (its own call included) is reused
    follow = [
        *ask("Paris"),
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"weather": "cloudy"}'},
    ]
    after = create(client, follow, max_tokens=12, extra_headers={"X-Session-ID": "tools-auto"})
    assert r.usage is not None and after.usage is not None
    cached = after.usage.prompt_tokens_details.cached_tokens
    assert cached >= r.usage.prompt_tokens - 16, (cached, r.usage.prompt_tokens)  # a block
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # special tokens are kept for the parser (markers may be special), never the end token
    assert "<|im_end|>" not in (after.choices[0].message.content or "")


def test_streamed_tool_calls_arrive_whole_in_delta_tool_calls(client: openai.OpenAI) -> None:
    stream = create(client, ask("Paris"), stream=True)
    deltas: list[Any] = []
    finish: list[str] = []
    content: list[str] = []
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            content.append(c.delta.content or "")
            if c.finish_reason:
                finish.append(c.finish_reason)
    assert finish == ["tool_calls"] and "".join(content) == ""
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}  # whole, valid JSON


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_required_and_named_choices_force_a_call(client: openai.OpenAI, choice: Any) -> None:
    """The server opens the call (with one tool, ``required`` names it too) and ends the
    answer at its closing tag; the model writes the arguments."""
    r = create(client, ask("Lima"), tools=[WEATHER], tool_choice=choice)
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert arguments(calls[0]) == {"city": "Lima"} and not r.choices[0].message.content


def test_tool_choice_none_and_parallel_false(client: openai.OpenAI) -> None:
    prose = create(client, ask("Paris"), tools=[WEATHER], tool_choice="none", max_tokens=24)
    assert not prose.choices[0].message.tool_calls
    assert prose.choices[0].finish_reason in ("stop", "length")
    one = create(client, ask("Paris"), parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls or []) == 1


def test_a_required_call_the_model_cannot_finish_is_a_typed_error(url: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Lima?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 2,
    }
    with httpx.Client(base_url=url, timeout=120) as http:
        r = http.post(CHAT, json=body)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "tool_call_failed" and "max_tokens" in error["message"]
        streamed = http.post(CHAT, json={**body, "stream": True})
        events = sse(streamed)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "tool_call_failed"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "letters"),
        ({"tools": [WEATHER, WEATHER]}, "two tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "not in tools",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice must be"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
                    },
                    {"role": "user", "content": "hi"},
                ]
            },
            "not valid JSON",
        ),
    ],
)
def test_bad_tool_fields_are_400s(url: str, fields: dict[str, Any], words: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post(CHAT, json=body)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"]
        assert http.get("/health?integrity=true").json()["integrity"] == "ok"


def test_an_answer_ending_in_a_call_names_the_gap_the_server_learns(
    url: str, client: openai.OpenAI
) -> None:
    """No hint from the client: the answer's call of a tool no other test calls
    (``lookup_weather``) opens a gap, the session's next call closes it, and the server
    learns it under the tool's name (``/metrics``)."""
    tool = {"type": "function", "function": {**WEATHER["function"], "name": "lookup_weather"}}
    key = GapPredictor.key_for("lookup_weather")
    line = f'talaria_tool_gap_expected_seconds{{tool="{key}"}}'
    sid = {"X-Session-ID": "gap-named"}
    messages = ask("Lima")
    r = create(client, messages, tools=[tool], tool_choice="required", extra_headers=sid)
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "lookup_weather"
    assert line not in httpx.get(url + "/metrics").text
    time.sleep(0.3)  # the tool runs
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"weather": "misty"})},
    ]
    create(client, messages, tools=[tool], max_tokens=4, extra_headers=sid)
    learned = [x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith(line)]
    assert len(learned) == 1 and float(learned[0].split()[-1]) > 0


def test_response_format_json_schema_constrains_the_answer(client: openai.OpenAI) -> None:
    """``response_format`` ``json_schema`` decodes under the schema (no prompting): the
    answer parses and validates, whole and streamed alike; ``json_object`` opens an object."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    messages = [{"role": "user", "content": "Is it sunny in Lima? Answer in JSON."}]
    whole = create(client, messages, tools=None, response_format=fmt, max_tokens=60)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    stream = create(client, messages, tools=None, response_format=fmt, max_tokens=60, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    obj = create(client, messages, tools=None, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")  # an object (whole if it fits)
