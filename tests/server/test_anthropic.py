"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on a
real ``Talaria`` (SmolLM2-135M on CPU, greedy), through the official ``anthropic`` client
and raw HTTP: each answer, whole and streamed, equals the in-process API's answer to the
same conversation; tool calls and results; exact token counts; ``max_tokens`` clamped to the
context; every bad input a typed error in Anthropic's shape with the server intact after it.
Mid-stream failures and overload run over the fake API (``server_fakes``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
import torch

from talaria.api import SyncTalaria, TalariaConfig
from talaria.errors import ContextTooLong
from talaria.server.app import app_for_config
from tests.server.conftest import requires_smollm2
from tests.server.server_fakes import live_server

MODEL = "smollm2-135m"
KEY = "anthropic-test-key"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
SYSTEM = "You are a helpful assistant."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SHELL_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}
TOOLS = [
    {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "input_schema": SCHEMA,
    },
    {"name": "run_shell", "description": "Run a command", "input_schema": SHELL_SCHEMA},
]
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": t["name"],
            "description": t["description"],
            "parameters": t["input_schema"],
        },
    }
    for t in TOOLS
]


def config(strict: bool = False) -> TalariaConfig:
    return TalariaConfig(
        models=(MODEL,),
        device_memory_bytes=10**9,
        host_memory_bytes=10**9,
        dtype="float32",
        api_keys=(KEY,),
        shutdown_grace_s=5.0,
        strict_max_tokens=strict,
    )


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_server_live: shared cores
    try:
        with live_server(app_for_config(config(), max_body_bytes=256 * 1024)) as base:
            yield base
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def api() -> Iterator[SyncTalaria]:
    """The in-process API on the same model and memory, strict about max_tokens."""
    with SyncTalaria(config(strict=True)) as t:
        yield t


@pytest.fixture(scope="module")
def claude(url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=300, headers={"x-api-key": KEY}) as c:
        yield c


def events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event; the name must equal the data's type."""
    out: list[tuple[str, dict[str, Any]]] = []
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert name == data["type"], (name, data)
            out.append((name, data))
            name = None
        else:
            assert line == "", line
    return out


def assert_error(r: httpx.Response, status: int, kind: str, words: list[str]) -> None:
    """An error in Anthropic's shape: status, ``error.type``, words of the message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind, body
    for word in words:
        assert word in body["error"]["message"], (word, body)


def assert_healthy(http: httpx.Client) -> None:
    r = http.get("/health", params={"integrity": "true"})
    assert r.status_code == 200 and r.json()["integrity"] == "ok", r.text


def weather_turn(city: str, weather: str, call_id: str) -> list[dict[str, Any]]:
    """An earlier turn in Anthropic's shape: question, tool_use, tool_result, answer."""
    use = {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": city}}
    result = {
        "type": "tool_result",
        "tool_use_id": call_id,
        "content": json.dumps({"weather": weather}),
    }
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
        {"role": "assistant", "content": f"It is {weather} in {city}."},
    ]


def openai_turn(city: str, weather: str, call_id: str) -> list[dict[str, Any]]:
    """The same turn as the chat messages the in-process API takes."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return [
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"weather": weather})},
        {"role": "assistant", "content": f"It is {weather} in {city}."},
    ]


def weather_question(city: str) -> list[dict[str, Any]]:
    history = weather_turn("Rome", "sunny", "toolu_01") + weather_turn("Oslo", "rainy", "toolu_02")
    return [*history, {"role": "user", "content": f"What is the weather in {city}?"}]


def openai_question(city: str) -> list[dict[str, Any]]:
    history = openai_turn("Rome", "sunny", "toolu_01") + openai_turn("Oslo", "rainy", "toolu_02")
    return [*history, {"role": "user", "content": f"What is the weather in {city}?"}]


def answer_of(message: Any) -> dict[str, Any]:
    """A message (the SDK's) as plain data without its id."""
    out = message.model_dump(exclude_none=False)
    out.pop("id")
    return out


@requires_smollm2
def test_whole_and_streamed_answers_equal_the_api(
    claude: anthropic.Anthropic, api: SyncTalaria
) -> None:
    # this SDK has no temperature argument any more: it travels in extra_body
    asked = {"model": MODEL, "max_tokens": 24, "system": SYSTEM, "extra_body": GREEDY}
    question = [{"role": "user", "content": QUESTION}]
    whole = claude.messages.create(messages=question, **asked)  # type: ignore[call-overload]
    ref = api.chat(
        [{"role": "system", "content": SYSTEM}, *question], MODEL, max_tokens=24, temperature=0
    )
    assert ref.text == "The capital of France is Paris." and ref.finish_reason == "stop"
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL
    assert [b.model_dump() for b in whole.content] == [
        {"type": "text", "text": ref.text, "citations": None}
    ]
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    usage = whole.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == ref.usage.prompt_tokens
    assert usage.output_tokens == ref.usage.completion_tokens == 8
    assert usage.cache_creation_input_tokens == 0

    with claude.messages.stream(messages=question, **asked) as stream:  # type: ignore[arg-type]
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == ref.text
    assert final.id.startswith("msg_") and final.id != whole.id
    same = answer_of(whole), answer_of(final)
    for a in same:  # the second call reads the first one's prompt from the prefix cache
        a["usage"] = a["usage"]["input_tokens"] + a["usage"]["cache_read_input_tokens"]
    assert same[0] == same[1]


@requires_smollm2
def test_the_stream_has_anthropics_events_in_order(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    with http.stream("POST", MESSAGES + "?beta=true", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = events(r)
    names = [name for name, _ in got]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6)
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = got[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    assert got[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in got[3:-3])
    delta = got[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3
    total = delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"]
    assert total == start["usage"]["input_tokens"]


@requires_smollm2
def test_a_stop_sequence_ends_the_answer(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(
        model=MODEL,
        max_tokens=24,
        extra_body=GREEDY,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        stop_sequences=["never", " Paris"],
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == " Paris"
    assert [b.model_dump()["text"] for b in r.content] == ["The capital of France is"]
