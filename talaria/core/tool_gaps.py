"""The tool gaps an instance knows of: sessions it served last that are off running a tool.

A gap starts when a session's call finishes here and ends when its next call arrives (here
or elsewhere), when it ends, or when its gap reasoning faults. The table keeps each model's
gaps in the order they started, so the session-aware slot order can read the newest first
and stop at its horizon. Hints update a gap's expected length and the tool it named.

The slot order asks, on every scheduling decision, how many calls the sessions whose gap
started within its horizon have answered here (:meth:`GapTable.recent_calls_done`): kept
incrementally per model (a count of gaps by calls done, and the gaps in start order to
retire once the horizon passes them), so the answer costs the distinct counts, not a scan
of every session in a gap.

The soonest expected return of each model's gaps and how many are due within the slot's
linger are answered by a :class:`ReturnIndex` per model, kept on every start, end and hint
(so a gap's ``expected_s`` changes through :meth:`GapTable.set_expected` alone).

Not thread-safe: the instance core's single driver owns it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Mapping

import attrs

from talaria.core.returns import ReturnIndex
from talaria.policy.gaps import GapModel
from talaria.types import SessionKey


@attrs.define
class ToolGap:
    """One session's current gap: which model served it, since when, and what a hint said."""

    model: str
    since_s: float
    expected_s: float | None  # a hint's (or the server's guess of) the tool's length; set it
    # through ``GapTable.set_expected`` while the gap is in a table
    tool: str | None = None  # the tool a hint named
    calls_done: int = 0  # the session's calls answered here when the gap started
    recent: bool = attrs.field(default=False, eq=False)  # counted in its model's window


class _Window:
    """One model's gaps that started at or after ``horizon_s``, counted by calls done."""

    def __init__(self) -> None:
        self.horizon_s = float("-inf")
        self.order: collections.deque[ToolGap] = collections.deque()  # by start (stale too)
        self.counts: collections.Counter[int] = collections.Counter()

    def add(self, gap: ToolGap) -> None:
        if gap.since_s >= self.horizon_s:
            gap.recent = True
            self.order.append(gap)
            self.counts[gap.calls_done] += 1
            if len(self.order) > 64 + 2 * self.counts.total():  # mostly ended gaps: compact
                self.order = collections.deque(g for g in self.order if g.recent)

    def drop(self, gap: ToolGap) -> None:
        if gap.recent:
            gap.recent = False
            self.counts[gap.calls_done] -= 1
            if not self.counts[gap.calls_done]:
                del self.counts[gap.calls_done]

    def advance(self, horizon_s: float) -> None:
        """Retire the gaps that started before ``horizon_s`` (it only moves forward)."""
        self.horizon_s = horizon_s
        order = self.order
        while order and (order[0].since_s < horizon_s or not order[0].recent):
            self.drop(order.popleft())


