"""Every malformed or failing request gets the right status, OpenAI's error shape and an
actionable message; the server stays healthy afterwards. Runs over the fake API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import sse
from tests.server.server_fakes import SECRET

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, **kw}


Case = tuple[str, str, Any, dict[str, str], int, str | None, list[str]]


def error_cases(model: str) -> list[Case]:
    """The malformed-request matrix for a server serving ``model``: (name, path, raw body or
    JSON object, headers, status, code, words the message must hold). Shared with the live
    reliability suite (``tests/reliability/test_malformed_live.py``), which drops the cases
    that rely on this fake's magic words and 64-token context."""

    def ask(**kw: Any) -> dict[str, Any]:
        return {"model": model, "messages": USER, **kw}

    return [
        (
            "bad json",
            CHAT,
            b'{"model": "%s",' % model.encode(),
            {},
            400,
            "invalid_json",
            ["not valid JSON"],
        ),
        ("empty body", CHAT, b"", {}, 400, "invalid_json", ["JSON"]),
        ("not an object", CHAT, [1, 2], {}, 400, "invalid_value", ["object"]),
        (
            "missing model",
            CHAT,
            {"messages": USER},
            {},
            400,
            "invalid_value",
            ["model", "required"],
        ),
        ("missing messages", CHAT, {"model": model}, {}, 400, None, ["messages", "required"]),
        ("empty messages", CHAT, ask(messages=[]), {}, 400, None, ["messages"]),
        (
            "bad role",
            CHAT,
            ask(messages=[{"role": "robot", "content": "x"}]),
            {},
            400,
            None,
            ["role"],
        ),
        ("no role", CHAT, ask(messages=[{"content": "x"}]), {}, 400, None, ["messages.0.role"]),
        (
            "content int",
            CHAT,
            ask(messages=[{"role": "user", "content": 3}]),
            {},
            400,
            None,
            ["content"],
        ),
        (
            "image part",
            CHAT,
            ask(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            {},
            400,
            None,
            ["text only"],
        ),
        ("unknown model", CHAT, ask(model="gpt-9"), {}, 404, "model_not_found", ["gpt-9", model]),
        (
            "context too long",
            CHAT,
            ask(messages=[{"role": "user", "content": "w " * 80}]),
            {},
            400,
            "context_length_exceeded",
            ["context"],
        ),
        ("zero max_tokens", CHAT, ask(max_tokens=0), {}, 400, None, ["max_tokens", "greater"]),
        ("negative max_tokens", CHAT, ask(max_tokens=-5), {}, 400, None, ["max_tokens"]),
        (
            "negative mct",
            CHAT,
            ask(max_completion_tokens=-1),
            {},
            400,
            None,
            ["max_completion_tokens"],
        ),
        ("string max_tokens", CHAT, ask(max_tokens="5"), {}, 400, None, ["max_tokens", "integer"]),
        ("float max_tokens", CHAT, ask(max_tokens=5.5), {}, 400, None, ["max_tokens"]),
        ("bool max_tokens", CHAT, ask(max_tokens=True), {}, 400, None, ["max_tokens"]),
        ("string temperature", CHAT, ask(temperature="hot"), {}, 400, None, ["temperature"]),
        ("temperature range", CHAT, ask(temperature=3), {}, 400, None, ["temperature"]),
        ("top_p zero", CHAT, ask(top_p=0), {}, 400, None, ["top_p"]),
        ("stop ints", CHAT, ask(stop=[1]), {}, 400, None, ["stop", "string"]),
        ("stop empty", CHAT, ask(stop=[""]), {}, 400, None, ["stop"]),
        ("stream string", CHAT, ask(stream="yes"), {}, 400, None, ["stream"]),
        ("n=0", CHAT, ask(n=0), {}, 400, None, ["n", "greater"]),
        ("n too many", CHAT, ask(n=17), {}, 400, None, ["n", "16"]),
        ("penalty range", CHAT, ask(presence_penalty=2.5), {}, 400, None, ["presence_penalty"]),
        ("repetition zero", CHAT, ask(repetition_penalty=0), {}, 400, None, ["repetition_penalty"]),
        (
            "min_tokens over cap",
            CHAT,
            ask(max_tokens=2, min_tokens=3),
            {},
            400,
            None,
            ["min_tokens", "output cap"],
        ),
        ("stop ids negative", CHAT, ask(stop_token_ids=[-1]), {}, 400, None, ["stop_token_ids"]),
        ("ignore_eos string", CHAT, ask(ignore_eos="yes"), {}, 400, None, ["ignore_eos"]),
        (
            "top_logprobs alone",
            CHAT,
            ask(top_logprobs=2),
            {},
            400,
            None,
            ["top_logprobs", "logprobs=true"],
        ),
        ("top_logprobs range", CHAT, ask(logprobs=True, top_logprobs=21), {}, 400, None, ["20"]),
        (
            "unknown format",
            CHAT,
            ask(response_format={"type": "yaml"}),
            {},
            400,
            None,
            ["response_format", "json_object", "json_schema"],
        ),
        (
            "schema refused",
            CHAT,
            ask(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 7}}}),
            {},
            400,
            None,
            ["response_format", "grammar library"],
        ),
        (
            "json schema",
            CHAT,
            ask(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            {},
            400,
            None,
            ["response_format", "json_schema"],
        ),
        ("logit_bias", CHAT, ask(logit_bias={"1": 5.0}), {}, 400, None, ["logit_bias"]),
        ("beam search", CHAT, ask(use_beam_search=True), {}, 400, None, ["use_beam_search"]),
        ("min_p", CHAT, ask(min_p=0.1), {}, 400, None, ["min_p", "not supported"]),
        ("guided json", CHAT, ask(guided_json={"type": "object"}), {}, 400, None, ["guided_json"]),
        (
            "continuous usage",
            CHAT,
            ask(stream=True, stream_options={"continuous_usage_stats": True}),
            {},
            400,
            None,
            ["continuous_usage_stats"],
        ),
        (
            "completion logprobs range",
            "/v1/completions",
            {"model": model, "prompt": "a", "logprobs": 21},
            {},
            400,
            None,
            ["logprobs"],
        ),
        (
            "max token fields differ",
            CHAT,
            ask(max_tokens=3, max_completion_tokens=4),
            {},
            400,
            None,
            ["disagree"],
        ),
        (
            "stream_options alone",
            CHAT,
            ask(stream_options={"include_usage": True}),
            {},
            400,
            None,
            ["stream=true"],
        ),
        (
            "session id spaces",
            CHAT,
            ask(),
            {"X-Session-ID": "a b"},
            400,
            "invalid_session_id",
            ["X-Session-ID"],
        ),
        ("session id body type", CHAT, ask(session_id=5), {}, 400, None, ["session_id"]),
        (
            "overloaded",
            CHAT,
            ask(messages=[{"role": "user", "content": "overload"}]),
            {},
            503,
            "overloaded",
            ["full"],
        ),
        (
            "crash before output",
            CHAT,
            ask(messages=[{"role": "user", "content": "crash-early"}]),
            {},
            500,
            "internal_error",
            ["request"],
        ),
        (
            "fail mid-answer",
            CHAT,
            ask(messages=[{"role": "user", "content": "fail-midstream"}]),
            {},
            503,
            "instance_failed",
            ["failed"],
        ),
        (
            "crash mid-answer",
            CHAT,
            ask(messages=[{"role": "user", "content": "crash-midstream"}]),
            {},
            500,
            "internal_error",
            ["server log"],
        ),
        (
            "completion list of 2",
            "/v1/completions",
            {"model": model, "prompt": ["a", "b"]},
            {},
            400,
            None,
            ["one prompt"],
        ),
        (
            "completion negative token ids",
            "/v1/completions",
            {"model": model, "prompt": [[1, -2]]},
            {},
            400,
            None,
            ["prompt"],
        ),
        (
            "completion mixed prompt",
            "/v1/completions",
            {"model": model, "prompt": [1, "two"]},
            {},
            400,
            None,
            ["prompt"],
        ),
        (
            "completion no prompt",
            "/v1/completions",
            {"model": model},
            {},
            400,
            None,
            ["prompt", "required"],
        ),
        (
            "completion echo",
            "/v1/completions",
            {"model": model, "prompt": "a", "echo": True},
            {},
            400,
            None,
            ["echo"],
        ),
        (
            "event unknown session",
            "/v1/sessions/never-seen/events",
            {"event": "end"},
            {},
            404,
            "session_not_found",
            ["never-seen"],
        ),
        ("event bad name", "/v1/sessions/x/events", {"event": "lunch"}, {}, 400, None, ["event"]),
        (
            "event negative",
            "/v1/sessions/x/events",
            {"event": "tool_start", "expected_s": -1},
            {},
            400,
            None,
            ["expected_s"],
        ),
        (
            "event extra field",
            "/v1/sessions/x/events",
            {"event": "end", "bogus": 1},
            {},
            400,
            None,
            ["bogus", "unknown"],
        ),
        ("event bad json", "/v1/sessions/x/events", b"{", {}, 400, "invalid_json", ["JSON"]),
        ("unknown path", "/v1/nothing", {}, {}, 404, "not_found", ["/v1/chat/completions"]),
    ]


