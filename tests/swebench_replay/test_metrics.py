"""Replay metrics: percentiles, per-policy summaries, speedups and conservation checks."""

from __future__ import annotations

from typing import Any

import pytest

from talaria.sim.simulator import CallRecord, SessionRecord, SimResult
from talaria.swebench_replay.metrics import (
    add_ratios,
    check_conservation,
    percentile,
    policy_summary,
)


def _call(
    sid: str,
    index: int,
    arrival: float,
    first: float,
    finish: float,
    *,
    prompt: int = 100,
    reused: int = 0,
    restored: int = 0,
    recomputed: int = 0,
) -> CallRecord:
    return CallRecord(
        session_id=sid,
        index=index,
        model="m",
        instance="i0",
        arrival_s=arrival,
        admitted_s=arrival,
        first_token_s=first,
        finish_s=finish,
        prompt_tokens=prompt,
        output_tokens=10,
        reused_tokens=reused,
        restored_tokens=restored,
        recomputed_tokens=recomputed,
        sp_admitted=False,
    )


def _result(
    calls: tuple[CallRecord, ...] | None = None,
    sessions: tuple[SessionRecord, ...] | None = None,
    counters: dict[str, int] | None = None,
) -> SimResult:
    if calls is None:
        calls = (
            # session a: ttft 0.5 and 1.0; session b: ttft 2.0
            _call("a", 0, 0.0, 0.5, 1.0, prompt=100, reused=0, restored=0, recomputed=100),
            _call("a", 1, 3.0, 4.0, 5.0, prompt=200, reused=150, restored=30, recomputed=20),
            _call("b", 0, 1.0, 3.0, 7.0, prompt=300, reused=0, restored=100, recomputed=200),
        )
    if sessions is None:
        sessions = (
            SessionRecord("a", "m", start_s=0.0, end_s=5.0, calls=2, tool_s=2.0),
            SessionRecord("b", "m", start_s=1.0, end_s=7.0, calls=1, tool_s=0.0),
        )
    return SimResult(
        policy="p",
        calls=calls,
        sessions=sessions,
        counters=counters or {},
        end_s=7.0,
    )


# --------------------------------------------------------------------------- percentile


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([1.0, 2.0, 3.0, 4.0], 95, 3.85),
        ([4.0, 1.0, 3.0, 2.0], 25, 1.75),  # order does not matter
        ([10.0, 20.0, 30.0], 50, 20.0),
        ([7.0], 95, 7.0),
        ([], 50, 0.0),
    ],
)
def test_percentile_linear_interpolation(values: list[float], q: float, expected: float) -> None:
    got = percentile(values, q)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, abs=1e-12)


# --------------------------------------------------------------------------- policy_summary


def test_policy_summary_exact_values() -> None:
    counters = {
        "kv_bytes_moved": 1000,
        "weight_bytes_moved": 24,
        "model_switches": 3,
        "staged_switches": 2,
        "sp_admissions": 5,
        "reservations_made": 7,
        "reclaims": 1,
        "kv_dropped_blocks": 4,
    }
    s = policy_summary(_result(counters=counters))
    assert s["sessions"] == 2
    assert s["calls"] == 3
    # SCTs: a = 5.0, b = 6.0
    assert s["sct_p50_s"] == pytest.approx(5.5)
    assert s["sct_p95_s"] == pytest.approx(5.0 + 0.95 * 1.0)
    assert s["sct_mean_s"] == pytest.approx(5.5)
    assert s["session_sct_s"] == [5.0, 6.0]
    # TTFTs: 0.5, 1.0, 2.0
    assert s["ttft_p50_s"] == pytest.approx(1.0)
    assert s["ttft_p95_s"] == pytest.approx(1.0 + 0.9 * 1.0)
    # latencies: 1.0, 2.0, 6.0
    assert s["latency_p50_s"] == pytest.approx(2.0)
    assert s["prefix_reused_tokens"] == 150
    assert s["restored_tokens"] == 130
    assert s["recomputed_tokens"] == 320
    assert s["prompt_tokens"] == 600
    assert s["bytes_moved"] == 1024
    assert s["kv_bytes_moved"] == 1000
    assert s["weight_bytes_moved"] == 24
    assert s["model_switches"] == 3
    assert s["staged_switches"] == 2
    assert s["sp_admissions"] == 5
    assert s["reservations_made"] == 7
    assert s["reclaims"] == 1
    assert s["kv_dropped_blocks"] == 4
    assert s["makespan_s"] == 7.0
    for key in ("prefix_reused_tokens", "bytes_moved", "model_switches", "sp_admissions"):
        assert type(s[key]) is int


