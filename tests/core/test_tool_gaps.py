"""The gap table: the per-model index and the recent gaps counted by calls done, which must
equal a newest-first scan down to the horizon whatever the order of starts, ends and
queries."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.core.tool_gaps import GapTable, ToolGap
from talaria.types import SessionKey
from tests.helpers import examples

MODELS = ("a", "b")


def key(i: int) -> SessionKey:
    return SessionKey("t", f"s{i}")


def scan(table: GapTable, model: str, since_s: float) -> collections.Counter[int]:
    """Every open gap of ``model`` that started at or after ``since_s``, by calls done."""
    gaps = (gap for _, gap in table.of_model(model) if gap.since_s >= since_s)
    return collections.Counter(gap.calls_done for gap in gaps)


def test_recent_gaps_by_hand() -> None:
    t = GapTable(MODELS)
    t.start(key(1), ToolGap("a", 1.0, None, calls_done=2))
    t.start(key(2), ToolGap("a", 2.0, None, calls_done=2))
    t.start(key(3), ToolGap("a", 3.0, None, calls_done=5))
    t.start(key(4), ToolGap("b", 3.0, None, calls_done=1))
    assert t.recent_calls_done("a", 0.0) == {2: 2, 5: 1}
    assert t.recent_calls_done("a", 1.5) == {2: 1, 5: 1}  # the gap of 1.0 s retired
    t.end(key(3))
    assert t.recent_calls_done("a", 1.5) == {2: 1}
    assert t.recent_calls_done("a", 0.5) == {2: 2}  # behind the horizon: the scan answers
    t.start(key(2), ToolGap("a", 4.0, None, calls_done=3))  # its next gap
    assert t.recent_calls_done("a", 2.5) == {3: 1}
    assert t.recent_calls_done("b", 2.5) == {1: 1}
    assert t.problems() == []


ops = st.lists(
    st.tuples(
        st.sampled_from(["start", "end", "query"]),
        st.integers(0, 12),  # session
        st.sampled_from(MODELS),
        st.integers(0, 6),  # calls done
        st.floats(0.0, 3.0),  # time step
        st.floats(0.0, 20.0),  # horizon length
    ),
    max_size=120,
)


@settings(max_examples=examples(200))
@given(ops)
def test_recent_counts_equal_the_scan(steps: list[tuple[str, int, str, int, float, float]]) -> None:
    t = GapTable(MODELS)
    now = 0.0
    for op, s, model, done, dt, horizon in steps:
        now += dt
        if op == "start":
            t.start(key(s), ToolGap(model, now, None, calls_done=done))
        elif op == "end":
            t.end(key(s))
        else:
            expected = scan(t, model, now - horizon)
            assert dict(t.recent_calls_done(model, now - horizon)) == dict(+expected)
        assert t.problems() == []