CASES: list[Case] = error_cases("tiny")


def _post(client: httpx.Client, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json", **headers}
        return client.post(path, content=body, headers=headers)
    return client.post(path, json=body, headers=headers)


def _assert_error(r: httpx.Response, status: int, code: str | None, words: list[str]) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if status < 500 else err["type"])
    if code is not None:
        assert err["code"] == code
    for word in words:
        assert word in err["message"], (word, err["message"])
    assert SECRET not in r.text
    assert "Traceback" not in r.text


def _assert_healthy(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    r = client.post(CHAT, json=chat(max_tokens=4))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "echo hi"


@pytest.mark.parametrize(("name", "path", "body", "headers", "status", "code", "words"), CASES)
def test_error_matrix(
    client: httpx.Client,
    name: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    code: str | None,
    words: list[str],
) -> None:
    _assert_error(_post(client, path, body, headers), status, code, words)
    _assert_healthy(client)


def test_param_names_the_field(client: httpx.Client) -> None:
    assert client.post(CHAT, json=chat(max_tokens=-1)).json()["error"]["param"] == "max_tokens"
    assert client.post(CHAT, json=chat(model="zz")).json()["error"]["param"] == "model"
    r = client.post(CHAT, json=chat(messages=[{"role": "user", "content": "w " * 80}]))
    assert r.json()["error"]["param"] == "messages"


def test_overloaded_asks_to_retry(client: httpx.Client) -> None:
    r = client.post(CHAT, json=chat(messages=[{"role": "user", "content": "overload"}]))
    assert r.headers["retry-after"] == "1"


def test_wrong_method(client: httpx.Client) -> None:
    r = client.get(CHAT)
    _assert_error(r, 405, "method_not_allowed", ["GET"])


def test_oversized_body_with_content_length(client: httpx.Client) -> None:
    big = chat(messages=[{"role": "user", "content": "x" * 70_000}])
    _assert_error(client.post(CHAT, json=big), 413, "request_too_large", ["65536 bytes"])
    _assert_healthy(client)


def test_oversized_chunked_body(fake_url: str) -> None:
    def pieces() -> Iterator[bytes]:
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}]}'

    with httpx.Client(base_url=fake_url) as c:
        r = c.post(CHAT, content=pieces(), headers={"Content-Type": "application/json"})
        assert "content-length" not in r.request.headers
        _assert_error(r, 413, "request_too_large", ["exceeds"])
        _assert_healthy(c)


