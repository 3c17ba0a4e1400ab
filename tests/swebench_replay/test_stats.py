"""Intervals over seeds: exact values where the answer is known, properties elsewhere."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.errors import BadRequest
from talaria.swebench_replay.stats import mean_interval, ratio_interval
from tests.helpers import examples

T_4_975 = 2.7764451051977987  # Student t, 4 degrees of freedom, 97.5th percentile


def test_mean_interval_exact() -> None:
    iv = mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = T_4_975 * math.sqrt(2.5) / math.sqrt(5)
    assert iv.value == 3.0 and iv.n == 5
    assert iv.low == pytest.approx(3.0 - half, rel=1e-12)
    assert iv.high == pytest.approx(3.0 + half, rel=1e-12)


def test_one_sample_has_no_interval() -> None:
    iv = mean_interval([7.0])
    assert (iv.value, iv.low, iv.high, iv.n) == (7.0, None, None, 1)
    assert not iv.excludes(0.0)


def test_ratio_interval_is_the_geometric_mean_with_a_log_interval() -> None:
    iv = ratio_interval([2.0, 8.0], [1.0, 2.0])  # ratios 2 and 4
    assert iv.value == pytest.approx(math.sqrt(8.0))
    logs = mean_interval([math.log(2.0), math.log(4.0)])
    assert iv.low == pytest.approx(math.exp(logs.low))  # type: ignore[arg-type]
    assert iv.high == pytest.approx(math.exp(logs.high))  # type: ignore[arg-type]
    same = ratio_interval([3.0, 3.0, 3.0], [3.0, 3.0, 3.0])
    assert (same.value, same.low, same.high) == (1.0, 1.0, 1.0)
    assert same.excludes(0.9) and not same.excludes(1.0)


@pytest.mark.parametrize(
    ("num", "den"),
    [([], []), ([1.0], [1.0, 2.0]), ([0.0], [1.0]), ([1.0], [-1.0]), ([math.nan], [1.0])],
)
def test_bad_input_is_a_typed_error(num: list[float], den: list[float]) -> None:
    with pytest.raises(BadRequest):
        ratio_interval(num, den)


def test_bad_level_is_a_typed_error() -> None:
    for level in (0.0, 1.0, 2.0):
        with pytest.raises(BadRequest):
            mean_interval([1.0, 2.0], level)


finite = st.floats(-1e9, 1e9, allow_nan=False, allow_infinity=False)
positive = st.floats(1e-6, 1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(finite, min_size=2, max_size=12))
def test_the_interval_holds_the_mean_and_shifts_with_the_data(xs: list[float]) -> None:
    iv = mean_interval(xs)
    assert iv.low is not None and iv.high is not None
    assert iv.low <= iv.value <= iv.high
    moved = mean_interval([x + 10.0 for x in xs])
    assert moved.value == pytest.approx(iv.value + 10.0, abs=1e-6 * (1 + abs(iv.value)))


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(positive, positive), min_size=2, max_size=12))
def test_a_ratio_and_its_inverse_mirror(pairs: list[tuple[float, float]]) -> None:
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    fwd, back = ratio_interval(a, b), ratio_interval(b, a)
    assert fwd.value * back.value == pytest.approx(1.0)
    assert fwd.low is not None and back.high is not None
    assert fwd.low * back.high == pytest.approx(1.0, rel=1e-9)
    assert fwd.low <= fwd.value <= fwd.high  # type: ignore[operator]
