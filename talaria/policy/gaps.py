"""Tool-gap model: how likely a session in a tool gap is back within a horizon.

A gap is modelled as log-normal around the expected duration (the client's hint, or the
server's own prediction). The spread ``sigma`` is fixed from the published SWE-bench tool
times in ``shared/traces/tool_time_by_kind.json``: for all steps p50 = 0.264 s and
p90 = 0.473 s, so ln(p90/p50)/1.2816 = 0.455 for the body; the tail (p99 = 4.5 s) is much
heavier, ln(p99/p50)/2.326 = 1.22. We use sigma = 1.0 between the two: conservative on
the body (returns are predicted less sharply than they are) and not blind to the tail.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import attrs

from talaria.errors import ConfigError

_STD_NORMAL = NormalDist()
DEFAULT_SIGMA = 1.0
DEFAULT_GAP_S = 0.264  # all-kinds median tool time in the SWE-bench traces


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@attrs.frozen
class GapModel:
    """Log-normal gap with median ``expected_s`` and log-spread ``sigma``."""

    sigma: float = DEFAULT_SIGMA
    default_gap_s: float = DEFAULT_GAP_S

    def __attrs_post_init__(self) -> None:
        if not self.sigma > 0 or not self.default_gap_s > 0:
            raise ConfigError("GapModel sigma and default_gap_s must be positive")

    def cdf(self, t: float, expected_s: float | None) -> float:
        """P(gap <= t) for a gap whose median is ``expected_s`` (None: the default)."""
        if t <= 0:
            return 0.0
        m = max(expected_s if expected_s is not None else self.default_gap_s, 1e-6)
        return _phi((math.log(t) - math.log(m)) / self.sigma)

    def survival(self, t: float, expected_s: float | None) -> float:
        """P(gap > t), computed with ``erfc`` so that it stays accurate far into the tail."""
        if t <= 0:
            return 1.0
        m = max(expected_s if expected_s is not None else self.default_gap_s, 1e-6)
        return 0.5 * math.erfc((math.log(t) - math.log(m)) / (self.sigma * math.sqrt(2.0)))

    def prob_back_within(
        self, elapsed_s: float, horizon_s: float, expected_s: float | None
    ) -> float:
        """P(the session returns within ``horizon_s`` from now | it has been away ``elapsed_s``)."""
        survive = self.survival(elapsed_s, expected_s)
        if survive <= 0.0:
            return 0.0  # beyond float range: the log-normal hazard tends to zero
        return (survive - self.survival(elapsed_s + horizon_s, expected_s)) / survive

    def expected_remaining_s(self, elapsed_s: float, expected_s: float | None) -> float:
        """Median remaining gap given ``elapsed_s`` already spent (seconds, >= 0).

        Closed form: the conditional median ``t`` solves S(t) = S(elapsed) / 2 for the
        log-normal survival S, so ln t = ln m + sigma * Phi^-1(1 - S(elapsed) / 2).
        """
        m = max(expected_s if expected_s is not None else self.default_gap_s, 1e-6)
        if elapsed_s <= 0:
            return m
        half = self.survival(elapsed_s, expected_s) / 2.0
        if half <= 0.0:
            return elapsed_s  # beyond float range: as long again as it has lasted, at least
        t = math.exp(math.log(m) + self.sigma * _STD_NORMAL.inv_cdf(1.0 - half))
        return max(0.0, t - elapsed_s)

    def decays_below_s(self, p_min: float, horizon_s: float, expected_s: float | None) -> float:
        """Elapsed gap after which ``prob_back_within(.., horizon_s, ..)`` stays below
        ``p_min`` (seconds; bisection on a log scale, the probability falls monotonically
        past the median). Returns 0 when it starts below."""
        if self.prob_back_within(0.0, horizon_s, expected_s) < p_min:
            return 0.0
        lo, hi = 1e-3, 1e6
        if self.prob_back_within(hi, horizon_s, expected_s) >= p_min:
            return hi
        for _ in range(48):
            mid = math.sqrt(lo * hi)
            if self.prob_back_within(mid, horizon_s, expected_s) >= p_min:
                lo = mid
            else:
                hi = mid
        return hi
