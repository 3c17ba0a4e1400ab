"""When one model's sessions in tool gaps are expected back, without pricing every gap.

The session-aware slot order asks, on every scheduling decision, for two figures per model:
the soonest expected return of a session in a tool gap (its median remaining gap, from
:meth:`GapModel.expected_remaining_s`) and how many are expected back within the slot's
linger. A scan prices every gap: on a pool instance holding 150 sessions in gaps that is
150 log-normal quantiles per model per decision. ``ReturnIndex`` answers the same two
figures from a few.

Why that is exact. Gaps of one model with the same ``expected_s`` (a hint per tool kind, or
none) differ only in when they started, and for a log-normal gap the
median remaining time is *valley-shaped* in the elapsed time: it falls from the median
until some elapsed ``e*`` (about 0.34 medians at sigma 1) and rises after it (for sigma
past about 4 it only rises). ``tests/core/test_returns.py`` checks the shape of the
evaluated floats over the model's whole domain. So, with a group's gaps sorted by start
(by elapsed time, descending):

- the soonest return is found by walking out from the gap nearest ``e*`` in both
  directions until the values rise: a few evaluations;
- the gaps back within the linger ``L`` (remaining <= L) form one run of consecutive gaps
  around that minimum, whose ends lie near the elapsed times where the curve crosses ``L``;
  both crossings are solved once per (gap model, ``expected_s``, linger) and cached, and the run's
  ends are then checked, and moved, gap by gap with the same evaluation the scan makes.

Every figure is a minimum or a count of the very floats the scan computes, so the answers
are equal to the scan's, not close to them. A gap model that raises for a gap (the scan's
caller isolates that session) makes ``returns`` answer None: the caller scans instead.

Not thread-safe: the instance core's single driver owns it (through ``GapTable``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping

import attrs

from talaria.policy.gaps import DECAY_CAP_S, GapModel
from talaria.types import SessionKey

# Relative slack of "the values still fall": the curve is flat at its minimum, where the
# evaluated floats may wobble by an ulp or two; far above that, far below any real rise.
_FLAT = 1e-12
_CACHE_MAX = 4096  # (gap model, expected_s, linger) entries before the cache starts afresh


@attrs.frozen
class _Shape:
    """Where one median's curve has its minimum and crosses the linger: elapsed seconds
    (``lo > hi`` when it never dips to the linger)."""

    bottom_s: float
    lo_s: float
    hi_s: float


def _shape(remaining: Callable[[float], float], median: float, linger: float) -> _Shape:
    """The curve's minimum (golden section on the log of the elapsed time) and its
    crossings of ``linger`` (bisection on each side). Estimates: the walks correct them."""
    lo, hi = math.log(median) - 60.0, math.log(median) + 60.0
    g = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(120):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if remaining(math.exp(a)) <= remaining(math.exp(b)):
            hi = b
        else:
            lo = a
    bottom = math.exp(lo)
    if remaining(bottom) > linger:
        return _Shape(bottom, math.inf, -math.inf)
    if remaining(0.0) <= linger:
        first = 0.0
    else:
        first = _crossing(remaining, linger, bottom * 1e-30, bottom, rising=False)
    top = max(bottom, median, linger)
    while remaining(top) <= linger and top < DECAY_CAP_S:
        top = min(2.0 * top, DECAY_CAP_S)
    last = top if remaining(top) <= linger else _crossing(remaining, linger, bottom, top, True)
    return _Shape(bottom, first, last)


def _crossing(
    remaining: Callable[[float], float], linger: float, lo: float, hi: float, rising: bool
) -> float:
    """The elapsed time in ``[lo, hi]`` where ``remaining`` crosses ``linger`` (bisection on
    the logarithm; ``rising`` says which side of the minimum)."""
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if not lo < mid < hi:
            break
        if (remaining(mid) <= linger) == rising:
            lo = mid
        else:
            hi = mid
    return hi if not rising else lo


@attrs.define(eq=False)
class _Group:
    """One model's gaps with one ``expected_s``: their starts, sorted, and whose they are."""

    starts: list[float] = attrs.field(factory=list)
    sessions: list[SessionKey] = attrs.field(factory=list)

    def add(self, since_s: float, session: SessionKey) -> None:
        i = bisect.bisect_right(self.starts, since_s)
        self.starts.insert(i, since_s)
        self.sessions.insert(i, session)

    def remove(self, since_s: float, session: SessionKey) -> None:
        i = bisect.bisect_left(self.starts, since_s)
        while self.sessions[i] != session:
            i += 1
        del self.starts[i]
        del self.sessions[i]


