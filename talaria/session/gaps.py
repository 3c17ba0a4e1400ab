"""Tool-gap prediction: how long the tool a session just started will run, in seconds.

One estimate per gap key (a tool kind, or ``"other:<tool name>"``; see
:func:`~talaria.session.kinds.gap_key`), seeded from the kind's prior median and updated by an
exponentially weighted moving average of the observed durations.

The default is the robust variant that ``benchmarks/gap_prediction.py`` selects on the real
traces: the average is taken in log space (a weighted geometric mean, which tracks the
median of a skewed distribution) and each observation is first clipped to within a factor
``clip_ratio`` of the current estimate, so one 60-second outlier among 0.3-second commands
moves the estimate by at most ``clip_ratio ** alpha`` (x1.15), not x200. Tool times are
heavy-tailed (median 0.26 s, max 65 s), and a plain EWMA of seconds is worse than not
learning at all on them (see the benchmark's results).

Update rule for an observation ``x`` (seconds) and estimate ``e``::

    c = max(x, floor_s)                               # keeps log() finite for x = 0
    c = min(max(c, e / clip_ratio), e * clip_ratio)   # when clip_ratio is not None
    e' = exp(log e + alpha * (log c - log e))         # space = "log"
    e' = e + alpha * (c - e)                          # space = "linear"
"""

from __future__ import annotations

import math
import threading
from typing import Any, Literal

import attrs

from talaria.errors import BadRequest, ConfigError
from talaria.session.hints import MAX_EXPECTED_S, MIN_EXPECTED_S
from talaria.session.kinds import ToolKind, gap_key
from talaria.session.priors import ToolPriors, load_tool_priors

__all__ = ["MAX_EXPECTED_S", "GapModelConfig", "GapPredictor"]

_KIND_VALUES = {k.value: k for k in ToolKind}


def _check_alpha(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"alpha must be in (0, 1], got {value!r}")


