"""The server's malformed-request matrix against a live server over a real socket, backed by
a real ``Talaria`` serving ``smollm2-tiny-dummy`` on CPU.

The matrix of ``tests/server/test_server_errors.py`` (run there over a fake backend) is
reused with the live model's name, minus the cases that only the fake can produce (listed in
:data:`FAKE_ONLY`, with why); live-only cases follow (the real 8192-token context, unknown
sessions, API keys, non-finite and huge numbers, deep nesting, bad bytes). After every case
the answer must be the matrix's status, code and words in OpenAI's error shape with no
traceback, and the server must be intact: ``/health?integrity=true`` ok and the probe call
answered as before (``tests.reliability.inprocess``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import httpx
import pytest

from tests.reliability.inprocess import (
    AUTH,
    CHAT,
    COMPLETIONS,
    CONTEXT,
    KEY,
    MAX_BODY_BYTES,
    MODEL,
    assert_intact,
    probe,
    requires_tiny_model,
    serve_tiny,
)
from tests.server.test_server_errors import error_cases

pytestmark = requires_tiny_model

USER = [{"role": "user", "content": "hi"}]
EVENTS = "/v1/sessions/{}/events"

# Cases of the shared matrix that only the fake backend can produce; each is dropped here.
FAKE_ONLY = {
    # The fake's context is 64 tokens, so 80 words overflow it; the live model has 8192:
    # the live-only "context too long" cases below replace it.
    "context too long": "the fake's 64-token context",
    # Magic words the fake reacts to; the live model answers them as any other text.
    "overloaded": "the fake's magic word 'overload'",
    "crash before output": "the fake's magic word 'crash-early'",
    "fail mid-answer": "the fake's magic word 'fail-midstream'",
    "crash mid-answer": "the fake's magic word 'crash-midstream'",
}


class Case(NamedTuple):
    name: str
    method: str
    path: str
    body: Any  # bytes are sent raw (as application/json); anything else as JSON
    headers: dict[str, str]  # merged over AUTH; "Authorization": "" sends an empty one
    status: int
    code: str | None  # None: the matrix does not pin the code
    words: list[str]  # each must appear in the error message


def ask(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **kw}


def raw(tail: str) -> bytes:
    """A chat body whose last field is ``tail`` verbatim (for what ``json.dumps`` won't write)."""
    return (json.dumps(ask())[:-1] + ", " + tail + "}").encode()


def shared_cases() -> list[Case]:
    """The fake's matrix for the live model, without :data:`FAKE_ONLY`."""
    return [
        Case(name, "POST", path, body, headers, status, code, words)
        for name, path, body, headers, status, code, words in error_cases(MODEL)
        if name not in FAKE_ONLY
    ]


NESTED = "[" * 5000 + "]" * 5000  # far past the JSON parser's recursion limit
LONG = "w " * (CONTEXT + 500)  # ~8.7K tokens: over the context whatever max_tokens is

LIVE_CASES: list[Case] = [
    # The real context (8192 tokens): by the prompt, by max_tokens, by both kinds of call.
    Case(
        "context too long: prompt",
        "POST",
        CHAT,
        ask(messages=[{"role": "user", "content": LONG}], max_tokens=2),
        {},
        400,
        "context_length_exceeded",
        ["exceed", "8192", "shorten the prompt"],
    ),
    Case(
        "context too long: max_tokens",
        "POST",
        CHAT,
        ask(max_tokens=CONTEXT),
        {},
        400,
        "context_length_exceeded",
        ["8192", "lower max_tokens"],
    ),
    Case(
        "context too long: max_completion_tokens",
        "POST",
        CHAT,
        ask(max_completion_tokens=CONTEXT),
        {},
        400,
        "context_length_exceeded",
        ["8192"],
    ),
    Case(
        "context too long: completion prompt",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": LONG, "max_tokens": 2},
        {},
        400,
        "context_length_exceeded",
        ["8192"],
    ),
    Case(
        "huge max_tokens (past 64 bits)",
        "POST",
        CHAT,
        ask(max_tokens=10**30),
        {},
        400,
        "context_length_exceeded",
        ["8192"],
    ),
    Case(
        "max_tokens 2**63",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": "a", "max_tokens": 2**63},
        {},
        400,
        "context_length_exceeded",
        ["8192"],
    ),
    # Non-finite and unrepresentable numbers (json.dumps would write NaN; sent raw anyway).
    Case(
        "NaN temperature",
        "POST",
        CHAT,
        raw('"temperature": NaN'),
        {},
        400,
        "invalid_value",
        ["temperature", "finite"],
    ),
    Case(
        "Infinity top_p",
        "POST",
        CHAT,
        raw('"top_p": Infinity'),
        {},
        400,
        "invalid_value",
        ["top_p", "finite"],
    ),
    Case(
        "1e999 temperature",
        "POST",
        CHAT,
        raw('"temperature": 1e999'),
        {},
        400,
        "invalid_value",
        ["temperature", "finite"],
    ),
    Case(
        "-Infinity seed", "POST", CHAT, raw('"seed": -Infinity'), {}, 400, "invalid_value", ["seed"]
    ),
    Case(
        "1e400 max_tokens",
        "POST",
        CHAT,
        raw('"max_tokens": 1e400'),
        {},
        400,
        "invalid_value",
        ["max_tokens", "integer"],
    ),
    Case(
        "seed 2**64", "POST", CHAT, ask(seed=2**64), {}, 400, "invalid_value", ["seed", "less than"]
    ),
    Case(
        "seed below -2**63",
        "POST",
        CHAT,
        ask(seed=-(2**63) - 1),
        {},
        400,
        "invalid_value",
        ["seed"],
    ),
    Case(
        "NaN expected_s",
        "POST",
        EVENTS.format("x"),
        b'{"event": "tool_start", "expected_s": NaN}',
        {},
        400,
        "invalid_value",
        ["expected_s"],
    ),
    # Deep nesting, in an ignored field and in a known one; bytes that are not JSON.
    Case(
        "deep nesting, extra field",
        "POST",
        CHAT,
        raw(f'"x": {NESTED}'),
        {},
        400,
        "invalid_json",
        ["recursion limit"],
    ),
    Case(
        "deep nesting, content",
        "POST",
        CHAT,
        json.dumps(ask(messages=[{"role": "user", "content": 0}])).replace("0", NESTED).encode(),
        {},
        400,
        "invalid_json",
        ["recursion limit"],
    ),
    Case(
        "deep nesting, event",
        "POST",
        EVENTS.format("x"),
        f'{{"event": {NESTED}}}'.encode(),
        {},
        400,
        "invalid_json",
        ["recursion limit"],
    ),
    Case("not UTF-8", "POST", CHAT, b"\xff\xfe\x00{", {}, 400, "invalid_json", ["JSON"]),
    Case(
        "lone surrogate", "POST", CHAT, raw('"user": "\\ud800"'), {}, 400, "invalid_json", ["JSON"]
    ),
    Case("JSON null body", "POST", CHAT, b"null", {}, 400, "invalid_value", ["object"]),
    Case(
        "JSON string body", "POST", COMPLETIONS, b'"prompt"', {}, 400, "invalid_value", ["object"]
    ),
    # Prompts that tokenize to nothing.
    Case(
        "empty prompt",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": "", "max_tokens": 2},
        {},
        400,
        "invalid_request_error",
        ["prompt is empty"],
    ),
    Case(
        "empty prompt in a list",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": [""], "max_tokens": 2},
        {},
        400,
        "invalid_request_error",
        ["prompt is empty"],
    ),
    # Sessions: ids the server cannot use, ids that disagree, events for unknown sessions.
    Case(
        "session id too long",
        "POST",
        CHAT,
        ask(session_id="s" * 257),
        {},
        400,
        "invalid_session_id",
        ["session_id", "1 to 256", "257"],
    ),
    Case(
        "session id empty",
        "POST",
        CHAT,
        ask(session_id=""),
        {},
        400,
        "invalid_session_id",
        ["1 to 256", "got 0"],
    ),
    Case(
        "session id header and body differ",
        "POST",
        CHAT,
        ask(session_id="a"),
        {"X-Session-ID": "b"},
        400,
        "invalid_value",
        ["differ", "'a'", "'b'"],
    ),
    Case(
        "session id control character",
        "POST",
        CHAT,
        ask(session_id="a\x01b"),
        {},
        400,
        "invalid_session_id",
        ["printable ASCII"],
    ),
    Case(
        "tool_start, unknown session",
        "POST",
        EVENTS.format("nobody-1"),
        {"event": "tool_start", "tool": "bash", "expected_s": 0.5},
        {},
        404,
        "session_not_found",
        ["nobody-1", "send a call with this session id first"],
    ),
    Case(
        "tool_end, unknown session",
        "POST",
        EVENTS.format("nobody-2"),
        {"event": "tool_end", "measured_s": 0.5},
        {},
        404,
        "session_not_found",
        ["nobody-2"],
    ),
    Case(
        "event, path id with a space",
        "POST",
        EVENTS.format("a%20b"),
        {"event": "end"},
        {},
        400,
        "invalid_session_id",
        ["session id in the path", "printable ASCII"],
    ),
    Case(
        "event, empty path id",
        "POST",
        EVENTS.format(""),
        {"event": "end"},
        {},
        400,
        "invalid_session_id",
        ["session id in the path"],
    ),
    Case(
        "event, tool name too long",
        "POST",
        EVENTS.format("x"),
        {"event": "tool_start", "tool": "t" * 201},
        {},
        400,
        "invalid_value",
        ["tool"],
    ),
    Case(
        "event, expected_s a string",
        "POST",
        EVENTS.format("x"),
        {"event": "tool_start", "expected_s": "1"},
        {},
        400,
        "invalid_value",
        ["expected_s"],
    ),
    Case(
        "event, zero expected_s",
        "POST",
        EVENTS.format("x"),
        {"event": "tool_start", "expected_s": 0},
        {},
        400,
        "invalid_request_error",
        ["[0.001, 86399]"],
    ),
    # API keys: /v1/... needs "Authorization: Bearer <key>".
    Case(
        "missing key",
        "POST",
        CHAT,
        ask(max_tokens=2),
        {"Authorization": ""},
        401,
        "invalid_api_key",
        ["Missing API key"],
    ),
    Case(
        "wrong key",
        "POST",
        CHAT,
        ask(max_tokens=2),
        {"Authorization": "Bearer nope"},
        401,
        "invalid_api_key",
        ["Incorrect API key"],
    ),
    Case(
        "key with another scheme",
        "POST",
        CHAT,
        ask(max_tokens=2),
        {"Authorization": f"Basic {KEY}"},
        401,
        "invalid_api_key",
        ["Malformed"],
    ),
    Case(
        "bearer without a key",
        "POST",
        CHAT,
        ask(max_tokens=2),
        {"Authorization": "Bearer"},
        401,
        "invalid_api_key",
        ["Malformed"],
    ),
    Case(
        "key plus suffix",
        "POST",
        CHAT,
        ask(max_tokens=2),
        {"Authorization": f"Bearer {KEY}x"},
        401,
        "invalid_api_key",
        ["Incorrect"],
    ),
    Case(
        "key on events, wrong",
        "POST",
        EVENTS.format("x"),
        {"event": "end"},
        {"Authorization": "Bearer nope"},
        401,
        "invalid_api_key",
        ["Incorrect"],
    ),
    Case(
        "key on models, missing",
        "GET",
        "/v1/models",
        None,
        {"Authorization": ""},
        401,
        "invalid_api_key",
        ["Missing"],
    ),
    # Other endpoints and methods.
    Case(
        "unknown model card",
        "GET",
        f"/v1/models/{MODEL}-x",
        None,
        {},
        404,
        "model_not_found",
        [f"{MODEL}-x", f"Available models: {MODEL}."],
    ),
    Case("GET chat", "GET", CHAT, None, {}, 405, "method_not_allowed", ["GET"]),
    Case(
        "PUT events",
        "PUT",
        EVENTS.format("x"),
        {"event": "end"},
        {},
        405,
        "method_not_allowed",
        ["PUT"],
    ),
    Case(
        "health, integrity=maybe",
        "GET",
        "/health?integrity=maybe",
        None,
        {},
        400,
        "invalid_value",
        ["integrity must be true or false"],
    ),
    Case(
        "oversized body",
        "POST",
        CHAT,
        ask(messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}]),
        {},
        413,
        "request_too_large",
        [f"exceeds {MAX_BODY_BYTES} bytes"],
    ),
]

