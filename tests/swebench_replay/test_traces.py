"""Trace loading and validation, trace discovery, tool-time sampling and filling."""

from __future__ import annotations

import json
import random
import shutil
import statistics
from importlib import resources
from pathlib import Path

import attrs
import pytest

from talaria.errors import TraceError
from talaria.swebench_replay.traces import (
    BUNDLED_TRACES,
    SCHEMA,
    TRACES_ENV,
    ToolKind,
    ToolTimeTable,
    TraceCall,
    TraceSession,
    fill_missing_tool_times,
    find_traces,
    load_trace,
    session_to_json,
)

KINDS = "shell_read_edit, python_script, tests, install, other"
SECONDS = "a finite number of seconds >= -10 or null"


# --------------------------------------------------------------------------- loading


def test_load_good_file(data_dir: Path) -> None:
    sessions = load_trace(data_dir / "good.jsonl")
    assert [s.session_id for s in sessions] == ["demo__demo-1", "demo__demo-2"]
    first, second = sessions
    assert first.n_calls == 4
    assert first.model == "deepseek/deepseek-chat"
    assert first.exit_status == "Submitted"
    assert first.calls[0] == TraceCall(
        prompt_tokens=1500,
        cached_tokens=320,
        output_tokens=80,
        reasoning_tokens=None,
        llm_seconds=None,
        tool_seconds=0.25,
        tool_kind=ToolKind.SHELL_READ_EDIT,
    )
    assert [c.tool_kind for c in first.calls] == [
        ToolKind.SHELL_READ_EDIT,
        ToolKind.PYTHON_SCRIPT,
        ToolKind.TESTS,
        ToolKind.OTHER,
    ]
    assert second.exit_status is None
    assert second.calls[0].reasoning_tokens == 300
    assert second.calls[1].output_tokens == 0
    assert second.calls[1].llm_seconds == 7.0 and isinstance(second.calls[1].llm_seconds, float)


def test_small_negative_tool_time_is_clock_skew_read_as_missing(data_dir: Path) -> None:
    second = load_trace(data_dir / "good.jsonl")[1]
    assert second.calls[0].tool_seconds is None  # -0.5 in the file


def test_load_directory_reads_every_jsonl_in_name_order(data_dir: Path, tmp_path: Path) -> None:
    shutil.copy(data_dir / "good.jsonl", tmp_path / "b.jsonl")
    line = (data_dir / "broken_duplicate.jsonl").read_text().splitlines()[0]
    (tmp_path / "a.jsonl").write_text(line + "\n")
    (tmp_path / "notes.txt").write_text("not a trace")
    ids = [s.session_id for s in load_trace(tmp_path)]
    assert ids == ["s1", "demo__demo-1", "demo__demo-2"]


BROKEN = [
    (
        "broken_output_type.jsonl",
        'calls[1].output_tokens: expected a non-negative integer, got "x"',
    ),
    (
        "broken_missing_kind.jsonl",
        f"calls[0].tool_kind: missing (expected one of {KINDS})",
    ),
    ("broken_schema.jsonl", 'schema: expected "talaria-trace/1", got "talaria-trace/2"'),
    ("broken_kind.jsonl", f'calls[0].tool_kind: expected one of {KINDS}, got "bash"'),
    (
        "broken_cached.jsonl",
        "calls[0].cached_tokens: expected at most prompt_tokens (100), got 128",
    ),
    ("broken_bool_prompt.jsonl", "calls[0].prompt_tokens: expected a positive integer, got true"),
    ("broken_zero_prompt.jsonl", "calls[0].prompt_tokens: expected a positive integer, got 0"),
    ("broken_empty_calls.jsonl", "calls: expected a non-empty array of calls, got []"),
    ("broken_duplicate.jsonl", "session_id: 's1' repeats the session of line 1"),
    ("broken_tool_time.jsonl", f"calls[0].tool_seconds: expected {SECONDS}, got -60"),
    ("broken_llm_nan.jsonl", f"calls[0].llm_seconds: expected {SECONDS}, got NaN"),
    ("broken_exit_status.jsonl", "exit_status: expected a non-empty string or null, got 3"),
    ("broken_missing_model.jsonl", "model: missing (expected a non-empty string)"),
    ("broken_not_object.jsonl", "expected a JSON object (one session per line), got [1, 2, 3]"),
]


