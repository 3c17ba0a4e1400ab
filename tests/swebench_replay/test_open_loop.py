"""Open-loop arrivals of real sessions on a Zipf catalog."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.errors import BadRequest
from talaria.sim.pool_catalog import pool_catalog
from talaria.swebench_replay.open_loop import (
    ArrivalPattern,
    PatternKind,
    build_load,
    check_rate,
    draw_arrivals,
    longest_built,
    parse_pattern,
    trace_sessions,
)
from talaria.swebench_replay.split import Part
from talaria.swebench_replay.traces import TraceSession


@pytest.fixture(scope="module")
def tune_sessions() -> tuple[list[TraceSession], Path]:
    return trace_sessions(None, Part.TUNE)


@pytest.mark.parametrize("pattern", [ArrivalPattern(), ArrivalPattern(PatternKind.GAMMA, 2.0)])
def test_arrivals_have_the_asked_mean_rate_and_cv(pattern: ArrivalPattern) -> None:
    times = pattern.start_times(40_001, 0.25, seed=7)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(4.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(pattern.cv, rel=0.05)


@settings(max_examples=25, deadline=None)
@given(st.floats(0.001, 10.0), st.integers(1, 50))
def test_rates_of_one_seed_scale_the_same_arrivals(rate: float, n: int) -> None:
    base = ArrivalPattern().start_times(n, 1.0, seed=3)
    scaled = ArrivalPattern().start_times(n, rate, seed=3)
    assert scaled == pytest.approx([t / rate for t in base])


@pytest.mark.parametrize("rate", [0, 0.0, -1.0, math.nan, math.inf, True, "1"])
def test_a_bad_rate_is_refused(rate: object) -> None:
    with pytest.raises(BadRequest):
        check_rate(rate)
    with pytest.raises(BadRequest):
        ArrivalPattern().start_times(3, rate, seed=0)  # type: ignore[arg-type]


def test_patterns_parse_and_refuse() -> None:
    assert parse_pattern("poisson") == ArrivalPattern()
    assert parse_pattern("gamma:3").cv == 3.0 and parse_pattern("gamma").cv == 2.0
    assert parse_pattern("gamma:0.5").describe() == "gamma:0.5"
    for bad in ("weibull", "gamma:x", "gamma:0", "gamma:-1", ""):
        with pytest.raises(BadRequest):
            parse_pattern(bad)


def test_models_follow_the_zipf_law(tune_sessions: tuple[list[TraceSession], Path]) -> None:
    sessions, _ = tune_sessions
    catalog = pool_catalog(12)
    draws = draw_arrivals(sessions, catalog, 3000, 1.0, ArrivalPattern(), seed=1)
    top = sum(1 for d in draws if d.model == catalog.models[0].name) / len(draws)
    assert top == pytest.approx(catalog.probabilities[0], abs=0.03)
    again = draw_arrivals(sessions, catalog, 3000, 5.0, ArrivalPattern(), seed=1)
    assert [(d.trace_id, d.model) for d in again] == [(d.trace_id, d.model) for d in draws]


def test_built_sessions_are_real_and_fit_their_model(
    tune_sessions: tuple[list[TraceSession], Path],
) -> None:
    sessions, path = tune_sessions
    catalog = pool_catalog()
    draws = draw_arrivals(sessions, catalog, 30, 0.1, ArrivalPattern(), seed=2)
    load = build_load(draws, 2, trace_path=path)
    assert len(load.scripts) == 30 and len({s.session_id for s in load.scripts}) == 30
    by = load.by_session
    for script in load.scripts:
        draw = by[script.session_id]
        assert script.model == draw.model and script.start_s == draw.start_s
        assert len(script.calls) == draw.trace.n_calls
        longest = max(len(c.prompt) + c.output_tokens for c in script.calls)
        assert longest <= longest_built(draw.trace) <= catalog.model(draw.model).max_context
        gaps = [c.tool_seconds for c in script.calls[:-1]]
        assert all(g >= 0 for g in gaps) and script.calls[-1].tool_seconds == 0.0
    assert load.n_calls == sum(len(s.calls) for s in load.scripts)