ALL_CASES = shared_cases() + LIVE_CASES


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    # strict: a max_tokens past the context is refused, as OpenAI does (the default clamps
    # it to what the prompt leaves, tests/server/test_anthropic.py)
    with serve_tiny(strict_max_tokens=True) as base:
        yield base


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def baseline(http: httpx.Client) -> str:
    """The probe's answer on the fresh server; every later probe must equal it."""
    return probe(http)


def send(http: httpx.Client, case: Case) -> httpx.Response:
    headers = {**AUTH, **case.headers}
    if isinstance(case.body, bytes):
        headers.setdefault("Content-Type", "application/json")
        return http.request(case.method, case.path, content=case.body, headers=headers)
    if case.body is None:
        return http.request(case.method, case.path, headers=headers)
    return http.request(case.method, case.path, json=case.body, headers=headers)


def assert_error(r: httpx.Response, case: Case) -> None:
    """``r`` is the case's error, in OpenAI's shape, with nothing internal in it."""
    assert r.status_code == case.status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"  # every case is the client's fault (4xx)
    if case.code is not None:
        assert err["code"] == case.code, err
    for word in case.words:
        assert word in err["message"], (word, err["message"])
    for leak in ("Traceback", 'File "', "site-packages", "talaria/"):
        assert leak not in r.text, (leak, r.text)