def test_chunked_body_under_the_limit(fake_url: str) -> None:
    def pieces() -> Iterator[bytes]:
        body = json.dumps(chat(max_tokens=3)).encode()
        yield body[:10]
        yield body[10:]

    with httpx.Client(base_url=fake_url) as c:
        r = c.post(CHAT, content=pieces(), headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("word", "status", "code"),
    [("fail-midstream", 503, "instance_failed"), ("crash-midstream", 500, "internal_error")],
)
def test_error_after_the_stream_began(
    client: httpx.Client, word: str, status: int, code: str
) -> None:
    body = chat(messages=[{"role": "user", "content": f"a {word} b"}], stream=True)
    with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        events = sse(r)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == code
    assert SECRET not in json.dumps(events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    metrics = client.get("/metrics").text
    assert f'endpoint="chat_completions",model="tiny",status="{status}"' in metrics
    _assert_healthy(client)


def test_error_before_the_stream_began_keeps_its_status(client: httpx.Client) -> None:
    body = chat(model="nope", stream=True)
    r = client.post(CHAT, json=body)
    _assert_error(r, 404, "model_not_found", ["tiny"])
    big = chat(messages=[{"role": "user", "content": "w " * 80}], stream=True)
    _assert_error(client.post(CHAT, json=big), 400, "context_length_exceeded", [])


def test_text_body_without_json_content_type_is_parsed(client: httpx.Client) -> None:
    r = client.post(CHAT, content=json.dumps(chat()).encode())
    assert r.status_code == 200