class ReturnIndex:
    """One model's gaps grouped by ``expected_s`` (see the module docstring)."""

    def __init__(self) -> None:
        self._groups: dict[float | None, _Group] = {}
        self._shapes: dict[tuple[GapModel, float | None, float], _Shape] = {}

    def __len__(self) -> int:
        return sum(len(g.starts) for g in self._groups.values())

    def add(self, expected_s: float | None, since_s: float, session: SessionKey) -> None:
        self._groups.setdefault(expected_s, _Group()).add(since_s, session)

    def remove(self, expected_s: float | None, since_s: float, session: SessionKey) -> None:
        group = self._groups[expected_s]
        group.remove(since_s, session)
        if not group.starts:
            del self._groups[expected_s]

    def problems(self, gaps: Mapping[SessionKey, tuple[float | None, float]]) -> list[str]:
        """A line for each disagreement with ``gaps`` (session -> its ``expected_s`` and
        start) and for each group out of order."""
        held = {
            session: (expected_s, since_s)
            for expected_s, group in self._groups.items()
            for since_s, session in zip(group.starts, group.sessions, strict=True)
        }
        out = []
        if held != dict(gaps) or len(self) != len(held):
            out.append(f"return index holds {held}, the gaps are {dict(gaps)}")
        for expected_s, group in self._groups.items():
            if group.starts != sorted(group.starts) or not group.starts:
                out.append(f"return index group {expected_s}: starts {group.starts} not sorted")
        return out

    def returns(self, now: float, model: GapModel, linger: float) -> tuple[float, int] | None:
        """(the soonest expected return, the gaps expected back within ``linger``) of the
        gaps held, exactly as a scan of them computes; None where the gap model raised for
        some gap (scan to isolate it). The soonest of no gaps is ``math.inf``."""
        soonest, returning = math.inf, 0
        try:
            for expected_s, group in self._groups.items():
                left = _Evaluator(model, expected_s, group.starts, now)
                shape = self._shape(model, expected_s, linger, left)
                best, at = left.minimum(now - shape.bottom_s)
                soonest = min(soonest, best)
                if best <= linger:
                    returning += left.run_length(at, linger, now - shape.hi_s, now - shape.lo_s)
        except Exception:
            return None
        return soonest, returning

    def _shape(
        self, model: GapModel, expected_s: float | None, linger: float, left: _Evaluator
    ) -> _Shape:
        key = (model, expected_s, linger)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= _CACHE_MAX:
                self._shapes.clear()
            median = model.median_s(expected_s)
            shape = self._shapes[key] = _shape(left.of_elapsed, median, linger)
        return shape


class _Evaluator:
    """One group's remaining times at ``now``, evaluated as a scan evaluates them."""

    def __init__(
        self, model: GapModel, expected_s: float | None, starts: list[float], now: float
    ) -> None:
        self.model, self.expected_s, self.starts, self.now = model, expected_s, starts, now

    def of_elapsed(self, elapsed_s: float) -> float:
        return self.model.expected_remaining_s(elapsed_s, self.expected_s)

    def at(self, i: int) -> float:
        return self.model.expected_remaining_s(self.now - self.starts[i], self.expected_s)

    def minimum(self, bottom_since_s: float) -> tuple[float, int]:
        """The least remaining time and a gap that has it: from the gaps either side of the
        start that is ``e*`` ago, walking outwards while the values fall (within ``_FLAT``)."""
        starts = self.starts
        split = bisect.bisect_left(starts, bottom_since_s)
        best, at = math.inf, -1
        for i, step in ((split - 1, -1), (split, 1)):
            prev = math.inf
            while 0 <= i < len(starts):
                value = self.at(i)
                if value > prev * (1.0 + _FLAT):
                    break
                if value < best:
                    best, at = value, i
                prev = value
                i += step
        return best, at

    def run_length(self, at: int, linger: float, first_since_s: float, last_since_s: float) -> int:
        """How many gaps, in the run around gap ``at`` (which is back within ``linger``),
        are back within ``linger``: the run's ends start from the crossings' estimates and
        move, gap by gap, until the gap inside is back and the one outside is not."""
        n = len(self.starts)
        lo = min(bisect.bisect_left(self.starts, first_since_s), at)
        hi = max(bisect.bisect_right(self.starts, last_since_s) - 1, at)
        while self.at(lo) > linger:
            lo += 1
        while lo > 0 and self.at(lo - 1) <= linger:
            lo -= 1
        while self.at(hi) > linger:
            hi -= 1
        while hi < n - 1 and self.at(hi + 1) <= linger:
            hi += 1
        return hi - lo + 1