@pytest.mark.parametrize(("name", "problem"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_line_names_file_line_and_field(data_dir: Path, name: str, problem: str) -> None:
    path = data_dir / name
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:2: {problem}"


def test_invalid_json_names_file_and_line(data_dir: Path) -> None:
    path = data_dir / "broken_json.jsonl"
    with pytest.raises(TraceError, match=r"broken_json\.jsonl:2: not valid JSON \(") as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:2: not valid JSON (")


def test_empty_and_missing_files(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TraceError) as info:
        load_trace(data_dir / "broken_empty.jsonl")
    assert str(info.value) == f"{data_dir / 'broken_empty.jsonl'}: the trace file holds no sessions"
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "absent.jsonl")
    with pytest.raises(TraceError, match=r"no \*\.jsonl trace files"):
        load_trace(tmp_path)


def test_trace_error_is_a_value_error(data_dir: Path) -> None:
    with pytest.raises(ValueError) as info:
        load_trace(data_dir / "broken_kind.jsonl")
    assert isinstance(info.value, TraceError)
    assert info.value.code == "invalid_trace"


def test_round_trip_through_json(data_dir: Path, tmp_path: Path) -> None:
    sessions = load_trace(data_dir / "good.jsonl")
    out = tmp_path / "t.jsonl"
    out.write_text("".join(json.dumps(session_to_json(s)) + "\n" for s in sessions))
    assert load_trace(out) == sessions
    assert session_to_json(sessions[0])["schema"] == SCHEMA


def test_constructors_validate() -> None:
    with pytest.raises(TraceError, match="prompt_tokens"):
        TraceCall(prompt_tokens=0, output_tokens=1)
    with pytest.raises(TraceError, match="output_tokens"):
        TraceCall(prompt_tokens=5, output_tokens=-1)
    with pytest.raises(TraceError, match="cached_tokens"):
        TraceCall(prompt_tokens=5, output_tokens=1, cached_tokens=6)
    with pytest.raises(TraceError, match="tool_seconds"):
        TraceCall(prompt_tokens=5, output_tokens=1, tool_seconds=-1.0)
    with pytest.raises(TraceError, match="tool_kind"):
        TraceCall(prompt_tokens=5, output_tokens=1, tool_kind="tests")  # type: ignore[arg-type]
    with pytest.raises(TraceError, match="at least one call"):
        TraceSession("s", "src", "a", "m", None, ())
    with pytest.raises(TraceError, match="session_id"):
        TraceSession("", "src", "a", "m", None, (TraceCall(prompt_tokens=5, output_tokens=1),))


# --------------------------------------------------------------------------- discovery


def test_find_traces_explicit(tmp_path: Path) -> None:
    assert find_traces(tmp_path) == tmp_path
    with pytest.raises(TraceError, match="given explicitly"):
        find_traces(tmp_path / "absent")


def test_find_traces_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    assert find_traces() == tmp_path
    other = tmp_path / "other"
    other.mkdir()
    assert find_traces(other) == other  # an explicit path wins over the variable
    monkeypatch.setenv(TRACES_ENV, str(tmp_path / "absent"))
    with pytest.raises(TraceError, match=TRACES_ENV):
        find_traces()


def test_find_traces_defaults_to_the_bundled_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRACES_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # wherever it runs from
    assert find_traces() == BUNDLED_TRACES
    assert len(load_trace(BUNDLED_TRACES)) == 132


# --------------------------------------------------------------------------- tool times


@pytest.fixture
def table() -> ToolTimeTable:
    return ToolTimeTable.published()


def test_published_table_matches_the_packaged_priors() -> None:
    """The built-in table and the server's packaged priors are the same measurement."""
    packaged = resources.files("talaria.session") / "tool_priors.json"
    assert ToolTimeTable.from_json(json.loads(packaged.read_text())).dists == (
        ToolTimeTable.published().dists
    )


def test_quantile_knots(table: ToolTimeTable) -> None:
    tests = table.dist(ToolKind.TESTS)
    assert tests.quantile(0.0) == pytest.approx(0.5 * 0.237)
    assert tests.quantile(0.10) == pytest.approx(0.237)
    assert tests.quantile(0.5) == pytest.approx(0.406)
    assert table.median(ToolKind.TESTS) == pytest.approx(0.406)
    assert tests.quantile(0.99) == pytest.approx(61.292)
    assert tests.quantile(1.0) == pytest.approx(64.62)
    # piecewise linear between the knots: halfway from p95 to p99 by probability
    assert tests.quantile(0.97) == pytest.approx((8.899 + 61.292) / 2)
    values = [tests.quantile(u / 1000) for u in range(1001)]
    assert values == sorted(values)


@pytest.mark.parametrize("kind", list(ToolKind))
def test_sampling_bounds_and_median(table: ToolTimeTable, kind: ToolKind) -> None:
    rng = random.Random(7)
    draws = [table.sample(kind, rng) for _ in range(20000)]
    dist = table.dist(kind)
    assert min(draws) >= dist.knots[0][1]
    assert max(draws) <= dist.knots[-1][1]
    assert statistics.median(draws) == pytest.approx(dist.median, rel=0.04)


def test_sampling_is_deterministic(table: ToolTimeTable) -> None:
    a = [table.sample(ToolKind.INSTALL, random.Random(3)) for _ in range(3)]
    rng1, rng2 = random.Random(11), random.Random(11)
    assert [table.sample(ToolKind.OTHER, rng1) for _ in range(50)] == [
        table.sample(ToolKind.OTHER, rng2) for _ in range(50)
    ]
    assert a[0] == a[1] == a[2]


def _table_json(table: ToolTimeTable) -> dict[str, object]:
    keys = ("p10", "p25", "p50", "p75", "p90", "p95", "p99", "max")
    kinds = {
        k.value: {"n": d.n, **{key: s for key, (_, s) in zip(keys, d.knots[1:], strict=True)}}
        for k, d in table.dists
    }
    return {"source": "test", "kinds": kinds}


def test_load_table_from_file(table: ToolTimeTable, tmp_path: Path) -> None:
    path = tmp_path / "tt.json"
    path.write_text(json.dumps(_table_json(table)))
    loaded = ToolTimeTable.load(path)
    assert loaded.dists == table.dists
    assert loaded.source == "test"
    assert dict(loaded.counts())[ToolKind.SHELL_READ_EDIT] == 2425


def test_broken_tables(table: ToolTimeTable, tmp_path: Path) -> None:
    path = tmp_path / "tt.json"
    data = _table_json(table)
    del data["kinds"]["install"]  # type: ignore[attr-defined]
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"tt\.json: kinds\.install: missing"):
        ToolTimeTable.load(path)
    data = _table_json(table)
    data["kinds"]["tests"]["p50"] = 0.1  # type: ignore[index]
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"kinds\.tests\.p50: must not be below p25"):
        ToolTimeTable.load(path)
    data = _table_json(table)
    data["kinds"]["other"]["p99"] = "slow"  # type: ignore[index]
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"kinds\.other\.p99: expected a positive number"):
        ToolTimeTable.load(path)
    path.write_text("{")
    with pytest.raises(TraceError, match=r"tt\.json:1: not valid JSON"):
        ToolTimeTable.load(path)


