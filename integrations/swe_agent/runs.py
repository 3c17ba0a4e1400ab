"""``AgentSessions``: the Talaria session state of one agent, one session per agent run.

Both integrations of this package (mini-swe-agent's model class and SWE-agent's hook) keep
one of these per agent. It owns the current :class:`~talaria.session.SessionTracker`, starts
a new one for each agent run (:meth:`AgentSessions.begin_call` after :meth:`end_run`), and
reports tool gaps without ever raising or blocking: every hint goes through the
:class:`~talaria.session.HintSender`'s background queue, and a hint that cannot be given
(no call made yet in this session, session already ended, no such tool running) is skipped.

Session ids: the first run uses ``session_id`` when given (made wire-safe by
:func:`~talaria.session.normalize_session_id`), later runs ``f"{session_id}-{n}"``; without
one, every run gets a fresh ``sess-<uuid>``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import attrs

from talaria.errors import TalariaError
from talaria.session import (
    GapPredictor,
    HintSender,
    HintStats,
    SessionTracker,
    new_session_id,
    normalize_session_id,
)

__all__ = ["DEFAULT_BASE_URL", "AgentSessions", "SessionRecord"]

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
log = logging.getLogger(__name__)


@attrs.frozen
class SessionRecord:
    """One finished or current session of an agent: its id, calls made, and token counts
    reported by the server (``cached_tokens``: prompt tokens whose KV was reused)."""

    session_id: str
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def _optional_id(value: str | None) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return normalize_session_id(text) if text else None


@attrs.define(eq=False)
class AgentSessions:
    """Session ids and tool-gap hints of one agent across its runs. Thread-safe.

    ``hints``: where events go (``None``: predict and learn, send nothing). ``own_hints``:
    :meth:`close` also closes ``hints`` (set when this object created the sender).
    ``predictor``: shared across runs (and, if the caller passes one, across agents).
    ``session_id``: the first run's id, or ``None`` for generated ids.

    Nothing here raises because of the server: hints are queued and their failures are
    counted (:meth:`hint_stats`). The only state changes are the current tracker and the
    per-session counters.
    """

    hints: HintSender | None = None
    predictor: GapPredictor = attrs.field(factory=GapPredictor.default)
    session_id: str | None = attrs.field(default=None, converter=_optional_id)
    own_hints: bool = False
    _tracker: SessionTracker | None = attrs.field(init=False, default=None)
    _record: SessionRecord | None = attrs.field(init=False, default=None)
    _history: list[SessionRecord] = attrs.field(init=False, factory=list)
    _runs: int = attrs.field(init=False, default=0)
    _closed: bool = attrs.field(init=False, default=False)
    _lock: threading.RLock = attrs.field(init=False, factory=threading.RLock, repr=False)

    @classmethod
    def http(
        cls,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        session_id: str | None = None,
        predictor: GapPredictor | None = None,
        timeout_s: float = 0.5,
    ) -> AgentSessions:
        """Sessions whose hints go to the Talaria server at ``base_url`` (with or without a
        trailing ``/v1``) through a sender owned by the new object. No I/O here."""
        sender = HintSender.http(base_url, api_key=api_key, timeout_s=timeout_s)
        return cls(
            hints=sender,
            predictor=predictor or GapPredictor.default(),
            session_id=session_id,
            own_hints=True,
        )

    # ------------------------------------------------------------------ calls
    def begin_call(self) -> str:
        """An LLM call is about to be sent: returns the session id it must carry, starting
        a new session first if none is open (the first call of a run). Counts the call."""
        with self._lock:
            tracker = self._tracker
            if tracker is None or tracker.ended:
                tracker = self._start()
            assert self._record is not None
            self._record = attrs.evolve(self._record, calls=self._record.calls + 1)
            return tracker.session_id

    def record_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """Add one answered call's token counts to the current session's record."""
        with self._lock:
            r = self._record
            if r is None:
                return
            self._record = attrs.evolve(
                r,
                prompt_tokens=r.prompt_tokens + max(int(prompt_tokens), 0),
                completion_tokens=r.completion_tokens + max(int(completion_tokens), 0),
                cached_tokens=r.cached_tokens + max(int(cached_tokens), 0),
            )

    def _start(self) -> SessionTracker:
        """Open the next run's session (lock held)."""
        self._runs += 1
        if self.session_id is None:
            sid = new_session_id()
        else:
            sid = self.session_id if self._runs == 1 else f"{self.session_id}-{self._runs}"
            sid = normalize_session_id(sid)
        tracker = SessionTracker(session_id=sid, predictor=self.predictor, hints=self.hints)
        self._tracker = tracker
        self._record = SessionRecord(sid)
        return tracker

    # ------------------------------------------------------------------ tools
    def _live(self) -> SessionTracker | None:
        """The current tracker if hints make sense for it: it made a call and has not ended
        (the server does not know a session before its first call). Lock held."""
        t, r = self._tracker, self._record
        if t is None or r is None or r.calls == 0 or t.ended:
            return None
        return t

    def tool_started(self, tool: str, command: str | None = None) -> float | None:
        """A tool began in the current session: sends ``tool_start`` with the predicted
        seconds and returns them; ``None`` (nothing sent) when no session is live or the
        input is unusable. Never raises."""
        with self._lock:
            tracker = self._live()
            if tracker is None:
                return None
            try:
                return tracker.tool_started(tool, command=command)
            except TalariaError as e:
                log.debug("talaria tool_start skipped: %s", e)
                return None

    def tool_ended(self, tool: str | None = None) -> float | None:
        """The earliest running tool named ``tool`` (any when ``None``) finished: the tracker
        learns its span and sends ``tool_end`` once no tool runs. Returns the measured
        seconds, or ``None`` when no such tool runs. Never raises."""
        with self._lock:
            tracker = self._tracker
            if tracker is None or tracker.ended or not tracker.running:
                return None
            try:
                return tracker.tool_ended(tool)
            except TalariaError as e:
                log.debug("talaria tool_end skipped: %s", e)
                return None

    def end_tools(self) -> None:
        """End every tool still running in the current session (each sends its part of the
        gap; the last one sends ``tool_end``). Never raises."""
        with self._lock:
            while self.running_tools:
                if self.tool_ended() is None:
                    return

    @property
    def running_tools(self) -> tuple[str, ...]:
        with self._lock:
            t = self._tracker
            return () if t is None or t.ended else t.running

    # ------------------------------------------------------------------ runs
    def end_run(self) -> SessionRecord | None:
        """The agent run is over: send ``end`` for its session (only if it made a call) and
        forget it; the next :meth:`begin_call` opens a new session. Idempotent; returns the
        ended session's record (``None`` if none was open)."""
        with self._lock:
            tracker, record = self._tracker, self._record
            self._tracker = None
            self._record = None
            if tracker is None or record is None:
                return None
            if record.calls > 0 and not tracker.ended:
                tracker.end()
            self._history.append(record)
            return record

    def close(self, timeout_s: float = 1.0) -> None:
        """End the current run and, if this object owns its sender, deliver what is queued
        for up to ``timeout_s`` seconds and stop the sender. Idempotent; never raises."""
        with self._lock:
            self.end_run()
            if self._closed:
                return
            self._closed = True
            hints = self.hints if self.own_hints else None
        if hints is not None:
            try:
                hints.close(timeout_s)
            except Exception:  # closing must not fail an agent's shutdown
                log.debug("talaria hint sender did not close cleanly", exc_info=True)

    def flush(self, timeout_s: float = 1.0) -> bool:
        """Wait up to ``timeout_s`` seconds for queued hints; True if none is left."""
        return True if self.hints is None else self.hints.flush(timeout_s)

    # ------------------------------------------------------------------ reading
    @property
    def current_session_id(self) -> str | None:
        """The open session's id, or ``None`` between runs."""
        with self._lock:
            return None if self._tracker is None else self._tracker.session_id

    @property
    def current(self) -> SessionRecord | None:
        with self._lock:
            return self._record

    def sessions(self) -> list[SessionRecord]:
        """Every session of this agent so far, oldest first (the open one last)."""
        with self._lock:
            return [*self._history, *([self._record] if self._record is not None else [])]

    def hint_stats(self) -> HintStats:
        """Hints sent, dropped and failed by this object's sender (all its sessions)."""
        return HintStats() if self.hints is None else self.hints.stats()

    def summary(self) -> dict[str, Any]:
        """A JSON-able view for trajectories: current session id, sessions, hint counts."""
        stats = self.hint_stats()
        return {
            "session_id": self.current_session_id,
            "sessions": [attrs.asdict(r) for r in self.sessions()],
            "hints": attrs.asdict(stats),
        }
