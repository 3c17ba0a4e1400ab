"""Tool-gap model: how likely a session in a tool gap is back within a horizon.

A gap is modelled as log-normal around the expected duration (the client's hint, or the
server's own prediction). The spread ``sigma`` is fixed from the SWE-bench tool times of
the tune part of the bundled traces (``talaria/session/tool_priors.json``): for all steps
p50 = 0.257 s and p90 = 0.483 s, so ln(p90/p50)/1.2816 = 0.49 for the body; the tail (p99 =
7.0 s) is much heavier, ln(p99/p50)/2.326 = 1.42. We use sigma = 1.0 between the two:
conservative on the body (returns are predicted less sharply than they are) and not blind
to the tail.

Numerics. Every function is total over its domain (elapsed 0 to 1e9 s and beyond, any
expected gap, sigma in ``[SIGMA_MIN, SIGMA_MAX]``) and returns a finite, non-negative value.
A gap that lasted thousands of times its median sits far in the upper tail, where the
survival is below the float epsilon and ``1 - S`` rounds to 1; so the conditional
quantities are computed from the *log-survival* ``log Q(z)`` of the standardized log-gap
``z``, never from ``1 - tiny``: ``log Q`` comes from ``erfc`` in the body and from the
asymptotic series ``Q(z) ~ phi(z)/z (1 - 1/z^2 + 3/z^4 - ...)`` past ``_Z_ASYMPTOTIC``, and
its inverse from ``NormalDist.inv_cdf`` on the small tail probability (``Q^-1(p) =
-Phi^-1(p)``) or, below float range, by Newton's method on ``log Q``.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import attrs

from talaria.errors import BadRequest, ConfigError

_STD_NORMAL = NormalDist()
_LOG_HALF = math.log(0.5)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_SQRT2 = math.sqrt(2.0)
_Z_ASYMPTOTIC = 30.0  # past this, Q(z) < 5e-198: the series is exact to ~1e-12 there
_LOG_P_DIRECT = -700.0  # log-probabilities above this invert through inv_cdf directly

DEFAULT_SIGMA = 1.0
DEFAULT_GAP_S = 0.257  # all-kinds median tool time (tune part, talaria/session/tool_priors.json)
SIGMA_MIN = 1e-3
SIGMA_MAX = 10.0
# The medians the model reasons about; an expected gap outside is clamped to the range
# (a 0 s "tool_end" hint is "the session is back any moment now", not a division by zero).
EXPECTED_MIN_S = 1e-6
EXPECTED_MAX_S = 1e6
# What a client may say a tool will take (``tool_start``'s ``expected_s``): a hint below a
# millisecond says nothing a scheduler can act on, and one of a day or more is no gap.
HINT_MIN_S = 1e-3
HINT_MAX_S = 86_399.0
# ``decays_below_s`` answers at most this (about 31,700 years: "never" on any clock).
DECAY_CAP_S = 1e12


def check_hint_s(name: str, value: object) -> float | None:
    """``value`` if it is a usable ``expected_s`` hint (None, or finite seconds in
    ``[HINT_MIN_S, HINT_MAX_S]``); ``BadRequest`` naming the bounds otherwise. The one
    check every entry point (HTTP, in-process API, runtime, client tracker) applies."""
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not HINT_MIN_S <= value <= HINT_MAX_S:  # type: ignore[operator]
        raise BadRequest(
            f"{name} must be a number of seconds in [{HINT_MIN_S:g}, {HINT_MAX_S:g}] "
            f"(leave it out if the tool's duration is unknown), got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def check_seconds(name: str, value: object, upper: float = math.inf) -> float | None:
    """``value`` if it is None or finite seconds in ``[0, upper]`` (a ``tool_end``'s
    ``measured_s``, say); ``BadRequest`` naming the field otherwise."""
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not 0 <= value <= upper or value == math.inf:  # type: ignore[operator]
        raise BadRequest(
            f"{name} must be a finite number of seconds in [0, {upper:g}], got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def log_q(z: float) -> float:
    """``log P(Z > z)`` for a standard normal ``Z``: finite and accurate for every finite
    ``z`` (decreasing in ``z``; 0 for very negative ``z``)."""
    if z < 0.0:
        return math.log1p(-0.5 * math.erfc(-z / _SQRT2))
    if z < _Z_ASYMPTOTIC:
        return math.log(0.5 * math.erfc(z / _SQRT2))
    r = 1.0 / (z * z)
    series = 1.0 - r * (1.0 - r * (3.0 - r * (15.0 - 105.0 * r)))
    return -0.5 * z * z - math.log(z) - _HALF_LOG_2PI + math.log(series)


def _log_phi(z: float) -> float:
    return -0.5 * z * z - _HALF_LOG_2PI


def inverse_log_q(log_p: float) -> float:
    """The ``z`` with ``log_q(z) == log_p``, for ``log_p <= log(0.5)`` (so ``z >= 0``)."""
    if log_p > _LOG_HALF:
        raise ValueError(f"inverse_log_q takes log_p <= log(0.5), got {log_p!r}")
    if log_p >= _LOG_P_DIRECT:
        return -_STD_NORMAL.inv_cdf(math.exp(log_p))
    # Newton on the concave, decreasing log Q: from above sqrt(-2 log_p) it converges
    # monotonically; d/dz log Q(z) = -phi(z) / Q(z).
    z = math.sqrt(-2.0 * log_p)
    for _ in range(64):
        step = (log_q(z) - log_p) / math.exp(_log_phi(z) - log_q(z))
        z += step
        if abs(step) <= 1e-15 * z:
            break
    return z


@attrs.frozen
class GapModel:
    """Log-normal gap with median ``expected_s`` and log-spread ``sigma``.

    ``expected_s=None`` (or a non-finite value) means the default median; any other median
    is clamped to ``[EXPECTED_MIN_S, EXPECTED_MAX_S]``. Times are seconds; a negative
    elapsed time counts as 0. Pure and immutable.
    """

    sigma: float = DEFAULT_SIGMA
    default_gap_s: float = DEFAULT_GAP_S

    def __attrs_post_init__(self) -> None:
        if not SIGMA_MIN <= self.sigma <= SIGMA_MAX:
            raise ConfigError(
                f"GapModel sigma must be in [{SIGMA_MIN:g}, {SIGMA_MAX:g}], got {self.sigma!r}"
            )
        if not EXPECTED_MIN_S <= self.default_gap_s <= EXPECTED_MAX_S:
            raise ConfigError(
                f"GapModel default_gap_s must be in [{EXPECTED_MIN_S:g}, {EXPECTED_MAX_S:g}] s, "
                f"got {self.default_gap_s!r}"
            )

    def median_s(self, expected_s: float | None) -> float:
        """The median gap the model uses for ``expected_s`` (clamped, defaulted)."""
        if expected_s is None or not math.isfinite(expected_s):
            return self.default_gap_s
        return min(max(expected_s, EXPECTED_MIN_S), EXPECTED_MAX_S)

    def _z(self, t: float, expected_s: float | None) -> float:
        """Standardized log-gap of ``t > 0`` (finite for every finite ``t``)."""
        return (math.log(t) - math.log(self.median_s(expected_s))) / self.sigma

    def log_survival(self, t: float, expected_s: float | None) -> float:
        """``log P(gap > t)``: 0 for ``t <= 0``, finite for finite ``t``, -inf for inf."""
        if not t > 0.0:
            return 0.0
        if t == math.inf:
            return -math.inf
        return log_q(self._z(t, expected_s))

    def cdf(self, t: float, expected_s: float | None) -> float:
        """P(gap <= t), in [0, 1], non-decreasing in ``t``."""
        if not t > 0.0:
            return 0.0
        if t == math.inf:
            return 1.0
        return 0.5 * math.erfc(-self._z(t, expected_s) / _SQRT2)

    def survival(self, t: float, expected_s: float | None) -> float:
        """P(gap > t), in [0, 1], non-increasing in ``t`` (accurate far into the tail)."""
        return math.exp(self.log_survival(t, expected_s))

    def prob_back_within(
        self, elapsed_s: float, horizon_s: float, expected_s: float | None
    ) -> float:
        """P(the session returns within ``horizon_s`` from now | it has been away
        ``elapsed_s``), in [0, 1]; non-decreasing in the horizon. A gap far past the model's
        range is just an unlikely return (the log-normal hazard tends to zero)."""
        if not horizon_s > 0.0:
            return 0.0
        if elapsed_s == math.inf:
            return 0.0
        if not elapsed_s > 0.0:
            return self.cdf(horizon_s, expected_s)
        if horizon_s == math.inf:
            return 1.0
        z = self._z(elapsed_s, expected_s)
        dz = math.log1p(horizon_s / elapsed_s) / self.sigma
        hazard = math.exp(_log_phi(z) - log_q(z))  # -d/dz log Q(z), the inverse Mills ratio
        if dz * (hazard + abs(z) + 1.0) < 1e-4:
            # a short horizon after a long gap: log Q(z + dz) - log Q(z) by its Taylor
            # series (d^2/dz^2 log Q = -hazard (hazard - z)), where the plain difference of
            # two large log-survivals would lose the answer's digits
            d = -hazard * dz * (1.0 + 0.5 * (hazard - z) * dz)
        else:
            d = log_q(z + dz) - log_q(z)
        return min(1.0, max(0.0, -math.expm1(d)))

    def expected_remaining_s(self, elapsed_s: float, expected_s: float | None) -> float:
        """Median remaining gap given ``elapsed_s`` already spent (seconds, finite, >= 0;
        ``elapsed + remaining`` is non-decreasing in ``elapsed``).

        The conditional median ``t`` solves S(t) = S(elapsed) / 2 for the log-normal
        survival S: in log-survival, ``z_t = Q^-1(exp(log Q(z_e) - log 2))``, and
        ``t = elapsed * exp(sigma * (z_t - z_e))``.
        """
        m = self.median_s(expected_s)
        if not elapsed_s > 0.0:
            return m
        if elapsed_s == math.inf:
            return EXPECTED_MAX_S  # never back soon; the answer stays finite
        z_e = self._z(elapsed_s, expected_s)
        z_t = inverse_log_q(log_q(z_e) + _LOG_HALF)
        growth = self.sigma * max(0.0, z_t - z_e)
        if growth <= 1.0:
            return elapsed_s * math.expm1(growth)
        return max(0.0, m * math.exp(self.sigma * z_t) - elapsed_s)

    def decays_below_s(self, p_min: float, horizon_s: float, expected_s: float | None) -> float:
        """Elapsed gap after which ``prob_back_within(.., horizon_s, ..)`` stays below
        ``p_min`` (seconds, in ``[0, DECAY_CAP_S]``). Returns 0 when it starts below.

        The log-normal hazard is unimodal, so the probability of a return within a fixed
        horizon rises, then falls, with the elapsed gap: from a start at or above ``p_min``
        the set where it stays at or above is one interval ``[0, x]``, found by doubling
        and then bisection. ``p_min`` in (0, 1], ``horizon_s`` >= 0 (else ConfigError).
        """
        if not 0.0 < p_min <= 1.0:
            raise ConfigError(f"p_min must be a probability in (0, 1], got {p_min!r}")
        if not horizon_s >= 0.0:
            raise ConfigError(f"horizon_s must be seconds >= 0, got {horizon_s!r}")
        if horizon_s == math.inf:
            return DECAY_CAP_S  # every session is back within an infinite horizon

        def above(e: float) -> bool:
            return self.prob_back_within(e, horizon_s, expected_s) >= p_min

        if not above(0.0):
            return 0.0
        lo, hi = 0.0, max(self.median_s(expected_s), horizon_s)
        while above(hi):
            if hi >= DECAY_CAP_S:
                return DECAY_CAP_S
            lo, hi = hi, min(hi * 2.0, DECAY_CAP_S)
        for _ in range(64):
            mid = math.sqrt(lo * hi) if lo > 0.0 else hi / 2.0
            if not lo < mid < hi:
                break
            if above(mid):
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-9 * hi:
                break
        return hi
