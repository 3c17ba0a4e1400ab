"""The return index: its soonest return and its count within the linger must equal a scan
that prices every gap, for every gap model, linger and mix of starts (ties included); and
the curve it relies on must be valley-shaped over the gap model's whole domain."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.core.returns import ReturnIndex, _Evaluator
from talaria.core.tool_gaps import GapTable, ToolGap
from talaria.policy.gaps import SIGMA_MAX, SIGMA_MIN, GapModel
from talaria.types import SessionKey
from tests.helpers import examples


def key(i: int) -> SessionKey:
    return SessionKey("t", f"s{i}")


def scan(
    gaps: list[tuple[float | None, float]], now: float, model: GapModel, linger: float
) -> tuple[float, int]:
    """Every gap priced: the figures the index must reproduce exactly."""
    left = [model.expected_remaining_s(now - since, expected) for expected, since in gaps]
    return min(left, default=math.inf), sum(x <= linger for x in left)


def test_by_hand() -> None:
    """Default gap model (median 0.257 s, sigma 1), linger 2 s: a gap 0.1 s old is due in
    about 0.19 s, one 100 s old is not due within the linger."""
    model = GapModel()
    index = ReturnIndex()
    assert index.returns(10.0, model, 2.0) == (math.inf, 0)
    index.add(None, 9.9, key(1))
    index.add(None, -90.0, key(2))
    soonest, returning = index.returns(10.0, model, 2.0)
    assert soonest == model.expected_remaining_s(10.0 - 9.9, None)
    assert 0.1 < soonest < 0.3
    assert returning == 1
    index.remove(None, 9.9, key(1))
    assert index.returns(10.0, model, 2.0) == scan([(None, -90.0)], 10.0, model, 2.0)
    assert index.returns(10.0, model, 2.0)[1] == 0


STARTS = st.lists(
    st.tuples(
        st.sampled_from([None, 1e-6, 0.3, 7.0, 120.0, 1e6]),
        st.one_of(
            st.sampled_from([0.0, 50.0, 99.9, 100.0]),  # ties, and a gap started just now
            st.floats(-1e6, 100.0, allow_nan=False),
        ),
    ),
    max_size=60,
)


@pytest.mark.hypothesis
@settings(max_examples=examples(300))
@given(
    starts=STARTS,
    sigma=st.one_of(st.sampled_from([1.0, 4.0]), st.floats(SIGMA_MIN, SIGMA_MAX)),
    linger=st.one_of(st.sampled_from([0.0, 2.0]), st.floats(0.0, 1e7, allow_nan=False)),
    now=st.sampled_from([100.0, 100.25, 1e6]),
)
def test_equals_the_scan(
    starts: list[tuple[float | None, float]], sigma: float, linger: float, now: float
) -> None:
    model = GapModel(sigma=sigma)
    index = ReturnIndex()
    for i, (expected, since) in enumerate(starts):
        index.add(expected, since, key(i))
    assert index.returns(now, model, linger) == scan(starts, now, model, linger)
    held = {key(i): gap for i, gap in enumerate(starts)}
    assert index.problems(held) == []
    for i, (expected, since) in list(enumerate(starts))[::2]:  # removal keeps it exact
        index.remove(expected, since, key(i))
    rest = [gap for i, gap in enumerate(starts) if i % 2]
    assert index.returns(now, model, linger) == scan(rest, now, model, linger)


@pytest.mark.parametrize("sigma", [SIGMA_MIN, 0.1, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, SIGMA_MAX])
def test_the_curve_is_valley_shaped(sigma: float) -> None:
    """The evaluated remaining time, over elapsed times from 1e-15 to 1e15 medians (500
    points a decade), falls to its minimum and then rises, never the other way round by
    more than float noise (where it is flat: at sigma 4 and above it wobbles by an ulp
    around the median before rising)."""
    model = GapModel(sigma=sigma)
    values = [model.expected_remaining_s(10 ** (k / 500), 1.0) for k in range(-7500, 7500)]
    bottom = values.index(min(values))
    pairs = list(itertools.pairwise(values))
    assert all(b <= a * (1 + 1e-14) for a, b in pairs[:bottom])
    assert all(b >= a * (1 - 1e-14) for a, b in pairs[bottom:])


def test_a_raising_gap_model_answers_none() -> None:
    class Broken(GapModel):
        def expected_remaining_s(self, elapsed_s: float, expected_s: float | None) -> float:
            raise ValueError("broken")

    index = ReturnIndex()
    index.add(None, 1.0, key(1))
    assert index.returns(2.0, Broken(), 2.0) is None


def test_the_table_keeps_its_index_through_hints() -> None:
    table = GapTable(("a", "b"))
    table.start(key(1), ToolGap("a", 1.0, None))
    table.start(key(2), ToolGap("a", 1.0, 5.0))
    table.start(key(3), ToolGap("b", 2.0, None))
    table.set_expected(key(1), 30.0)
    table.set_expected(key(9), 30.0)  # no gap: nothing
    assert table.get(key(1)).expected_s == 30.0  # type: ignore[union-attr]
    assert table.problems() == []
    model = GapModel()
    want = scan([(30.0, 1.0), (5.0, 1.0)], 3.0, model, 2.0)
    assert table.returns("a", 3.0, model, 2.0) == want
    table.start(key(1), ToolGap("b", 3.0, None))  # its next gap, of another model
    table.end(key(2))
    assert table.problems() == []
    assert table.returns("a", 3.0, model, 2.0) == (math.inf, 0)


@pytest.mark.hypothesis
@settings(max_examples=examples(200))
@given(
    starts=st.lists(st.sampled_from([0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0]), max_size=30),
    bottom=st.floats(-1e3, 1e3),
    first=st.floats(-1e3, 1e3),
    last=st.floats(-1e3, 1e3),
    linger=st.sampled_from([0.05, 0.2, 0.23, 2.0, 30.0]),  # 0.23: between the minimum and m
)
def test_the_walks_correct_any_estimate(
    starts: list[float], bottom: float, first: float, last: float, linger: float
) -> None:
    """The shape's estimates only say where to start: from wherever the minimum and the
    crossings are guessed, the walks land on the scan's answers (ties included)."""
    model, now = GapModel(), 100.0
    starts = sorted(starts)
    left = _Evaluator(model, None, starts, now)
    soonest, returning = scan([(None, s) for s in starts], now, model, linger)
    best, at = left.minimum(bottom)
    assert best == soonest
    if best <= linger:
        assert left.run_length(at, linger, first, last) == returning
