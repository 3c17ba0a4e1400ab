"""``TalariaCallbackHandler``: LangChain tool runs become Talaria tool-gap hints.

A tool run (``on_tool_start`` ... ``on_tool_end`` / ``on_tool_error``) is reported through
the :class:`~talaria.session.SessionTracker` of its session: ``tool_start`` with the
predicted seconds when it starts, ``tool_end`` with the measured gap when the last running
tool of the session ends. Delivery is the tracker's: queued, in the background, never
blocking and never raising into the agent.

The session of a tool run is, in order:

1. ``session_id`` / ``thread_id`` in the run's metadata (LangGraph copies ``thread_id``
   there; with plain LangChain, ``config={"metadata": {"session_id": ...}}``);
2. the session of the model answer that asked for it, matched by tool call id (a
   ``ChatTalaria`` run records its session in its run metadata, wherever the id came from,
   e.g. ``configurable.thread_id``; the handler must see that model run);
3. the session of its parent run (the chain or agent step that called it; a parent learns
   its session from any child run that carries one);
4. the handler's ``session_id``.

A tool run with no session sends nothing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from talaria.errors import BadRequest
from talaria.session import (
    GapPredictor,
    HintSender,
    SessionTracker,
    normalize_session_id,
    session_id_from_langchain,
)

__all__ = ["TalariaCallbackHandler"]

log = logging.getLogger(__name__)
DEFAULT_MAX_RUNS = 10_000


class TalariaCallbackHandler(BaseCallbackHandler):
    """Sends tool-gap hints for the tool runs it sees (see the module docstring).

        ``base_url``: the Talaria server (``http://host:port``) hints are posted to, or
        ``hints``: a :class:`~talaria.session.HintSender` of your own (then ``close`` leaves it
        open). ``predictor``: the gap predictor shared by this handler's sessions (default: one
        from the packaged priors, made on first use). ``session_id``: the session of runs that
        carry none. ``max_runs``: how many runs, tool call ids and sessions are remembered
    (the oldest are forgotten).

        Thread-safe; its callbacks run inline (they never block).
    """

    run_inline = True
    raise_error = False

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        hints: HintSender | None = None,
        predictor: GapPredictor | None = None,
        session_id: str | None = None,
        max_runs: int = DEFAULT_MAX_RUNS,
    ) -> None:
        if (base_url is None) == (hints is None):
            raise ValueError("give exactly one of base_url (a Talaria server) and hints")
        if max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, got {max_runs}")
        self._owns_hints = hints is None
        self.hints = hints if hints is not None else HintSender.http(str(base_url), api_key=api_key)
        self._predictor = predictor
        self.session_id = normalize_session_id(session_id) if session_id else None
        self._max_runs = max_runs
        self._lock = threading.Lock()
        self._trackers: OrderedDict[str, SessionTracker] = OrderedDict()
        # run id -> (its session id, its parent run id), oldest first
        self._runs: OrderedDict[UUID, tuple[str | None, UUID | None]] = OrderedDict()
        self._tools: dict[UUID, tuple[SessionTracker, str]] = {}
        # tool call id (from a model answer) -> the session of that answer, oldest first
        self._calls: OrderedDict[str, str] = OrderedDict()

    # ------------------------------------------------------------------ sessions
    def tracker(self, session_id: str) -> SessionTracker:
        """The tracker of ``session_id`` (made on first use, then kept until :meth:`end`)."""
        with self._lock:
            return self._tracker(session_id)

    def _tracker(self, session_id: str) -> SessionTracker:
        """Called with the lock held. Keeps at most ``max_runs`` trackers: the least
        recently used is forgotten (without an ``end``; the server expires it when idle)."""
        tracker = self._trackers.get(session_id)
        if tracker is None:
            if self._predictor is None:
                self._predictor = GapPredictor.default()
            tracker = SessionTracker(
                session_id=session_id, predictor=self._predictor, hints=self.hints
            )
            self._trackers[session_id] = tracker
            while len(self._trackers) > self._max_runs:
                self._trackers.popitem(last=False)
        self._trackers.move_to_end(session_id)
        return tracker

    def end(self, session_id: str | None = None) -> None:
        """Send ``end`` for ``session_id`` (all sessions seen when None) and forget it."""
        with self._lock:
            ids = list(self._trackers) if session_id is None else [session_id]
            trackers = [self._trackers.pop(i) for i in ids if i in self._trackers]
        for tracker in trackers:
            tracker.end()

    def flush(self, timeout_s: float = 1.0) -> bool:
        """Wait up to ``timeout_s`` for queued hints to be delivered (tests, shutdown)."""
        return self.hints.flush(timeout_s)

    def close(self, timeout_s: float = 1.0) -> None:
        """Deliver what is queued (up to ``timeout_s``) and close a sender this handler made."""
        if self._owns_hints:
            self.hints.close(timeout_s)
        else:
            self.hints.flush(timeout_s)

    def _remember(
        self,
        run_id: UUID,
        parent_run_id: UUID | None,
        metadata: Mapping[str, Any] | None,
        tool_call_id: object = None,
    ) -> str | None:
        """Record and return the session of a run (see the module docstring). A session
        found in the run's own metadata is also given to its known ancestors that have
        none yet, so that a later sibling (a tool run of the same agent step) finds it."""
        with self._lock:
            own = session_id_from_langchain(metadata) if metadata else None
            sid = own
            if sid is None and isinstance(tool_call_id, str):
                sid = self._calls.get(tool_call_id)
            if sid is None and parent_run_id is not None:
                sid = self._runs.get(parent_run_id, (None, None))[0]
            self._runs[run_id] = (sid, parent_run_id)  # the default is not inherited
            self._runs.move_to_end(run_id)
            ancestor = parent_run_id
            while own is not None and ancestor is not None and ancestor in self._runs:
                session, grandparent = self._runs[ancestor]
                if session is not None:
                    break
                self._runs[ancestor] = (own, grandparent)
                ancestor = grandparent
            while len(self._runs) > self._max_runs:
                self._runs.popitem(last=False)
            return sid if sid is not None else self.session_id

    def _forget(self, run_id: UUID) -> None:
        with self._lock:
            self._runs.pop(run_id, None)

    # ------------------------------------------------------------------ runs
    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._remember(run_id, parent_run_id, metadata)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._forget(run_id)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._forget(run_id)

    def on_chat_model_start(
        self,
        serialized: dict[str, Any] | None,
        messages: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._remember(run_id, parent_run_id, metadata)

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """Remember the session of each tool call in the answer (by tool call id), for
        tool runs that carry no session of their own."""
        with self._lock:
            sid = self._runs.pop(run_id, (None, None))[0]
            if sid is None:
                return
            for call_id in _tool_call_ids(response):
                self._calls[call_id] = sid
                self._calls.move_to_end(call_id)
            while len(self._calls) > self._max_runs:
                self._calls.popitem(last=False)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._forget(run_id)

    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Send ``tool_start`` for the run's session (see the module docstring)."""
        sid = self._remember(run_id, parent_run_id, metadata, kwargs.get("tool_call_id"))
        if sid is None:
            log.debug("tool run %s has no session id; no hint sent", run_id)
            return
        name = _tool_name(serialized, kwargs)
        try:
            with self._lock:
                tracker = self._tracker(sid)
            tracker.tool_started(name, command=_command(inputs))
        except BadRequest as exc:  # e.g. the session was ended: never the agent's problem
            log.debug("no tool_start hint for %s: %s", sid, exc)
            return
        with self._lock:
            self._tools[run_id] = (tracker, name)

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """Send ``tool_end`` when the session's last running tool ends."""
        self._tool_done(run_id)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        """A failed tool ends its gap too."""
        self._tool_done(run_id)

    def _tool_done(self, run_id: UUID) -> None:
        with self._lock:
            found = self._tools.pop(run_id, None)
            self._runs.pop(run_id, None)
        if found is None:
            return
        tracker, name = found
        try:
            tracker.tool_ended(name)
        except BadRequest as exc:
            log.debug("no tool_end hint for %s: %s", tracker.session_id, exc)


def _tool_call_ids(response: Any) -> list[str]:
    """The ids of the tool calls in an ``LLMResult`` of a chat model."""
    ids = []
    for generations in getattr(response, "generations", None) or ():
        for generation in generations:
            message = getattr(generation, "message", None)
            for call in getattr(message, "tool_calls", None) or ():
                call_id = call.get("id") if isinstance(call, Mapping) else None
                if isinstance(call_id, str) and call_id:
                    ids.append(call_id)
    return ids


def _tool_name(serialized: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> str:
    for value in ((serialized or {}).get("name"), kwargs.get("name")):
        if isinstance(value, str) and value.strip():
            return value.strip()
    return "tool"


def _command(inputs: Mapping[str, Any] | None) -> str | None:
    """A shell command in the tool's input, if it has one (it refines the gap prediction)."""
    for key in ("command", "cmd", "commands", "bash", "shell"):
        value = (inputs or {}).get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None