def test_the_matrix_is_the_fakes_minus_the_fake_only_cases() -> None:
    names = [c[0] for c in error_cases(MODEL)]
    assert set(FAKE_ONLY) <= set(names)  # a renamed case must be renamed here too
    assert len(shared_cases()) == len(names) - len(FAKE_ONLY)
    # the fake's model name was rewritten everywhere
    assert not any(re.search("['\"]tiny['\"]", repr(c)) for c in shared_cases())
    assert re.search("['\"]tiny['\"]", repr(error_cases("tiny")))
    all_names = [c.name for c in ALL_CASES]
    assert len(all_names) == len(set(all_names))


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
def test_malformed_request_then_intact(http: httpx.Client, baseline: str, case: Case) -> None:
    assert_error(send(http, case), case)
    assert_intact(http, baseline)


def test_oversized_chunked_body_then_intact(url: str, baseline: str) -> None:
    def pieces() -> Iterator[bytes]:
        yield b'{"model": "%s", "messages": [{"role": "user", "content": "' % MODEL.encode()
        for _ in range(MAX_BODY_BYTES // 1000 + 10):
            yield b"x" * 1000
        yield b'"}]}'

    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        r = c.post(CHAT, content=pieces(), headers={"Content-Type": "application/json"})
        assert "content-length" not in r.request.headers
        assert_error(
            r, Case("chunked", "POST", CHAT, None, {}, 413, "request_too_large", ["exceeds"])
        )
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        assert_intact(c, baseline)


def test_events_after_the_session_ended(http: httpx.Client, baseline: str) -> None:
    sid = "malformed-ended"
    r = http.post(CHAT, json=ask(max_tokens=2), headers={"X-Session-ID": sid})
    assert r.status_code == 200, r.text
    end = http.post(EVENTS.format(sid), json={"event": "end"})
    assert end.status_code == 200, end.text
    assert end.json()["summary"]["calls"] == 1
    for event in ({"event": "end"}, {"event": "tool_start", "tool": "bash", "expected_s": 1}):
        again = http.post(EVENTS.format(sid), json=event)
        case = Case("ended", "POST", EVENTS.format(sid), event, {}, 404, "session_not_found", [sid])
        assert_error(again, case)
        assert_intact(http, baseline)


def test_unknown_session_message_names_the_id_as_sent(http: httpx.Client, baseline: str) -> None:
    r = http.post(EVENTS.format("nobody-3"), json={"event": "end"})
    assert r.status_code == 404, r.text
    message = r.json()["error"]["message"]
    assert_intact(http, baseline)
    assert "\\x1f" not in message and "key-" not in message  # never the tenant-scoped id
    assert "'nobody-3'" in message, message


def test_a_streamed_call_after_the_matrix(http: httpx.Client) -> None:
    with http.stream("POST", CHAT, json=ask(max_tokens=2, stream=True)) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in e for e in events), events
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
