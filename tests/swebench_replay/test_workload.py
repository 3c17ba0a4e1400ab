"""Arrivals, session selection and the replay set (prefix property, sharing, scaling)."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from pathlib import Path

import pytest

from talaria.errors import BadRequest
from talaria.swebench_replay.synth import SynthStats, synthesize
from talaria.swebench_replay.traces import ToolKind, TraceCall, TraceSession, load_trace
from talaria.swebench_replay.workload import (
    Arrival,
    ArrivalKind,
    ReplaySet,
    build_replay_set,
    parse_arrival,
    select_sessions,
)
from talaria.types import Call

# --------------------------------------------------------------------------- helpers


def _session(sid: str, prompts: list[int], outputs: list[int], cached: int = 64) -> TraceSession:
    calls = tuple(
        TraceCall(
            prompt_tokens=p,
            output_tokens=o,
            cached_tokens=cached if i == 0 else None,
            tool_seconds=0.5 if i < len(prompts) - 1 else None,
            tool_kind=ToolKind.SHELL_READ_EDIT,
        )
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    )
    return TraceSession(sid, "hand", "agent", "m", "Submitted", calls)


def _growing(sid: str, n: int, first: int = 300, out: int = 20, new: int = 50) -> TraceSession:
    prompts = [first + i * (out + new) for i in range(n)]
    return _session(sid, prompts, [out] * n)


@pytest.fixture(scope="module")
def small_set() -> ReplaySet:
    sessions = [_growing(f"s{i}", 4 + i % 3, first=300 + 10 * i) for i in range(6)]
    return build_replay_set(sessions, ["m1", "m2"], Arrival(), seed=1)


# --------------------------------------------------------------------------- arrivals


@pytest.mark.parametrize(
    ("text", "arrival"),
    [
        ("all", Arrival()),
        ("ALL-at-once", Arrival()),
        ("staggered:5", Arrival.staggered(5)),
        (" staggered:0.25 ", Arrival.staggered(0.25)),
        ("poisson:0.1", Arrival.poisson(0.1)),
    ],
)
def test_parse_arrival(text: str, arrival: Arrival) -> None:
    parsed = parse_arrival(text)
    assert parsed == arrival
    assert parse_arrival(parsed.describe()) == parsed


def test_describe() -> None:
    assert Arrival().describe() == "all"
    assert Arrival.staggered(5.0).describe() == "staggered:5"
    assert Arrival.poisson(0.1).describe() == "poisson:0.1"


@pytest.mark.parametrize(
    "text", ["", "sometimes", "staggered", "staggered:x", "poisson:0", "poisson:-1", "staggered:-2"]
)
def test_parse_arrival_errors_list_the_accepted_forms(text: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_arrival(text)
    message = str(info.value)
    assert "poisson" in message and ("staggered" in message or "interval" in message)


def test_arrival_validation() -> None:
    with pytest.raises(BadRequest):
        Arrival(ArrivalKind.STAGGERED)
    with pytest.raises(BadRequest):
        Arrival(ArrivalKind.ALL_AT_ONCE, rate_per_s=1.0)
    with pytest.raises(BadRequest):
        Arrival.poisson(float("inf"))


def test_start_times() -> None:
    rng = random.Random(0)
    assert Arrival().start_times(3, rng) == [0.0, 0.0, 0.0]
    assert Arrival.staggered(5).start_times(4, rng) == [0.0, 5.0, 10.0, 15.0]
    times = Arrival.poisson(0.5).start_times(4000, random.Random(1))
    assert times[0] == 0.0
    assert times == sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(2.0, rel=0.06)
    assert times == Arrival.poisson(0.5).start_times(4000, random.Random(1))


# --------------------------------------------------------------------------- selection


@pytest.fixture(scope="module")
def long_sessions() -> list[TraceSession]:
    return synthesize(80, seed=2)  # median 73 calls, like the published traces


@pytest.fixture(scope="module")
def short_sessions() -> list[TraceSession]:
    stats = SynthStats(calls_median=32, calls_sigma=0.4, max_prompt_tokens=20_000)
    return synthesize(80, seed=2, stats=stats)


def test_selection_picks_whole_sessions_when_it_can(short_sessions: list[TraceSession]) -> None:
    picked = select_sessions(short_sessions, 30, 960, seed=0)
    assert len(picked) == 30
    assert len({s.session_id for s in picked}) == 30
    assert abs(sum(s.n_calls for s in picked) - 960) <= 0.05 * 960
    assert all("#prefix" not in s.source for s in picked)
    assert all(s in short_sessions for s in picked)


def test_selection_is_deterministic(short_sessions: list[TraceSession]) -> None:
    ids = [s.session_id for s in select_sessions(short_sessions, seed=4)]
    again = [s.session_id for s in select_sessions(list(reversed(short_sessions)), seed=4)]
    other = [s.session_id for s in select_sessions(short_sessions, seed=5)]
    assert ids == again
    assert ids != other


def test_selection_truncates_to_prefixes_when_sessions_are_long(
    long_sessions: list[TraceSession],
) -> None:
    picked = select_sessions(long_sessions, 30, 960, seed=0)
    assert sum(s.n_calls for s in picked) == 960
    by_id = {s.session_id: s for s in long_sessions}
    for s in picked:
        original = by_id[s.session_id]
        assert s.calls == original.calls[: s.n_calls]
        if s.n_calls < original.n_calls:
            assert s.source == f"{original.source}#prefix:{s.n_calls}/{original.n_calls}"
    assert [s.session_id for s in picked] == [
        s.session_id for s in select_sessions(long_sessions, 30, 960, seed=0)
    ]


def test_selection_skips_tiny_sessions() -> None:
    sessions = [_growing(f"s{i}", n) for i, n in enumerate([2, 3, 10, 10, 12])]
    picked = select_sessions(sessions, n_sessions=2, target_calls=20, seed=0)
    assert {s.session_id for s in picked} == {"s2", "s3"}


def test_selection_errors(short_sessions: list[TraceSession]) -> None:
    with pytest.raises(BadRequest, match="at least 5 calls"):
        select_sessions(short_sessions, n_sessions=500, target_calls=5000)
    with pytest.raises(BadRequest, match="longest sessions have only"):
        select_sessions(short_sessions, n_sessions=3, target_calls=5000)
    with pytest.raises(BadRequest, match="below n_sessions"):
        select_sessions(short_sessions, n_sessions=30, target_calls=50)
    with pytest.raises(BadRequest, match="n_sessions"):
        select_sessions(short_sessions, n_sessions=0)


def test_selection_on_the_published_traces(real_traces: Path) -> None:
    sessions = load_trace(real_traces)
    picked = select_sessions(sessions, seed=0)
    assert len(picked) == 30
    assert abs(sum(s.n_calls for s in picked) - 960) <= 0.05 * 960
    assert [s.source for s in picked] == [s.source for s in select_sessions(sessions, seed=0)]
    replay = build_replay_set(picked, ["a", "b", "c"], Arrival(), seed=0, trace="published")
    assert replay.n_calls == sum(s.n_calls for s in picked)
    assert replay.shared_prefix_tokens == 320
    if replay.truncated_sessions:
        assert "truncated to a prefix" in replay.trace


# --------------------------------------------------------------------------- replay set


def test_prefix_property(small_set: ReplaySet) -> None:
    for s in small_set.sessions:
        outputs: list[tuple[int, ...]] = []
        for prev, call in itertools.pairwise(s.calls):
            prev_tokens = prev.prompt.tokens()
            head = call.prompt.tokens()[: len(prev_tokens) + prev.output_tokens]
            assert head[: len(prev_tokens)] == prev_tokens
            outputs.append(head[len(prev_tokens) :])
            assert len(outputs[-1]) == prev.output_tokens
            assert head == prev.history.tokens()  # history = prompt + answer ids
            assert len(call.prompt) > len(prev.prompt) + prev.output_tokens  # new tokens too
        for c in s.calls:
            assert len(c.history) == len(c.prompt) + c.output_tokens
            assert c.history.tokens()[: len(c.prompt)] == c.prompt.tokens()
        # block hashes of a continuation extend those of the previous prompt
        for prev, call in itertools.pairwise(s.calls):
            a, b = prev.prompt.block_hashes(16, 7), call.prompt.block_hashes(16, 7)
            assert b[: len(a)] == a


def test_lengths_follow_the_trace(small_set: ReplaySet) -> None:
    for s in small_set.sessions:
        n = int(s.session_id[1:])
        expected = _growing(s.session_id, 4 + n % 3, first=300 + 10 * n)
        assert [len(c.prompt) for c in s.calls] == [c.prompt_tokens for c in expected.calls]
        assert [c.output_tokens for c in s.calls] == [c.output_tokens for c in expected.calls]
        assert [c.tool_seconds for c in s.calls] == [0.5] * (s.n_calls - 1) + [0.0]
        assert [c.index for c in s.calls] == list(range(s.n_calls))


def test_shared_prefix_within_a_model_not_across(small_set: ReplaySet) -> None:
    shared = small_set.shared_prefix_tokens
    assert shared == 64  # the first calls' cached_tokens
    heads: dict[str, set[tuple[int, ...]]] = {}
    for s in small_set.sessions:
        heads.setdefault(s.model, set()).add(s.calls[0].prompt.tokens()[:shared])
    assert set(heads) == {"m1", "m2"}
    assert all(len(h) == 1 for h in heads.values())
    assert heads["m1"] != heads["m2"]
    # past the shared prefix, sessions differ
    firsts = [s.calls[0].prompt.tokens()[shared : shared + 16] for s in small_set.sessions]
    assert len(set(firsts)) == len(firsts)


def test_models_round_robin_and_start_times() -> None:
    sessions = [_growing(f"s{i}", 4) for i in range(7)]
    replay = build_replay_set(sessions, ["a", "b", "c"], Arrival.staggered(2), seed=3)
    assert [s.model for s in replay.sessions] == ["a", "b", "c", "a", "b", "c", "a"]
    assert [s.start_s for s in replay.sessions] == [2.0 * i for i in range(7)]
    assert replay.models == ("a", "b", "c")
    assert replay.n_calls == 28
    assert sorted(s.session_id for s in replay.sessions) == sorted(f"s{i}" for i in range(7))


def test_deterministic_in_seed(small_set: ReplaySet) -> None:
    sessions = [_growing(f"s{i}", 4 + i % 3, first=300 + 10 * i) for i in range(6)]
    again = build_replay_set(sessions, ["m1", "m2"], Arrival(), seed=1)
    other = build_replay_set(sessions, ["m1", "m2"], Arrival(), seed=2)

    def fingerprint(r: ReplaySet) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(s.session_id, s.model, s.calls[-1].prompt.tokens()) for s in r.sessions]

    assert fingerprint(small_set) == fingerprint(again)
    assert fingerprint(small_set) != fingerprint(other)


def test_token_ids_below_vocab() -> None:
    sessions = [_growing(f"s{i}", 5) for i in range(3)]
    replay = build_replay_set(sessions, ["a"], Arrival(), seed=0, vocab_size=50)
    tokens = [t for s in replay.sessions for t in s.calls[-1].prompt.tokens()]
    assert max(tokens) < 50 and min(tokens) >= 0
    assert len(set(tokens)) > 40


def test_token_scale() -> None:
    session = _session("s", [1000, 1400, 2000], [100, 200, 7], cached=200)
    replay = build_replay_set([session], ["a"], Arrival(), seed=0, token_scale=0.1)
    calls = replay.sessions[0].calls
    assert [len(c.prompt) for c in calls] == [100, 140, 200]
    assert [c.output_tokens for c in calls] == [10, 20, 1]  # 0.7 rounds to 1: never zero
    assert replay.shared_prefix_tokens == 20
    assert replay.token_scale == 0.1
    assert "scaled by 0.1" in replay.trace
    tiny = build_replay_set([session], ["a"], Arrival(), seed=0, token_scale=0.001)
    lengths = [len(c.prompt) for c in tiny.sessions[0].calls]
    outs = [c.output_tokens for c in tiny.sessions[0].calls]
    assert outs == [1, 1, 1]
    # at least one new token per call: prompt i > prompt i-1 + output i-1
    assert all(b > a + o for (a, b), o in zip(itertools.pairwise(lengths), outs, strict=False))


def test_history_reset_keeps_the_longest_consistent_prefix() -> None:
    # call 2 is shorter than call 1 + its output: the agent cut its history
    session = _session("s", [500, 700, 600, 800], [50, 50, 50, 50])
    replay = build_replay_set([session], ["a"], Arrival(), seed=0)
    assert replay.history_resets == 1
    assert "1 history resets" in replay.trace
    c0, c1, c2, c3 = replay.sessions[0].calls
    assert [len(c.prompt) for c in (c0, c1, c2, c3)] == [500, 700, 600, 800]
    history = c2.prompt.tokens()
    assert history[:599] == c1.prompt.tokens()[:599]  # the longest prefix leaving 1 new token
    assert c3.prompt.tokens()[:600] == history  # and growth resumes from there


def test_shared_prefix_argument() -> None:
    sessions = [_growing(f"s{i}", 3, first=300) for i in range(4)]
    none = build_replay_set(sessions, ["a"], Arrival(), seed=0, shared_prefix_tokens=0)
    assert none.shared_prefix_tokens == 0
    heads = {s.calls[0].prompt.tokens()[:8] for s in none.sessions}
    assert len(heads) == 4
    big = build_replay_set(sessions, ["a"], Arrival(), seed=0, shared_prefix_tokens=299)
    assert len({s.calls[0].prompt.tokens()[:299] for s in big.sessions}) == 1
    with pytest.raises(BadRequest, match="at most 299"):
        build_replay_set(sessions, ["a"], Arrival(), seed=0, shared_prefix_tokens=300)


def test_missing_tool_times_are_filled_and_counted() -> None:
    calls = (
        TraceCall(prompt_tokens=100, output_tokens=10, tool_kind=ToolKind.INSTALL),
        TraceCall(prompt_tokens=200, output_tokens=10),
    )
    session = TraceSession("s", "src", "a", "m", None, calls)
    replay = build_replay_set([session], ["a"], Arrival(), seed=0)
    assert replay.tool_times_filled == 1
    first, last = replay.sessions[0].calls
    assert first.tool_seconds > 0.5  # install: p10 is 1.4 s
    assert last.tool_seconds == 0.0
    assert "1 tool times drawn" in replay.trace


def test_repeated_ids_are_made_unique() -> None:
    a = _growing("task-1", 3)
    b = TraceSession("task-1", "other-file", "agent", "m2", None, _growing("x", 4).calls)
    replay = build_replay_set([a, b], ["m"], Arrival(), seed=0)
    assert sorted(s.session_id for s in replay.sessions) == ["task-1", "task-1~2"]


def test_description_reports_truncation(long_sessions: list[TraceSession]) -> None:
    picked = select_sessions(long_sessions, 10, 200, seed=0)
    replay = build_replay_set(picked, ["a", "b"], Arrival.poisson(0.1), seed=0, trace="t.jsonl")
    assert replay.truncated_sessions == sum("#prefix" in s.source for s in picked) > 0
    assert replay.trace.startswith("t.jsonl: 10 sessions, 200 calls; ")
    assert "truncated to a prefix" in replay.trace
    assert "arrival poisson:0.1, seed 0" in replay.trace


def test_to_call(small_set: ReplaySet) -> None:
    s = small_set.sessions[0]
    call = s.calls[1].to_call(s.session_id, s.model, arrival_s=3.0)
    assert isinstance(call, Call)
    assert call.prompt is s.calls[1].prompt
    assert (call.index, call.output_tokens, call.max_new_tokens) == (1, 20, 20)
    assert call.arrival_s == 3.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"models": []},
        {"models": ["a", "a"]},
        {"models": [""]},
        {"token_scale": 0.0},
        {"token_scale": float("nan")},
        {"vocab_size": 1},
        {"seed": 1.5},
    ],
)
def test_build_argument_errors(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"models": ["a"], "arrival": Arrival(), "seed": 0} | kwargs
    with pytest.raises(BadRequest):
        build_replay_set([_growing("s", 3)], **args)  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="no sessions"):
        build_replay_set([], ["a"], Arrival(), seed=0)


def test_build_is_fast_at_paper_scale() -> None:
    """30 sessions, 990 calls, prompts growing to about 60K tokens."""
    sessions = [_growing(f"s{i}", 33, first=1500 + 10 * i, out=90, new=1720) for i in range(30)]
    assert max(s.calls[-1].prompt_tokens for s in sessions) > 59_000
    start = time.perf_counter()
    replay = build_replay_set(sessions, ["a", "b", "c"], Arrival(), seed=0)
    elapsed = time.perf_counter() - start
    assert replay.n_calls == 990
    assert elapsed < 2.0, f"build took {elapsed:.2f} s"
