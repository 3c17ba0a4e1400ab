"""The tool-gap model: exact values where the maths gives them, and soundness over the whole
domain (elapsed 0 to 1e9 s, expected 1e-6 to 1e6 s, every valid sigma).

The log-normal with median ``m`` and spread ``sigma`` has survival
``S(t) = Q(ln(t / m) / sigma)``; ``Q(0) = 1/2``, ``Q(1) = 0.158655...``.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.errors import BadRequest, ConfigError
from talaria.policy.gaps import (
    DECAY_CAP_S,
    EXPECTED_MAX_S,
    EXPECTED_MIN_S,
    HINT_MAX_S,
    HINT_MIN_S,
    SIGMA_MAX,
    SIGMA_MIN,
    GapModel,
    check_hint_s,
    inverse_log_q,
    log_q,
)
from tests.helpers import examples

Q1 = 0.5 * math.erfc(1 / math.sqrt(2))  # P(Z > 1) = 0.15865525393145707

elapsed = st.floats(min_value=0.0, max_value=1e9, allow_nan=False)
expected = st.one_of(st.none(), st.floats(min_value=1e-6, max_value=1e6, allow_nan=False))
sigmas = st.floats(min_value=SIGMA_MIN, max_value=SIGMA_MAX, allow_nan=False)
horizons = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
probabilities = st.floats(min_value=1e-12, max_value=1.0, allow_nan=False, exclude_min=False)


def test_known_values() -> None:
    g = GapModel()  # sigma 1, default median 0.257 s
    assert g.survival(0.257, None) == pytest.approx(0.5, rel=1e-15)
    assert g.survival(math.e, 1.0) == pytest.approx(Q1, rel=1e-14)
    assert g.cdf(math.e, 1.0) == pytest.approx(1 - Q1, rel=1e-14)
    assert g.expected_remaining_s(0.0, 2.0) == 2.0  # nothing spent: the median
    # back within 9 s of a 1 s gap that has lasted 1 s: 1 - S(10)/S(1) = 1 - 2 Q(ln 10)
    assert g.prob_back_within(1.0, 9.0, 1.0) == pytest.approx(
        1 - math.erfc(math.log(10) / math.sqrt(2)), rel=1e-14
    )
    # conditional median after 1 s of a 1 s-median gap: S(t) = 1/4, t = exp(Q^-1(1/4))
    assert 1.0 + g.expected_remaining_s(1.0, 1.0) == pytest.approx(math.exp(0.6744897501960817))


def test_short_horizons_after_long_gaps_keep_their_digits() -> None:
    """Where the plain ratio is still accurate, the Taylor form of a short horizon agrees."""
    g = GapModel()
    for e, h in ((100.0, 1e-3), (50.0, 1e-2), (10.0, 1e-5), (3.0, 1e-7)):
        direct = (g.survival(e, 1.0) - g.survival(e + h, 1.0)) / g.survival(e, 1.0)
        assert g.prob_back_within(e, h, 1.0) == pytest.approx(direct, rel=1e-6)


def test_the_reported_crash_is_gone() -> None:
    """The issue's reproduction: elapsed past ~970 s with the default median raised
    ``StatisticsError`` (1 - S/2 rounded to 1); a 0 s hint crossed it after 4 ms."""
    g = GapModel()
    for e in (969.0, 971.0, 1_000.0, 1_470.0, 1e4, 1e6, 1e9):
        left = g.expected_remaining_s(e, None)
        assert math.isfinite(left) and left > 0
    assert math.isfinite(g.expected_remaining_s(1.5, 0.0))
    assert math.isfinite(g.expected_remaining_s(37.0, 0.01))
    # far in the tail the conditional median grows like elapsed * sigma / ln(elapsed / m);
    # 31,798,802.87 s solves log Q(z) = log Q(z_e) - log 2 in 60-digit mpmath (m = 0.257 s)
    assert g.expected_remaining_s(1e9, None) == pytest.approx(3.17988029e7, rel=1e-6)


def test_log_q_matches_erfc_and_its_inverse() -> None:
    for z in (-40.0, -5.0, -1.0, 0.0, 1.0, 5.0, 20.0, 29.9):
        assert log_q(z) == pytest.approx(math.log(0.5 * math.erfc(z / math.sqrt(2))), rel=1e-13)
    # the asymptotic branch joins the erfc branch continuously at z = 30
    assert log_q(30.0) == pytest.approx(math.log(0.5 * math.erfc(30 / math.sqrt(2))), rel=1e-13)
    for z in (0.0, 0.5, 3.0, 30.0, 40.0, 1e3, 1e6):
        assert inverse_log_q(log_q(z)) == pytest.approx(z, rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError, match="log_p"):
        inverse_log_q(-0.1)


@settings(max_examples=examples(300), deadline=None)
@given(z=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), dz=st.floats(0.0, 1e3))
def test_log_q_is_finite_non_positive_and_decreasing(z: float, dz: float) -> None:
    a, b = log_q(z), log_q(z + dz)
    assert math.isfinite(a) and a <= 0.0
    assert b <= a + 1e-12 * abs(a)


@settings(max_examples=examples(300), deadline=None)
@given(z=st.floats(min_value=0.0, max_value=1e6, allow_nan=False))
def test_inverse_log_q_round_trips(z: float) -> None:
    assert inverse_log_q(log_q(z)) == pytest.approx(z, rel=1e-9, abs=1e-9)


@settings(max_examples=examples(300), deadline=None)
@given(sigma=sigmas, m=expected, t=elapsed, dt=st.floats(0.0, 1e9))
def test_survival_and_cdf_are_probabilities_and_monotone(
    sigma: float, m: float | None, t: float, dt: float
) -> None:
    g = GapModel(sigma=sigma)
    s, later = g.survival(t, m), g.survival(t + dt, m)
    c = g.cdf(t, m)
    assert 0.0 <= later <= s <= 1.0
    assert 0.0 <= c <= 1.0
    assert c + s == pytest.approx(1.0, abs=1e-12)
    assert g.cdf(t + dt, m) >= c
    assert g.log_survival(t, m) <= 0.0 and not math.isnan(g.log_survival(t, m))


@settings(max_examples=examples(300), deadline=None)
@given(sigma=sigmas, m=expected, e=elapsed, h=horizons, dh=horizons)
def test_prob_back_within_is_a_probability_non_decreasing_in_the_horizon(
    sigma: float, m: float | None, e: float, h: float, dh: float
) -> None:
    g = GapModel(sigma=sigma)
    p, wider = g.prob_back_within(e, h, m), g.prob_back_within(e, h + dh, m)
    assert 0.0 <= p <= 1.0 and 0.0 <= wider <= 1.0
    assert wider >= p - 1e-12


@settings(max_examples=examples(300), deadline=None)
@given(sigma=sigmas, m=expected, e=elapsed, de=st.floats(0.0, 1e9))
def test_expected_remaining_is_finite_and_the_conditional_median_grows(
    sigma: float, m: float | None, e: float, de: float
) -> None:
    g = GapModel(sigma=sigma)
    left, left_later = g.expected_remaining_s(e, m), g.expected_remaining_s(e + de, m)
    assert math.isfinite(left) and left >= 0.0
    assert math.isfinite(left_later) and left_later >= 0.0
    # the conditional median e + remaining(e) is non-decreasing in e
    assert (e + de) + left_later >= (e + left) * (1 - 1e-9)


@settings(max_examples=examples(150), deadline=None)
@given(sigma=sigmas, m=expected, p_min=probabilities, h=horizons)
def test_decays_below_is_finite_and_the_probability_stays_below_after_it(
    sigma: float, m: float | None, p_min: float, h: float
) -> None:
    g = GapModel(sigma=sigma)
    x = g.decays_below_s(p_min, h, m)
    assert 0.0 <= x <= DECAY_CAP_S
    if x == 0.0:
        assert g.prob_back_within(0.0, h, m) < p_min
    elif x < DECAY_CAP_S:
        for later in (x, x * 1.5, x * 10, x * 1e3):
            assert g.prob_back_within(later, h, m) < p_min * (1 + 1e-9)
        # (log-survival differences of ~1e8 lose ~1e-8 absolute: allow 1e-4 relative)
        assert g.prob_back_within(x * (1 - 1e-6), h, m) >= p_min * (1 - 1e-4)


def test_inputs_outside_the_model_range_are_clamped_not_fatal() -> None:
    g = GapModel()
    assert g.median_s(0.0) == EXPECTED_MIN_S and g.median_s(1e12) == EXPECTED_MAX_S
    assert g.median_s(math.nan) == g.default_gap_s and g.median_s(None) == g.default_gap_s
    assert g.expected_remaining_s(-5.0, 1.0) == 1.0  # a negative elapsed counts as 0
    assert g.expected_remaining_s(math.inf, 1.0) == EXPECTED_MAX_S
    assert g.prob_back_within(math.inf, 10.0, 1.0) == 0.0
    assert g.prob_back_within(1.0, math.inf, 1.0) == 1.0
    assert g.survival(math.inf, 1.0) == 0.0 and g.cdf(math.inf, 1.0) == 1.0


def test_bad_configuration_is_a_config_error() -> None:
    for sigma in (0.0, -1.0, math.nan, SIGMA_MAX * 2):
        with pytest.raises(ConfigError, match="sigma"):
            GapModel(sigma=sigma)
    with pytest.raises(ConfigError, match="default_gap_s"):
        GapModel(default_gap_s=0.0)
    with pytest.raises(ConfigError, match="p_min"):
        GapModel().decays_below_s(0.0, 1.0, None)
    with pytest.raises(ConfigError, match="horizon_s"):
        GapModel().decays_below_s(0.5, -1.0, None)
    assert GapModel().decays_below_s(0.5, math.inf, None) == DECAY_CAP_S


def test_hint_bounds_name_the_range() -> None:
    assert check_hint_s("expected_s", None) is None
    assert check_hint_s("expected_s", HINT_MIN_S) == HINT_MIN_S
    assert check_hint_s("expected_s", 2) == 2.0
    for bad in (0, 0.0, HINT_MIN_S / 2, -1.0, HINT_MAX_S * 2, math.nan, math.inf, True, "1"):
        with pytest.raises(BadRequest, match=r"expected_s must be .* \[0.001, 86399\]"):
            check_hint_s("expected_s", bad)
