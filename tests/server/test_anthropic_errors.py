"""Bad input to the Anthropic Messages API: each a typed error in Anthropic's shape (the
right status and ``error.type``, a message naming what to change), with the server's state
intact afterwards (``GET /health?integrity=true``); auth and body errors under
``/v1/messages`` in Anthropic's shape, OpenAI's elsewhere; failures before and during a
stream over the fake API (``server_fakes``). The live server is ``anthropic_live``'s."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from tests.server.anthropic_live import (
    COUNT,
    KEY,
    MESSAGES,
    MODEL,
    TOOLS,
    assert_error,
    assert_healthy,
    events,
    http,
    plain,
    url,
)
from tests.server.conftest import requires_smollm2
from tests.server.server_fakes import SECRET

__all__ = ["http", "url"]  # the live fixtures these tests take

BAD: list[tuple[str, dict[str, Any], int, str, list[str]]] = [
    ("no max_tokens", {"max_tokens": None}, 400, "invalid_request_error", ["max_tokens"]),
    ("zero max_tokens", {"max_tokens": 0}, 400, "invalid_request_error", ["max_tokens"]),
    ("hot", {"temperature": 1.5}, 400, "invalid_request_error", ["temperature"]),
    ("unknown model", {"model": "gpt-9"}, 404, "not_found_error", ["gpt-9", MODEL]),
    ("no messages", {"messages": []}, 400, "invalid_request_error", ["messages"]),
    (
        "tool role",
        {"messages": [{"role": "tool", "content": "x"}]},
        400,
        "invalid_request_error",
        ["role"],
    ),
    (
        "image",
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        400,
        "invalid_request_error",
        ["'image' block", "text only"],
    ),
    (
        "unknown block",
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        400,
        "invalid_request_error",
        ["messages.0.content", "tool_use, tool_result"],
    ),
    (
        "orphan tool_result",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "4"}
                    ],
                }
            ]
        },
        400,
        "invalid_request_error",
        ["toolu_nope", "no tool_use"],
    ),
    (
        "tool_use from the user",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}
                    ],
                }
            ]
        },
        400,
        "invalid_request_error",
        ["only the assistant"],
    ),
    (
        "server tool",
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        400,
        "invalid_request_error",
        ["web_search_20250305"],
    ),
    (
        "unnamed tool choice",
        {"tools": TOOLS, "tool_choice": {"type": "tool"}},
        400,
        "invalid_request_error",
        ["name"],
    ),
    (
        "any without tools",
        {"tool_choice": {"type": "any"}},
        400,
        "invalid_request_error",
        ["tools"],
    ),
    (
        "unknown tool named",
        {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "fly"}},
        400,
        "invalid_request_error",
        ["fly"],
    ),
    ("empty stop", {"stop_sequences": [""]}, 400, "invalid_request_error", ["stop_sequences"]),
    (
        "session ids differ",
        {"session_id": "a", "metadata": {"user_id": "u"}},
        400,
        "invalid_request_error",
        ["differ"],
    ),
]


@requires_smollm2
@pytest.mark.parametrize(
    ("name", "change", "status", "kind", "words"), BAD, ids=[b[0] for b in BAD]
)
def test_bad_requests_are_typed_errors_and_the_server_stays_intact(
    http: httpx.Client, name: str, change: dict[str, Any], status: int, kind: str, words: list[str]
) -> None:
    body = {k: v for k, v in {**plain(), **change}.items() if v is not None}
    headers = {"X-Session-ID": "b"} if name == "session ids differ" else {}
    assert_error(http.post(MESSAGES, json=body, headers=headers), status, kind, words)
    if name != "session ids differ":
        body.pop("max_tokens", None)
        r = http.post(COUNT, json=body)
        if name not in ("no max_tokens", "zero max_tokens", "empty stop", "hot"):
            assert_error(r, status, kind, words)
    assert_healthy(http)


@requires_smollm2
def test_auth_and_body_errors_are_in_anthropics_shape(url: str, http: httpx.Client) -> None:
    r = httpx.post(url + MESSAGES, json=plain())
    assert_error(r, 401, "authentication_error", ["x-api-key"])
    r = httpx.post(url + MESSAGES, json=plain(), headers={"x-api-key": "wrong"})
    assert_error(r, 401, "authentication_error", ["Incorrect API key"])
    r = http.post(MESSAGES, content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_request_error", ["JSON"])
    # the chat endpoint keeps OpenAI's shape
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    image = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    asked = [{"role": "user", "content": [{"type": "image", "source": image}]}]
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    with client, pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=5, messages=asked)  # type: ignore[arg-type]
    assert caught.value.status_code == 400 and "text only" in caught.value.message
    assert_healthy(http)


# --- over the fake API: failures in and before the stream -------------------------------


def test_a_failure_mid_stream_is_an_error_event(client: httpx.Client) -> None:
    for word, kind in (("fail-midstream", "overloaded_error"), ("crash-midstream", "api_error")):
        body = {
            "model": "tiny",
            "max_tokens": 8,
            "stream": True,
            "messages": [{"role": "user", "content": f"a b {word}"}],
        }
        with client.stream("POST", MESSAGES, json=body) as r:
            assert r.status_code == 200
            got = events(r)
        names = [n for n, _ in got]
        assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
        assert names[-1] == "error" and "message_stop" not in names
        assert got[-1][1]["error"]["type"] == kind
        assert SECRET not in json.dumps(got)


def test_overload_before_the_stream_keeps_its_status(client: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "overload"}],
    }
    r = client.post(MESSAGES, json=body)
    assert_error(r, 503, "overloaded_error", ["full"])
    assert int(r.headers["Retry-After"]) >= 1
