"""``SessionTracker``: one per agent run; turns tool start/end calls into gap hints.

Usage::

    hints = HintSender.http("http://localhost:8000", api_key=key)   # one per process
    predictor = GapPredictor.default()                              # one per process
    with SessionTracker(predictor=predictor, hints=hints) as session:
        ...  # LLM calls carry session.session_id (X-Session-ID header)
        session.tool_started("bash", command="pytest -x tests")
        ...  # run the tool
        session.tool_ended()
    # leaving the block sends "end"

Parallel tools: a gap lasts from the first tool started to the last one ended. Every
``tool_started`` sends ``tool_start`` with ``expected_s`` = the time until the longest
expected of the running tools returns; ``tool_end`` is sent when the last running tool
ends, with ``measured_s`` = the whole gap. Each tool's own duration trains the predictor.

Hints go through the sender's queue: no method here waits for the network or raises because
of it. Methods raise :class:`~talaria.errors.BadRequest` only for misuse by the caller (a
blank tool name, ``tool_ended`` with no tool running, a tool started after ``end``).
"""

from __future__ import annotations

import threading
from typing import Any

import attrs

from talaria.clock import Clock, WallClock
from talaria.errors import BadRequest
from talaria.session.gaps import GapPredictor
from talaria.session.hints import (
    MAX_EXPECTED_S,
    MAX_TOOL_NAME_LEN,
    MIN_EXPECTED_S,
    EventKind,
    HintCounters,
    HintEvent,
    HintStats,
)
from talaria.session.ids import check_session_id, new_session_id
from talaria.session.sender import HintSender

__all__ = ["SessionTracker"]


def _valid_id(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_session_id(value)


@attrs.frozen
class _Running:
    """A tool in flight: its name, gap key, start (clock seconds) and expected seconds."""

    tool: str
    key: str
    started_s: float
    expected_s: float


@attrs.define(eq=False)
class SessionTracker:
    """The client-side state of one session. Thread-safe (one lock per tracker).

    ``session_id``: given (checked: :func:`~talaria.session.ids.check_session_id`) or new.
    ``predictor``: shared or per session; default a fresh one from the packaged priors.
    ``hints``: where events go; ``None`` predicts and learns but sends nothing.
    ``clock``: measures tool spans in seconds (wall clock by default).
    """

    session_id: str = attrs.field(factory=new_session_id, validator=_valid_id)
    predictor: GapPredictor = attrs.field(factory=GapPredictor.default)
    hints: HintSender | None = None
    clock: Clock = attrs.field(factory=WallClock)
    _running: list[_Running] = attrs.field(init=False, factory=list, repr=False)
    _gap_started_s: float | None = attrs.field(init=False, default=None, repr=False)
    _ended: bool = attrs.field(init=False, default=False)
    _counters: HintCounters = attrs.field(init=False, factory=HintCounters, repr=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    # ------------------------------------------------------------------ tools
    def tool_started(self, tool: str, command: str | None = None) -> float:
        """A tool began: predict its duration, send ``tool_start``; returns the predicted
        seconds for this tool. ``command`` (a shell command) refines the tool kind. The
        event carries the tool name cut to ``MAX_TOOL_NAME_LEN`` characters."""
        if not isinstance(tool, str) or not tool.strip():
            raise BadRequest(f"tool must be a non-empty string, got {tool!r}")
        if command is not None and not isinstance(command, str):
            raise BadRequest(f"command must be a string or None, got {type(command).__name__}")
        key = self.predictor.key_for(tool, command)
        expected = self.predictor.predict(key)
        with self._lock:
            if self._ended:
                raise BadRequest(f"session {self.session_id!r} has ended; start a new session")
            now = self.clock.now()
            if not self._running:
                self._gap_started_s = now
            self._running.append(_Running(tool, key, now, expected))
            gap_left = max(r.started_s + r.expected_s for r in self._running) - now
            self._send(
                HintEvent(
                    self.session_id,
                    EventKind.TOOL_START,
                    tool=tool[:MAX_TOOL_NAME_LEN],
                    expected_s=min(max(gap_left, MIN_EXPECTED_S), MAX_EXPECTED_S),
                )
            )
        return expected

    def tool_ended(self, tool: str | None = None) -> float:
        """A tool finished: learn its duration, and send ``tool_end`` if no other tool is
        still running. Ends the earliest-started running tool named ``tool`` (any tool when
        ``None``). Returns its measured seconds. :class:`BadRequest` if no such tool runs."""
        with self._lock:
            match = next((r for r in self._running if tool is None or r.tool == tool), None)
            if match is None:
                running = [r.tool for r in self._running]
                raise BadRequest(
                    f"session {self.session_id!r}: no running tool "
                    f"{'' if tool is None else repr(tool) + ' '}to end (running: {running})"
                )
            now = self.clock.now()
            self._running.remove(match)
            measured = max(now - match.started_s, 0.0)
            self.predictor.observe(match.key, measured)
            if not self._running and self._gap_started_s is not None:
                gap = max(now - self._gap_started_s, 0.0)
                self._gap_started_s = None
                self._send(HintEvent(self.session_id, EventKind.TOOL_END, measured_s=gap))
        return measured

    # ------------------------------------------------------------------ session
    def end(self) -> None:
        """The session is over: send ``end`` (once; later calls do nothing). Tools still
        running are forgotten without training the predictor."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            self._running.clear()
            self._gap_started_s = None
            self._send(HintEvent(self.session_id, EventKind.END))

    @property
    def ended(self) -> bool:
        with self._lock:
            return self._ended

    @property
    def running(self) -> tuple[str, ...]:
        """Names of the tools in flight, oldest first."""
        with self._lock:
            return tuple(r.tool for r in self._running)

    def stats(self) -> HintStats:
        """This session's events sent, dropped and failed so far (delivery is asynchronous:
        call the sender's ``flush`` first for final counts)."""
        return self._counters.snapshot()

    def _send(self, event: HintEvent) -> None:
        """Queue ``event`` (under the lock, so a session's events keep their order)."""
        if self.hints is not None:
            self.hints.submit(event, self._counters)

    def __enter__(self) -> SessionTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    async def __aenter__(self) -> SessionTracker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.end()