# --------------------------------------------------------------------------- filling


def test_fill_missing_tool_times(data_dir: Path, table: ToolTimeTable) -> None:
    sessions = load_trace(data_dir / "good.jsonl")
    filled, n = fill_missing_tool_times(sessions, table, seed=1)
    assert n == 2  # demo-1 call 1, demo-2 call 0 (clock skew); last calls stay as they are
    one, two = filled
    assert one.calls[1].tool_seconds is not None
    assert one.calls[3].tool_seconds is None  # last call: no tool after it
    assert two.calls[0].tool_seconds is not None
    assert one.calls[0] == sessions[0].calls[0]
    assert sessions[0].calls[1].tool_seconds is None  # the input is not changed
    dist = table.dist(ToolKind.PYTHON_SCRIPT)
    assert dist.knots[0][1] <= one.calls[1].tool_seconds <= dist.knots[-1][1]


def test_fill_is_deterministic_and_order_independent(data_dir: Path, table: ToolTimeTable) -> None:
    sessions = load_trace(data_dir / "good.jsonl")
    a, _ = fill_missing_tool_times(sessions, table, seed=5)
    b, _ = fill_missing_tool_times(list(reversed(sessions)), table, seed=5)
    c, _ = fill_missing_tool_times(sessions, table, seed=6)
    assert a == list(reversed(b))
    assert a != c


def test_fill_leaves_complete_sessions_alone(table: ToolTimeTable) -> None:
    call = TraceCall(prompt_tokens=10, output_tokens=2, tool_seconds=0.3)
    session = TraceSession("s", "src", "a", "m", None, (call, attrs.evolve(call)))
    out, n = fill_missing_tool_times([session], table, seed=0)
    assert n == 0 and out[0] is session


# --------------------------------------------------------------------------- published data


def test_published_traces_load(real_traces: Path) -> None:
    sessions = load_trace(real_traces)
    assert len(sessions) >= 100
    calls = [c for s in sessions for c in s.calls]
    assert statistics.median(len(s.calls) for s in sessions) == pytest.approx(73, abs=3)
    assert statistics.median(c.output_tokens for c in calls) == pytest.approx(90, rel=0.1)
    filled, n = fill_missing_tool_times(sessions, ToolTimeTable.published(), seed=0)
    assert n < 0.01 * len(calls)  # only the clock-skew gaps
    assert all(c.tool_seconds is not None for s in filled for c in s.calls[:-1])
