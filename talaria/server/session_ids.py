"""Which session a request belongs to, read from what clients already send.

One function, :func:`session_of`, used by every endpoint that runs a call. It looks in this
order and takes the first id it finds (keyed with the caller's tenant afterwards, by the API):

1. Talaria's own: the ``X-Session-ID`` header and the body's ``session_id``. If both are
   sent they must be equal (a 400 otherwise, rather than silently preferring one).
2. Claude Code: the ``X-Claude-Code-Session-Id`` header, then the body's
   ``metadata.user_id`` when it holds a session: a JSON object as a string with a
   ``session_id`` (``{"device_id": ..., "account_uuid": ..., "session_id": ...}``), or the
   older ``user_<hash>_account_<uuid>_session_<uuid>`` form.
3. Codex: the ``session-id`` (or ``session_id``) header, the ``thread-id`` header, then the
   body's ``prompt_cache_key``.
4. OpenCode: the ``x-session-affinity`` header (its ``x-session-id`` is rule 1: header names
   are case-insensitive).
5. NVIDIA Dynamo: the ``X-Dynamo-Session-ID`` header.

Without any of them the call is a one-call session. Within a rule after the first, the
first source present wins. An id found must be usable on the wire (1..256 printable ASCII
characters, no spaces): an unusable one is a 400 naming where it came from, never silently
replaced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Final

from talaria.server.errors import bad_request
from talaria.server.requests import check_session_id

__all__ = ["session_from_user_id", "session_of"]

# The headers of rules 2 to 5 (lower case).
_CLAUDE_HEADER: Final = "x-claude-code-session-id"
_CODEX_HEADERS: Final = ("session-id", "session_id", "thread-id")
_OPENCODE_HEADER: Final = "x-session-affinity"
_DYNAMO_HEADER: Final = "x-dynamo-session-id"
_LEGACY_USER_ID: Final = re.compile(r"_session_([0-9A-Za-z-]{1,128})\Z")


def session_of(
    headers: Mapping[str, str],
    body_session_id: str | None = None,
    metadata_user_id: str | None = None,
    prompt_cache_key: str | None = None,
) -> str | None:
    """The request's session id by the module's precedence, or None (a one-call session).

    ``headers`` may be any mapping (names compared case-insensitively). Raises
    ``HttpError`` (400, ``invalid_session_id``) for an unusable id and when the
    ``X-Session-ID`` header and ``body_session_id`` differ."""
    lower = {name.lower(): value for name, value in headers.items()}
    explicit = _explicit(lower.get("x-session-id"), body_session_id)
    if explicit is not None:
        return explicit
    candidates: tuple[tuple[str | None, str], ...] = (
        (lower.get(_CLAUDE_HEADER), "the X-Claude-Code-Session-Id header"),
        (session_from_user_id(metadata_user_id), "metadata.user_id's session_id"),
        *((lower.get(h), f"the {h} header") for h in _CODEX_HEADERS),
        (prompt_cache_key, "prompt_cache_key"),
        (lower.get(_OPENCODE_HEADER), "the x-session-affinity header"),
        (lower.get(_DYNAMO_HEADER), "the X-Dynamo-Session-ID header"),
    )
    for value, source in candidates:
        if value is not None:
            return check_session_id(value, source)
    return None


def _explicit(header: str | None, body: str | None) -> str | None:
    """Rule 1: the ``X-Session-ID`` header and the body's ``session_id`` (equal if both)."""
    if header is not None:
        header = check_session_id(header, "the X-Session-ID header")
        if body is not None and body != header:
            raise bad_request(
                f"The X-Session-ID header ({header!r}) and the body's session_id ({body!r}) "
                "differ; send the session id once, or the same in both.",
                "session_id",
            )
        return header
    return None if body is None else check_session_id(body, "session_id")


def session_from_user_id(user_id: str | None) -> str | None:
    """The session Claude Code names in ``metadata.user_id``: the ``session_id`` of a JSON
    object sent as a string, or the id after ``_session_`` in the older
    ``user_<hash>_account_<uuid>_session_<uuid>`` form. None when it names none (any other
    user id is an end-user id, not a session)."""
    if not user_id:
        return None
    text = user_id.strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        value = parsed.get("session_id") if isinstance(parsed, dict) else None
        return value if isinstance(value, str) and value else None
    match = _LEGACY_USER_ID.search(text)
    return match.group(1) if match else None
