"""The session-aware slot order's work estimates: calls left learned from ended sessions,
and the mean service time per call."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.errors import ConfigError
from talaria.policy.remaining import MIN_ENDED, CallCost, SessionLengths
from tests.helpers import examples


def test_prior_is_one_call_left_until_enough_sessions_ended() -> None:
    lengths = SessionLengths()
    for _ in range(MIN_ENDED - 1):
        lengths.observe(10)
        assert lengths.expected_left(3) == 1.0
    lengths.observe(20)  # ended: 10, 10, 10, 10, 20
    assert lengths.n_ended == MIN_ENDED
    assert lengths.expected_left(0) == pytest.approx(12.0)  # mean of all
    assert lengths.expected_left(9) == pytest.approx(3.0)  # 12 - 9
    assert lengths.expected_left(10) == pytest.approx(10.0)  # only the 20 is longer
    assert lengths.expected_left(25) == 1.0  # longer than every ended session: the prior
    lengths.observe(0)  # ignored
    assert lengths.n_ended == MIN_ENDED
    with pytest.raises(ConfigError):
        SessionLengths(min_ended=0)


@settings(max_examples=examples(200), deadline=None)
@given(ended=st.lists(st.integers(1, 500), max_size=60), done=st.integers(0, 600))
def test_expected_left_is_at_least_one_and_finite(ended: list[int], done: int) -> None:
    lengths = SessionLengths()
    for n in ended:
        lengths.observe(n)
    left = lengths.expected_left(done)
    assert 1.0 <= left <= 500


def test_call_cost_prices_unmeasured_models_like_measured_ones() -> None:
    cost = CallCost({"a": 1.0, "b": 2.0})
    assert (cost.of("a"), cost.of("b")) == (1.0, 2.0)
    cost.observe("a", 3.0)  # a's calls take 3x its prior: b is priced 3x too
    assert (cost.of("a"), cost.of("b")) == (3.0, 6.0)
    cost.observe("a", 8.0)
    assert cost.of("a") == pytest.approx(3.0 + 0.2 * 5.0)
    cost.observe("a", float("nan"))
    cost.observe("a", float("inf"))
    assert cost.of("a") == pytest.approx(4.0)


def test_a_windowed_cost_is_the_plain_mean_of_the_last_calls() -> None:
    """One long call moves the windowed mean by its share, not by a fifth of the gap (the
    exponential mean's weight): a slot that closes after it keeps its model's price."""
    cost = CallCost({"a": 1.0, "b": 2.0}, window=3)
    for s in (1.0, 1.0, 1.0, 1.0):
        cost.observe("a", s)
    cost.observe("a", 10.0)  # the last three: 1, 1, 10
    assert cost.of("a") == pytest.approx(4.0)
    assert cost.of("b") == pytest.approx(8.0)  # b's prior, scaled as a's calls run (4x)
    cost.observe("a", float("nan"))
    cost.observe("a", -1.0)
    assert cost.of("a") == pytest.approx(4.0)  # bad measurements are ignored
    for s in (2.0, 2.0, 2.0):
        cost.observe("a", s)
    assert cost.of("a") == pytest.approx(2.0)  # the long call has left the window
    with pytest.raises(ConfigError):
        CallCost({"a": 1.0}, window=0)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.floats(min_value=0.0, max_value=1e6), min_size=1, max_size=60),
    st.integers(min_value=1, max_value=20),
)
def test_the_windowed_cost_is_the_mean_of_its_window(seconds: list[float], window: int) -> None:
    cost = CallCost({"a": 1.0}, window=window)
    for s in seconds:
        cost.observe("a", s)
    last = seconds[-window:]
    assert cost.of("a") == pytest.approx(sum(last) / len(last), rel=1e-9, abs=1e-12)
    assert min(last) - 1e-9 <= cost.of("a") <= max(last) + 1e-9
