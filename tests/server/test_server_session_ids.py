"""``talaria.server.session_ids.session_of``: the session id of each client's request shape,
the documented precedence between them, and the typed 400s (conflict, unusable id)."""

from __future__ import annotations

import json

import pytest

from talaria.server.errors import HttpError
from talaria.server.session_ids import session_from_user_id, session_of

CLAUDE_USER_ID = json.dumps(
    {"device_id": "ab" * 32, "account_uuid": "", "session_id": "5f1c0a52-claude"}
)


def test_no_id_is_a_one_call_session() -> None:
    assert session_of({}) is None
    assert session_of({"Content-Type": "application/json"}, metadata_user_id="user-7") is None


def test_talarias_own_header_and_body_field() -> None:
    assert session_of({"X-Session-ID": "s1"}) == "s1"
    assert session_of({"x-session-id": "s1"}, "s1") == "s1"  # both, equal
    assert session_of({}, "s2") == "s2"
    # OpenCode's x-session-id is the same header (names are case-insensitive)
    assert session_of({"x-session-id": "opencode-1"}) == "opencode-1"


def test_header_and_body_that_differ_are_a_400() -> None:
    with pytest.raises(HttpError) as caught:
        session_of({"X-Session-ID": "a"}, "b")
    err = caught.value
    assert err.status == 400 and err.param == "session_id" and "differ" in err.message


@pytest.mark.parametrize(
    ("headers", "body", "source"),
    [
        ({"X-Session-ID": "has space"}, None, "X-Session-ID header"),
        ({}, "é", "session_id"),
        ({"X-Claude-Code-Session-Id": "x" * 257}, None, "X-Claude-Code-Session-Id"),
        ({"thread-id": "tab\there"}, None, "thread-id"),
    ],
)
def test_an_unusable_id_is_a_400_naming_its_source(
    headers: dict[str, str], body: str | None, source: str
) -> None:
    with pytest.raises(HttpError) as caught:
        session_of(headers, body)
    assert caught.value.status == 400 and caught.value.code == "invalid_session_id"
    assert source in caught.value.message


def test_claude_code() -> None:
    assert session_of({"X-Claude-Code-Session-Id": "cc-1"}) == "cc-1"
    assert session_of({}, metadata_user_id=CLAUDE_USER_ID) == "5f1c0a52-claude"
    # the header is read before metadata.user_id
    assert session_of({"x-claude-code-session-id": "cc-1"}, None, CLAUDE_USER_ID) == "cc-1"
    legacy = "user_" + "ab" * 32 + "_account__session_0b6c1e8e-1111-2222-3333-444455556666"
    assert session_of({}, metadata_user_id=legacy) == "0b6c1e8e-1111-2222-3333-444455556666"


@pytest.mark.parametrize(
    "user_id",
    [
        None,
        "",
        "user-42",
        "{not json",
        json.dumps({"device_id": "d"}),
        "[1, 2]",
        json.dumps({"session_id": 7}),
        json.dumps({"session_id": ""}),
    ],
)
def test_a_user_id_naming_no_session_is_no_session(user_id: str | None) -> None:
    assert session_from_user_id(user_id) is None
    assert session_of({}, metadata_user_id=user_id) is None


def test_codex() -> None:
    assert session_of({"session-id": "codex-1"}) == "codex-1"
    assert session_of({"session_id": "codex-2"}) == "codex-2"
    assert session_of({"thread-id": "thread-3"}) == "thread-3"
    assert session_of({}, prompt_cache_key="pck-4") == "pck-4"
    assert session_of({"session-id": "codex-1"}, prompt_cache_key="pck-4") == "codex-1"


def test_opencode_and_dynamo() -> None:
    assert session_of({"x-session-affinity": "oc-1"}) == "oc-1"
    assert session_of({"X-Dynamo-Session-ID": "dyn-1"}) == "dyn-1"


# Every source in the documented order: (header name or a body argument, its value).
ORDER: list[tuple[str, str]] = [
    ("X-Session-ID", "talaria"),
    ("X-Claude-Code-Session-Id", "claude"),
    ("metadata_user_id", CLAUDE_USER_ID),
    ("session-id", "codex"),
    ("thread-id", "codex-thread"),
    ("prompt_cache_key", "cache-key"),
    ("x-session-affinity", "opencode"),
    ("X-Dynamo-Session-ID", "dynamo"),
]


def test_the_documented_precedence() -> None:
    for first in range(len(ORDER)):
        sent = dict(ORDER[first:])
        headers = {
            k: v for k, v in sent.items() if k not in ("metadata_user_id", "prompt_cache_key")
        }
        got = session_of(
            headers,
            metadata_user_id=sent.get("metadata_user_id"),
            prompt_cache_key=sent.get("prompt_cache_key"),
        )
        name, value = ORDER[first]
        assert got == (session_from_user_id(value) if name == "metadata_user_id" else value), name
    # the body's session_id ranks with the X-Session-ID header
    assert session_of({"thread-id": "t"}, "body", CLAUDE_USER_ID, "k") == "body"