def test_policy_summary_missing_counters_are_zero() -> None:
    s = policy_summary(_result(counters={}))
    for key in ("bytes_moved", "model_switches", "sp_admissions", "reservations_made"):
        assert s[key] == 0


def test_policy_summary_empty_result() -> None:
    s = policy_summary(_result(calls=(), sessions=()))
    assert s["sessions"] == 0 and s["calls"] == 0
    assert s["sct_p50_s"] == 0.0 and s["sct_mean_s"] == 0.0 and s["ttft_p95_s"] == 0.0


# --------------------------------------------------------------------------- add_ratios


def _entry(p50: float, p95: float, mean: float) -> dict[str, Any]:
    return {"sct_p50_s": p50, "sct_p95_s": p95, "sct_mean_s": mean}


def test_add_ratios_speedup_over_round() -> None:
    policies = {
        "round": _entry(10.0, 40.0, 20.0),
        "talaria": _entry(5.0, 10.0, 8.0),
        "zero": _entry(0.0, 0.0, 0.0),
    }
    add_ratios(policies)
    t = policies["talaria"]
    assert t["speedup_p50_vs_round"] == 2.0
    assert t["speedup_p95_vs_round"] == 4.0
    assert t["speedup_mean_vs_round"] == 2.5
    r = policies["round"]
    assert r["speedup_p50_vs_round"] == 1.0
    assert r["speedup_p95_vs_round"] == 1.0
    assert r["speedup_mean_vs_round"] == 1.0
    # a zero SCT does not divide by zero
    assert policies["zero"]["speedup_p50_vs_round"] == 0.0


def test_add_ratios_other_reference() -> None:
    policies = {"sticky": _entry(4.0, 8.0, 6.0), "talaria": _entry(2.0, 2.0, 3.0)}
    add_ratios(policies, reference="sticky")
    assert policies["talaria"]["speedup_p95_vs_sticky"] == 4.0


def test_add_ratios_without_round_changes_nothing() -> None:
    policies = {"talaria": _entry(5.0, 10.0, 8.0), "sticky": _entry(6.0, 12.0, 9.0)}
    before = {k: dict(v) for k, v in policies.items()}
    add_ratios(policies)
    assert policies == before


# --------------------------------------------------------------------------- conservation


def test_check_conservation_accepts_a_consistent_result() -> None:
    check_conservation(_result(), 3, {"a": 2.0, "b": 0.0})
    # an SCT exactly equal to the tool time is fine
    check_conservation(_result(), 3, {"a": 5.0, "b": 6.0})


def test_check_conservation_missing_call() -> None:
    calls = _result().calls[:2]
    with pytest.raises(ValueError, match="2 distinct calls answered of 3"):
        check_conservation(_result(calls=calls), 3, {})


def test_check_conservation_duplicated_call() -> None:
    c = _result().calls
    # one call answered twice, another never: same count, fewer distinct calls
    with pytest.raises(ValueError, match="distinct calls"):
        check_conservation(_result(calls=(c[0], c[0], c[2])), 3, {})
    # one call answered twice on top of all of them
    with pytest.raises(ValueError, match="distinct calls"):
        check_conservation(_result(calls=(*c, c[1])), 3, {})


def test_check_conservation_sct_below_tool_time() -> None:
    with pytest.raises(ValueError, match=r"session a: SCT 5\.0 below its tool time"):
        check_conservation(_result(), 3, {"a": 5.5, "b": 0.0})
