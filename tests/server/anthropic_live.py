"""The live server of the Anthropic Messages API tests (SmolLM2-135M on CPU, greedy), the
in-process API they compare it with, and their helpers: bodies, SSE parsing, Anthropic's
error shape, the integrity check, a tool-using conversation in both APIs' shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
import torch

from talaria.api import SyncTalaria, TalariaConfig
from talaria.server.app import app_for_config
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


def plain(**fields: Any) -> dict[str, Any]:
    """A greedy Messages body asking QUESTION after SYSTEM (``fields`` override)."""
    body = {
        "model": MODEL,
        "max_tokens": 24,
        "temperature": 0,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    return {**body, **fields}


def prompt_of(r: httpx.Response) -> int:
    usage = r.json()["usage"]
    return int(usage["input_tokens"] + usage["cache_read_input_tokens"])
