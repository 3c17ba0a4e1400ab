"""Synthetic sessions: determinism, the published statistics, validation."""

from __future__ import annotations

import collections
import itertools
import statistics
from pathlib import Path

import pytest

from talaria.errors import ConfigError
from talaria.swebench_replay.convert import write_trace
from talaria.swebench_replay.synth import SynthStats, synthesize
from talaria.swebench_replay.traces import ToolKind, TraceSession, load_trace


@pytest.fixture(scope="module")
def many() -> list[TraceSession]:
    return synthesize(400, seed=3)


def test_deterministic_in_seed() -> None:
    assert synthesize(5, seed=1) == synthesize(5, seed=1)
    assert synthesize(5, seed=1) != synthesize(5, seed=2)


def test_first_sessions_do_not_depend_on_count() -> None:
    assert synthesize(10, seed=4)[:3] == synthesize(3, seed=4)


def test_session_shape(many: list[TraceSession]) -> None:
    s = many[0]
    assert s.session_id == "synth-3-0000"
    assert s.model == "synthetic"
    assert synthesize(1, seed=0, model="m")[0].model == "m"
    for s in many:
        calls = s.calls
        assert calls[-1].tool_seconds is None
        assert all(c.tool_seconds is not None and c.tool_seconds > 0 for c in calls[:-1])
        assert calls[0].cached_tokens == 320
        for prev, call in itertools.pairwise(calls):
            assert call.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            assert call.cached_tokens == prev.prompt_tokens + prev.output_tokens
        assert 5 <= len(calls) <= 250
        assert calls[-1].prompt_tokens <= 128_000


def test_statistics_match_the_published_traces(many: list[TraceSession]) -> None:
    calls = [c for s in many for c in s.calls]
    assert statistics.median(s.n_calls for s in many) == pytest.approx(73, rel=0.08)
    assert statistics.median(s.calls[0].prompt_tokens for s in many) == pytest.approx(
        1600, rel=0.06
    )
    assert statistics.median(c.output_tokens for c in calls) == pytest.approx(90, rel=0.06)
    growth = [
        b.prompt_tokens - a.prompt_tokens for s in many for a, b in itertools.pairwise(s.calls)
    ]
    assert statistics.median(growth) == pytest.approx(320, rel=0.08)
    prompts = [c.prompt_tokens for c in calls]
    assert 15_000 < statistics.median(prompts) < 26_000  # published: about 19.6K
    kinds = collections.Counter(c.tool_kind for c in calls)
    assert kinds[ToolKind.SHELL_READ_EDIT] / len(calls) == pytest.approx(7321 / 10295, abs=0.02)
    assert kinds[ToolKind.INSTALL] / len(calls) == pytest.approx(289 / 10295, abs=0.01)


def test_custom_stats() -> None:
    stats = SynthStats(
        calls_median=10,
        calls_sigma=0.0,
        output_median=20,
        output_sigma=0.0,
        new_tokens_median=100,
        new_tokens_sigma=0.0,
        first_prompt_median=1000,
        first_prompt_sigma=0.0,
        system_prompt_tokens=100,
        tool_kind_weights=((ToolKind.TESTS, 1.0),),
    )
    (s,) = synthesize(1, seed=0, stats=stats)
    assert s.n_calls == 10
    assert [c.prompt_tokens for c in s.calls] == [1000 + 120 * i for i in range(10)]
    assert {c.tool_kind for c in s.calls} == {ToolKind.TESTS}


def test_context_cap_ends_a_session_early() -> None:
    stats = SynthStats(calls_median=200, calls_sigma=0.0, max_prompt_tokens=10_000)
    for s in synthesize(5, seed=0, stats=stats):
        assert s.n_calls < 200
        assert s.calls[-1].prompt_tokens <= 10_000
        assert s.calls[-1].tool_seconds is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"calls_min": 10, "calls_max": 5},
        {"calls_median": 0},
        {"output_sigma": -1},
        {"output_median": float("inf")},
        {"system_prompt_tokens": 5000},
        {"max_prompt_tokens": 2000},
        {"tool_kind_weights": ((ToolKind.TESTS, 0.0),)},
        {"tool_kind_weights": ((ToolKind.TESTS, 1.0), (ToolKind.TESTS, 2.0))},
        {"calls_min": True},
    ],
)
def test_stats_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="SynthStats"):
        SynthStats(**kwargs)  # type: ignore[arg-type]


def test_synthesize_arguments() -> None:
    assert synthesize(0, seed=0) == []
    with pytest.raises(ConfigError, match="n_sessions"):
        synthesize(-1, seed=0)
    with pytest.raises(ConfigError, match="model"):
        synthesize(1, seed=0, model="")


def test_synthetic_sessions_write_and_load(tmp_path: Path) -> None:
    sessions = synthesize(3, seed=9)
    write_trace(sessions, tmp_path / "synth.jsonl")
    assert load_trace(tmp_path / "synth.jsonl") == sessions
