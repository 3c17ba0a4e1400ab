"""The tool gaps an instance knows of: sessions it served last that are off running a tool.

A gap starts when a session's call finishes here and ends when its next call arrives (here
or elsewhere), when it ends, or when its gap reasoning faults. The table keeps each model's
gaps in the order they started, so the session-aware slot order can read the newest first
and stop at its horizon. Hints update a gap's expected length and the tool it named.

Not thread-safe: the instance core's single driver owns it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs

from talaria.types import SessionKey


@attrs.define
class ToolGap:
    """One session's current gap: which model served it, since when, and what a hint said."""

    model: str
    since_s: float
    expected_s: float | None  # a hint's (or the server's guess of) the tool's length
    tool: str | None = None  # the tool a hint named


class GapTable:
    """Open tool gaps by session, and the same gaps per model in order of their start."""

    def __init__(self, models: Iterable[str]) -> None:
        self._by_session: dict[SessionKey, ToolGap] = {}
        self._by_model: dict[str, dict[SessionKey, ToolGap]] = {m: {} for m in models}

    def get(self, session: SessionKey) -> ToolGap | None:
        return self._by_session.get(session)

    def __contains__(self, session: object) -> bool:
        return session in self._by_session

    def __getitem__(self, session: SessionKey) -> ToolGap:
        return self._by_session[session]

    def count(self, model: str) -> int:
        """Sessions of ``model`` in a gap."""
        return len(self._by_model[model])

    def of_model(self, model: str) -> Iterator[tuple[SessionKey, ToolGap]]:
        """``model``'s gaps, oldest first."""
        return iter(self._by_model[model].items())

    def newest_first(self, model: str) -> Iterator[tuple[SessionKey, ToolGap]]:
        """``model``'s gaps, newest first."""
        return reversed(self._by_model[model].items())  # no lookup per gap

    def start(self, session: SessionKey, gap: ToolGap) -> None:
        """Record a gap that starts now (any earlier gap of the session is over)."""
        self.end(session)
        self._by_session[session] = gap
        self._by_model[gap.model][session] = gap

    def end(self, session: SessionKey) -> None:
        """The session's gap, if any, is over."""
        gap = self._by_session.pop(session, None)
        if gap is not None:
            del self._by_model[gap.model][session]

    def problems(self) -> list[str]:
        """A line for each model whose index disagrees with the per-session table."""
        out = []
        for m, gaps in self._by_model.items():
            mine = {s for s, g in self._by_session.items() if g.model == m}
            if mine != set(gaps):
                out.append(f"{m}: gap index {sorted(gaps)} != {sorted(mine)}")
        return out
