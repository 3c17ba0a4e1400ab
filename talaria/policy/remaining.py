"""How much work a model's sessions still need: the session-aware slot order's estimate.

A session's number of calls is unknown until it ends. ``SessionLengths`` learns it online
from the sessions that ended on this instance (never from a replay's future): the expected
number of calls left for a session that has made ``done`` calls is the mean of
``n - done`` over the ended sessions with ``n > done``. Until ``min_ended`` sessions have
ended, and for a ``done`` no ended session passed, it assumes nothing distinguishes a session
that has run from one that has not: one call left each ("new is no better than used", so the
open slot's sessions are never presumed longer than fresh ones). ``CallCost`` keeps the mean
measured service seconds of a model's calls (admission to answer), seeded by a prior:
exponentially weighted for the open batch's drain (what the next calls will take), and the
plain mean of the last ``COST_WINDOW`` calls for remaining work (what a session's calls take
over its life: one long answer, the last measured before a slot closes, must not reprice a
model's whole remaining work until its next slot).

Pure: plain numbers in, plain numbers out. Mutated only by ``observe``.
"""

from __future__ import annotations

import bisect
import collections
import math

import attrs

from talaria.errors import ConfigError

MIN_ENDED = 5  # ended sessions before their lengths are trusted over the prior
MAX_ENDED = 4096  # ended sessions remembered (the most recent)
COST_ALPHA = 0.2  # weight of each new measured call in the mean service time
COST_WINDOW = 4096  # calls in a windowed mean (as many as ended sessions remembered)
PRIOR_OUTPUT_TOKENS = 128  # answer length assumed before a model's first call finishes


@attrs.define
class SessionLengths:
    """Calls per ended session (sorted), and the expected calls left given calls done."""

    min_ended: int = MIN_ENDED
    _ended: list[int] = attrs.field(factory=list)  # sorted ascending
    _order: list[int] = attrs.field(factory=list)  # insertion order, to drop the oldest
    _left: dict[int, float] = attrs.field(factory=dict)  # expected_left by calls done

    def __attrs_post_init__(self) -> None:
        if self.min_ended < 1:
            raise ConfigError(f"min_ended must be >= 1, got {self.min_ended}")

    def observe(self, calls: int) -> None:
        """A session ended after ``calls`` calls (ignored when < 1)."""
        if calls < 1:
            return
        if len(self._order) >= MAX_ENDED:
            old = self._order.pop(0)
            del self._ended[bisect.bisect_left(self._ended, old)]
        self._order.append(calls)
        bisect.insort(self._ended, calls)
        self._left.clear()

    @property
    def n_ended(self) -> int:
        return len(self._ended)

    def expected_left(self, done: int) -> float:
        """Expected calls still to come for a session that has made ``done`` calls (>= 1).
        Memoized per ``done`` until the next ``observe`` (the slot order asks it for every
        session on every scheduling decision)."""
        if len(self._ended) < self.min_ended:
            return 1.0
        cached = self._left.get(done)
        if cached is None:
            longer = self._ended[bisect.bisect_right(self._ended, done) :]
            cached = max(1.0, sum(longer) / len(longer) - done) if longer else 1.0
            self._left[done] = cached
        return cached


@attrs.define
class CallCost:
    """Mean measured service seconds per call, per model: exponentially weighted
    (``COST_ALPHA``), or with ``window`` the plain mean of the model's last ``window`` calls."""

    prior_s: dict[str, float]
    window: int | None = None
    _mean: dict[str, float] = attrs.field(factory=dict)
    _recent: dict[str, collections.deque[float]] = attrs.field(factory=dict)
    _sum: dict[str, float] = attrs.field(factory=dict)  # of ``_recent``: O(1) per call
    _count: dict[str, int] = attrs.field(factory=dict)  # calls observed, per model

    def __attrs_post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ConfigError(f"window must be >= 1 call, got {self.window}")

    def observe(self, model: str, seconds: float) -> None:
        if not seconds >= 0.0 or seconds == float("inf"):
            return
        if self.window is None:
            old = self._mean.get(model)
            self._mean[model] = seconds if old is None else old + COST_ALPHA * (seconds - old)
            return
        recent = self._recent.setdefault(model, collections.deque(maxlen=self.window))
        total = self._sum.get(model, 0.0) + seconds
        if len(recent) == self.window:
            total -= recent[0]  # the call the append below drops
        recent.append(seconds)
        if self._count.get(model, 0) % self.window == 0:
            total = math.fsum(recent)  # exact once a window, so rounding never accumulates
        self._count[model] = self._count.get(model, 0) + 1
        self._sum[model] = total
        self._mean[model] = max(0.0, total / len(recent))

    def of(self, model: str) -> float:
        """The measured mean; for a model not measured yet, its prior scaled by how the
        measured models compare with their priors (so measured and unmeasured models are
        priced alike: calls run longer than one answer's decode, for every model)."""
        mean = self._mean.get(model)
        if mean is not None:
            return mean
        prior = self.prior_s.get(model, 0.0)
        ratios = [m / p for k, m in self._mean.items() if (p := self.prior_s.get(k, 0.0)) > 0]
        if not ratios:
            return prior
        return prior * sum(ratios) / len(ratios)