def _check_clip(instance: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and (not isinstance(value, (int, float)) or not 1 < value < math.inf):
        raise ConfigError(f"clip_ratio must be a finite number > 1 or None, got {value!r}")


def _check_floor(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"floor_s must be in (0, 1) seconds, got {value!r}")


def _check_space(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in ("log", "linear"):
        raise ConfigError(f'space must be "log" or "linear", got {value!r}')


def _check_max_names(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"max_tool_names must be an integer >= 0, got {value!r}")


@attrs.frozen
class GapModelConfig:
    """How a :class:`GapPredictor` learns (validated on construction: :class:`ConfigError`).

    - ``alpha``: weight of each new observation, in (0, 1].
    - ``space``: ``"log"`` (weighted geometric mean; default) or ``"linear"`` (plain EWMA).
    - ``clip_ratio``: observations are clipped to ``[e / r, e * r]`` around the current
      estimate ``e`` before the update; ``None`` disables clipping.
    - ``floor_s``: durations below this many seconds count as this (log of 0 is undefined).
    - ``max_tool_names``: at most this many unknown tools (``"other:<name>"`` keys) learn an
      estimate of their own; further ones share the ``"other"`` kind's (bounds memory in a
      long-running process). The five kinds always learn.

    Defaults (alpha 0.2, log space, clip 2.0) are the best MAE of the grid in
    ``benchmarks/gap_prediction.py`` on the tune part of the bundled traces (0.353 s; the
    test part is never used to choose them).
    """

    alpha: float = attrs.field(default=0.2, validator=_check_alpha)
    space: Literal["log", "linear"] = attrs.field(default="log", validator=_check_space)
    clip_ratio: float | None = attrs.field(default=2.0, validator=_check_clip)
    floor_s: float = attrs.field(default=0.001, validator=_check_floor)
    max_tool_names: int = attrs.field(default=1024, validator=_check_max_names)

    @classmethod
    def plain_ewma(cls, alpha: float = 0.2) -> GapModelConfig:
        """The textbook EWMA of seconds: linear space, no clipping."""
        return cls(alpha=alpha, space="linear", clip_ratio=None)

    def update(self, estimate_s: float, observed_s: float) -> float:
        """The estimate after observing ``observed_s`` seconds (pure; inputs assumed valid:
        ``estimate_s > 0``, ``observed_s >= 0`` and finite)."""
        x = max(observed_s, self.floor_s)
        if self.clip_ratio is not None:
            x = min(max(x, estimate_s / self.clip_ratio), estimate_s * self.clip_ratio)
        if self.space == "log":
            log_e = math.log(estimate_s)
            return math.exp(log_e + self.alpha * (math.log(x) - log_e))
        return estimate_s + self.alpha * (x - estimate_s)


def _check_seconds(observed_s: float) -> float:
    ok = isinstance(observed_s, (int, float)) and not isinstance(observed_s, bool)
    if not ok or not math.isfinite(observed_s) or observed_s < 0:
        raise BadRequest(
            f"a tool duration must be a finite number >= 0 seconds, got {observed_s!r}"
        )
    return float(observed_s)


@attrs.define(eq=False)
class GapPredictor:
    """Expected tool-gap seconds per gap key; learns from observed durations. Thread-safe.

    Share one predictor between the trackers of a process (a long-running client learns
    across sessions), or give each session a fresh one (it starts from the priors).
    ``predict`` never mutates; ``observe`` mutates the one key it names.
    """

    priors: ToolPriors
    config: GapModelConfig = attrs.field(factory=GapModelConfig)
    _estimates: dict[str, float] = attrs.field(init=False, factory=dict, repr=False)
    _counts: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)
    _named: int = attrs.field(init=False, default=0, repr=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    @classmethod
    def default(cls, config: GapModelConfig | None = None) -> GapPredictor:
        """A predictor seeded from the priors shipped with the package."""
        return cls(priors=load_tool_priors(), config=config or GapModelConfig())

    @staticmethod
    def key_for(tool: str, command: str | None = None) -> str:
        """The gap key of a tool call (:func:`~talaria.session.kinds.gap_key`)."""
        return gap_key(tool, command)

    def prior_s(self, key: str) -> float:
        """The seed of ``key``: its kind's prior median; unknown keys take the ``other`` kind's."""
        kind = _KIND_VALUES.get(key, ToolKind.OTHER)
        return self.priors.median_s(kind)

    def _effective_key(self, key: str) -> str:
        """``key``, or ``"other"`` for a new unknown key once ``max_tool_names`` are learned.
        Called with the lock held."""
        if key in self._estimates or key in _KIND_VALUES:
            return key
        full = self._named >= self.config.max_tool_names
        return ToolKind.OTHER.value if full else key

    def predict(self, key: str) -> float:
        """Expected duration in seconds of a tool with gap ``key``, within the hint range
        ``[MIN_EXPECTED_S, MAX_EXPECTED_S]`` (so it can always be sent as a hint)."""
        with self._lock:
            estimate = self._estimates.get(self._effective_key(key))
        value = estimate if estimate is not None else self.prior_s(key)
        return min(max(value, MIN_EXPECTED_S), MAX_EXPECTED_S)

    def observe(self, key: str, observed_s: float) -> float:
        """Learn that a tool with gap ``key`` ran ``observed_s`` seconds; returns the new
        estimate. :class:`BadRequest` (nothing changed) if ``observed_s`` is negative, not
        finite or not a number."""
        seconds = _check_seconds(observed_s)
        if not isinstance(key, str) or not key:
            raise BadRequest(f"a gap key must be a non-empty string, got {key!r}")
        with self._lock:
            eff = self._effective_key(key)
            before = self._estimates.get(eff, self.prior_s(eff))
            after = self.config.update(before, seconds)
            if eff not in self._estimates and eff not in _KIND_VALUES:
                self._named += 1
            self._estimates[eff] = after
            self._counts[eff] = self._counts.get(eff, 0) + 1
        return after

    def follow(self, estimate_s: float | None, observed_s: float) -> float:
        """A private estimate (one session's own, say) after observing ``observed_s``, by
        this predictor's rule; None starts it at the observation. Mutates nothing."""
        seconds = _check_seconds(observed_s)
        if estimate_s is None:
            return max(seconds, self.config.floor_s)
        return self.config.update(estimate_s, seconds)

    def observations(self, key: str) -> int:
        """How many durations were learned under ``key``."""
        with self._lock:
            return self._counts.get(key, 0)

    def estimates(self) -> dict[str, float]:
        """A copy of the learned estimates (seconds per key; keys never observed are absent)."""
        with self._lock:
            return dict(self._estimates)
