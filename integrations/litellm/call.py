"""What the provider hands a backend (one chat call) and gets back, and how a call fails.

Both backends (:mod:`~talaria.integrations.litellm.http`,
:mod:`~talaria.integrations.litellm.embedded`) take a :class:`Call` and answer with an
:class:`Answer` or a stream of :class:`Piece` s; they fail with one of three errors, which
the provider turns into LiteLLM's own exceptions
(:mod:`~talaria.integrations.litellm.errors`): :class:`ServerError` (the server answered
with an error: HTTP status and OpenAI's ``message`` / ``code`` / ``param``),
:class:`Unreachable` (no connection) and :class:`TimedOut`. Units: tokens, seconds.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = [
    "Answer",
    "Call",
    "CallError",
    "Piece",
    "ServerError",
    "TimedOut",
    "ToolCall",
    "Unreachable",
    "Usage",
]


@attrs.frozen
class Call:
    """One chat completion request.

    ``params``: OpenAI body fields other than ``model``, ``messages``, ``stream`` and
    ``session_id`` (sampling, ``tools``, ...), forwarded as given so that the server accepts
    or rejects them with its own message. ``session_id``: sent as ``X-Session-ID`` (None: a
    one-call session). ``headers``: extra HTTP headers (HTTP backend only). ``timeout_s``:
    the whole call; ``connect_timeout_s``: establishing the connection.
    """

    model: str
    messages: list[dict[str, Any]]
    params: dict[str, Any] = attrs.field(factory=dict)
    session_id: str | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0

    def body(self) -> dict[str, Any]:
        """The JSON body of the call, without ``stream`` (the session id travels as a
        header)."""
        return {**self.params, "model": self.model, "messages": self.messages}


@attrs.frozen
class Usage:
    """Token counts of one call; ``cached_tokens``: prompt tokens whose KV was reused."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@attrs.frozen
class ToolCall:
    """A tool call the server read from the model's answer: its place in the answer
    (``index``), ``id``, the tool's ``name`` and ``arguments`` (JSON text; in a stream, a
    fragment to append to the call of the same index)."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (``index`` included, as streamed deltas carry)."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@attrs.frozen
class Answer:
    """A whole answer. ``session_id``: the session the server ran it in (generated for a
    one-call session); ``instance``: the serving instance, when known; ``tool_calls``: the
    calls the server read from it (``finish_reason`` "tool_calls")."""

    text: str
    finish_reason: str
    usage: Usage | None
    session_id: str | None = None
    instance: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@attrs.frozen
class Piece:
    """A piece of a streamed answer: text or tool calls, then (last piece only)
    ``finish_reason`` and ``usage``."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    tool_calls: tuple[ToolCall, ...] = ()


class CallError(Exception):
    """Base of the ways a call fails (see the module docstring)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@attrs.define(auto_exc=True, slots=False)
class ServerError(CallError):
    """The server refused or failed the call: ``status`` (HTTP), OpenAI's ``code``,
    ``param`` and ``type``."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    type: str | None = None

    def __str__(self) -> str:
        return self.message


class Unreachable(CallError):
    """No connection to the server (refused, DNS, reset before an answer)."""


class TimedOut(CallError):
    """The call did not finish within its timeout."""
