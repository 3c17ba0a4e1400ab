"""Hint events (docs/design.md "Wire format for sessions") and delivery counters.

A :class:`HintEvent` is what a client tells the server about a session's tool gap; its JSON
body, posted to ``/v1/sessions/{session_id}/events``, is one of::

    {"event": "tool_start", "tool": "bash", "expected_s": 0.4}
    {"event": "tool_end", "measured_s": 0.31}      # measured_s optional
    {"event": "end"}
"""

from __future__ import annotations

import threading
from typing import Any

import attrs

from talaria.errors import BadRequest
from talaria.policy.gaps import HINT_MAX_S, HINT_MIN_S, check_hint_s, check_seconds
from talaria.session.ids import check_session_id
from talaria.types import EventKind, SessionEvent

__all__ = [
    "MAX_EXPECTED_S",
    "MAX_TOOL_NAME_LEN",
    "MIN_EXPECTED_S",
    "EventKind",
    "HintCounters",
    "HintEvent",
    "HintStats",
]

# The wire format's bounds: expected_s in [1 ms, 86399 s] (the gap model's hint range);
# a tool name of 1..200 characters.
MIN_EXPECTED_S = HINT_MIN_S
MAX_EXPECTED_S = HINT_MAX_S
MAX_TOOL_NAME_LEN = 200


@attrs.frozen
class HintEvent:
    """One hint about ``session_id`` (validated on construction: :class:`BadRequest`).

    ``tool`` and ``expected_s`` belong to ``tool_start`` (``tool`` required there, at most
    ``MAX_TOOL_NAME_LEN`` characters),
    ``measured_s`` to ``tool_end``; seconds are finite and >= 0, ``expected_s`` within
    ``[MIN_EXPECTED_S, MAX_EXPECTED_S]``.
    """

    session_id: str
    kind: EventKind
    tool: str | None = None
    expected_s: float | None = None
    measured_s: float | None = None

    def __attrs_post_init__(self) -> None:
        check_session_id(self.session_id)
        if not isinstance(self.kind, EventKind):
            raise BadRequest(f"kind must be an EventKind, got {self.kind!r}")
        start = self.kind is EventKind.TOOL_START
        tool_ok = isinstance(self.tool, str) and 0 < len(self.tool) <= MAX_TOOL_NAME_LEN
        if start and not tool_ok:
            raise BadRequest(
                f"a tool_start event needs a tool name of 1 to {MAX_TOOL_NAME_LEN} characters, "
                f"got {self.tool!r}"
            )
        if not start and (self.tool is not None or self.expected_s is not None):
            raise BadRequest(f"tool and expected_s belong to tool_start, not {self.kind.value}")
        if self.kind is not EventKind.TOOL_END and self.measured_s is not None:
            raise BadRequest(f"measured_s belongs to tool_end, not {self.kind.value}")
        check_hint_s("expected_s", self.expected_s)
        check_seconds("measured_s", self.measured_s)

    def to_json(self) -> dict[str, Any]:
        """The wire body (seconds rounded to 0.1 ms; absent optional fields omitted)."""
        body: dict[str, Any] = {"event": self.kind.value}
        if self.tool is not None:
            body["tool"] = self.tool
        if self.expected_s is not None:
            body["expected_s"] = round(self.expected_s, 4)
        if self.measured_s is not None:
            body["measured_s"] = round(self.measured_s, 4)
        return body

    def to_session_event(self) -> SessionEvent:
        """The same hint as the runtime's in-process :class:`~talaria.types.SessionEvent`
        (which has no ``measured_s``)."""
        return SessionEvent(
            session_id=self.session_id,
            kind=self.kind,
            tool=self.tool,
            expected_s=self.expected_s,
        )


@attrs.frozen
class HintStats:
    """Event counts: ``sent`` (delivered; HTTP 2xx), ``dropped`` (never attempted: queue
    full or sender closed), ``failed`` (attempted: connection error, timeout, HTTP error,
    exception from an in-process sink)."""

    sent: int = 0
    dropped: int = 0
    failed: int = 0


@attrs.define(eq=False)
class HintCounters:
    """Thread-safe running :class:`HintStats` (mutated by ``add`` only)."""

    _sent: int = attrs.field(init=False, default=0)
    _dropped: int = attrs.field(init=False, default=0)
    _failed: int = attrs.field(init=False, default=0)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    def add(self, sent: int = 0, dropped: int = 0, failed: int = 0) -> None:
        with self._lock:
            self._sent += sent
            self._dropped += dropped
            self._failed += failed

    def snapshot(self) -> HintStats:
        with self._lock:
            return HintStats(sent=self._sent, dropped=self._dropped, failed=self._failed)