class GapTable:
    """Open tool gaps by session, and the same gaps per model in order of their start."""

    def __init__(self, models: Iterable[str]) -> None:
        self._by_session: dict[SessionKey, ToolGap] = {}
        self._by_model: dict[str, dict[SessionKey, ToolGap]] = {m: {} for m in models}
        self._recent: dict[str, _Window] = {m: _Window() for m in self._by_model}
        self._gapped: collections.Counter[str] = collections.Counter()  # gaps per model
        self._returns: dict[str, ReturnIndex] = {m: ReturnIndex() for m in self._by_model}
        self.changes = 0  # gaps started and ended so far: equal counts, equal tables

    def get(self, session: SessionKey) -> ToolGap | None:
        return self._by_session.get(session)

    def __contains__(self, session: object) -> bool:
        return session in self._by_session

    def __getitem__(self, session: SessionKey) -> ToolGap:
        return self._by_session[session]

    def count(self, model: str) -> int:
        """Sessions of ``model`` in a gap."""
        return len(self._by_model[model])

    def models(self) -> Iterable[str]:
        """The models with a session in a gap (a view: do not mutate the table while
        iterating it)."""
        return self._gapped.keys()

    def of_model(self, model: str) -> Iterator[tuple[SessionKey, ToolGap]]:
        """``model``'s gaps, oldest first."""
        return iter(self._by_model[model].items())

    def newest_first(self, model: str) -> Iterator[tuple[SessionKey, ToolGap]]:
        """``model``'s gaps, newest first."""
        return reversed(self._by_model[model].items())  # no lookup per gap

    def recent_calls_done(self, model: str, since_s: float) -> Mapping[int, int]:
        """Calls done -> how many of ``model``'s gaps that started at or after ``since_s``
        are of sessions that had answered that many calls here (the newest-first scan of
        :meth:`newest_first` down to ``since_s``, kept incrementally). A ``since_s`` before
        an earlier query's is answered by that scan."""
        window = self._recent[model]
        if since_s < window.horizon_s:
            counts: collections.Counter[int] = collections.Counter()
            for _, gap in self.newest_first(model):
                if gap.since_s < since_s:
                    break
                counts[gap.calls_done] += 1
            return counts
        window.advance(since_s)
        return window.counts

    def returns(
        self, model: str, now: float, gaps: GapModel, linger_s: float
    ) -> tuple[float, int] | None:
        """(``model``'s soonest expected return, its gaps expected back within
        ``linger_s``), exactly as pricing each of its gaps with ``gaps`` computes them
        (``math.inf`` and 0 for none); None where ``gaps`` raised for one (price them one by
        one to find it). See :mod:`talaria.core.returns`."""
        return self._returns[model].returns(now, gaps, linger_s)

    def set_expected(self, session: SessionKey, expected_s: float | None) -> None:
        """A hint re-values the session's gap (no gap: nothing)."""
        gap = self._by_session.get(session)
        if gap is not None:
            index = self._returns[gap.model]
            index.remove(gap.expected_s, gap.since_s, session)
            gap.expected_s = expected_s
            index.add(expected_s, gap.since_s, session)

    def start(self, session: SessionKey, gap: ToolGap) -> None:
        """Record a gap that starts now (any earlier gap of the session is over)."""
        self.end(session)
        self._by_session[session] = gap
        self._by_model[gap.model][session] = gap
        self._gapped[gap.model] += 1
        self._recent[gap.model].add(gap)
        self._returns[gap.model].add(gap.expected_s, gap.since_s, session)
        self.changes += 1

    def end(self, session: SessionKey) -> None:
        """The session's gap, if any, is over."""
        gap = self._by_session.pop(session, None)
        if gap is not None:
            del self._by_model[gap.model][session]
            self._gapped[gap.model] -= 1
            if not self._gapped[gap.model]:
                del self._gapped[gap.model]
            self._recent[gap.model].drop(gap)
            self._returns[gap.model].remove(gap.expected_s, gap.since_s, session)
            self.changes += 1

    def problems(self) -> list[str]:
        """A line for each model whose index disagrees with the per-session table, or whose
        recent-gap counts disagree with the gaps recounted."""
        out = []
        gapped = collections.Counter(g.model for g in self._by_session.values())
        if gapped != self._gapped:
            out.append(f"gaps per model {dict(self._gapped)} counted, {dict(gapped)} held")
        for m, gaps in self._by_model.items():
            mine = {s for s, g in self._by_session.items() if g.model == m}
            if mine != set(gaps):
                out.append(f"{m}: gap index {sorted(gaps)} != {sorted(mine)}")
            window = self._recent[m]
            counts = collections.Counter(
                g.calls_done for g in gaps.values() if g.since_s >= window.horizon_s
            )
            if counts != window.counts:
                out.append(
                    f"{m}: recent gaps by calls done {dict(window.counts)} != {dict(counts)}"
                )
            held = {s: (g.expected_s, g.since_s) for s, g in gaps.items()}
            out.extend(f"{m}: {line}" for line in self._returns[m].problems(held))
        return out
