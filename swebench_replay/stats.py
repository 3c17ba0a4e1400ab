"""Intervals over seeds: what a comparison reports instead of one run's figure.

* :func:`mean_interval`: the mean of per-seed values and its two-sided Student-t
  confidence interval (the seeds are independent draws of the workload);
* :func:`ratio_interval`: the paired ratio of two policies over the same seeds, as the
  geometric mean of the per-seed ratios with the t-interval of their logarithms carried
  back (a ratio's log is symmetric: 2x and 0.5x are equally far from 1).

With one seed there is no interval: ``low`` and ``high`` are ``None``. Pure; scipy's t
quantile, no other state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
from scipy import stats as _scipy_stats

from talaria.errors import BadRequest

LEVEL = 0.95


@attrs.frozen
class Interval:
    """A central value and its confidence interval (``None`` bounds with one sample)."""

    value: float
    low: float | None
    high: float | None
    n: int

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "ci95": [self.low, self.high], "n": self.n}

    def excludes(self, x: float) -> bool:
        """Whether the whole interval lies on one side of ``x`` (False without one)."""
        if self.low is None or self.high is None:
            return False
        return self.low > x or self.high < x


def _check(values: Sequence[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise BadRequest(f"{what}: no values")
    if any(not math.isfinite(v) for v in out):
        raise BadRequest(f"{what}: values must be finite, got {out}")
    return out


def _t(n: int, level: float) -> float:
    return float(_scipy_stats.t.ppf(0.5 + level / 2, n - 1))


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean of ``values`` with its t-interval at ``level`` (two-sided)."""
    xs = _check(values, "mean_interval")
    if not 0 < level < 1:
        raise BadRequest(f"level must be in (0, 1), got {level!r}")
    n = len(xs)
    mean = math.fsum(xs) / n
    if n < 2:
        return Interval(mean, None, None, n)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = _t(n, level) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def ratio_interval(num: Sequence[float], den: Sequence[float], level: float = LEVEL) -> Interval:
    """The paired ratio ``num[i] / den[i]`` over seeds: geometric mean and its interval (the
    t-interval of the mean log ratio, exponentiated). Values must be positive."""
    a, b = _check(num, "ratio_interval"), _check(den, "ratio_interval")
    if len(a) != len(b):
        raise BadRequest(f"ratio_interval: {len(a)} numerators for {len(b)} denominators")
    if any(x <= 0 for x in (*a, *b)):
        raise BadRequest("ratio_interval: values must be positive")
    logs = mean_interval([math.log(x / y) for x, y in zip(a, b, strict=True)], level)
    low = None if logs.low is None else math.exp(logs.low)
    high = None if logs.high is None else math.exp(logs.high)
    return Interval(math.exp(logs.value), low, high, logs.n)
