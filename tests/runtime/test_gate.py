"""The admission gate: each limit refuses exactly at its bound, counts the refusal, and
charges nothing until told."""

from __future__ import annotations

import pytest

from talaria.errors import BadRequest, TooManyRequests
from talaria.runtime.gate import AdmissionGate


def test_the_server_bound_refuses_the_call_past_max_calls() -> None:
    gate = AdmissionGate(max_calls=2)
    gate.admit("a", 10, 0.0, ["a"], None)
    with pytest.raises(TooManyRequests, match="max_calls"):
        gate.admit("b", 10, 0.0, ["a", "b"], None)
    assert gate.refused == 1


def test_a_tenant_share_leaves_room_for_the_others() -> None:
    gate = AdmissionGate(max_calls=4, max_calls_per_tenant=2)
    with pytest.raises(TooManyRequests, match="max_calls_per_tenant"):
        gate.admit("a", 10, 0.0, ["a", "a"], None)
    gate.admit("b", 10, 0.0, ["a", "a"], None)
    assert gate.refused == 1


def test_the_token_budget_is_checked_by_admit_and_spent_by_charge() -> None:
    gate = AdmissionGate(max_calls=8, tokens_per_minute_per_tenant=100)
    gate.admit("a", 60, 0.0, [], None)
    gate.admit("a", 60, 0.0, [], None)  # admit alone spends nothing
    gate.charge("a", 60, 0.0)
    with pytest.raises(TooManyRequests) as err:
        gate.admit("a", 60, 0.0, [], None)
    assert err.value.retry_after_s == pytest.approx(12.0)  # 20 tokens missing at 100/min
    gate.admit("a", 60, 12.0, [], None)
    assert gate.refused == 1


def test_the_session_share_counts_only_calls_that_open_a_session() -> None:
    gate = AdmissionGate(max_calls=8, max_sessions_per_tenant=2)
    with pytest.raises(TooManyRequests, match="max_sessions_per_tenant"):
        gate.admit("a", 1, 0.0, [], ["a", "a", "b"])
    gate.admit("a", 1, 0.0, [], None)  # a continuation of an open session
    gate.admit("b", 1, 0.0, [], ["a", "a", "b"])
    assert gate.refused == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_calls": 0},
        {"max_calls": True},
        {"max_calls": 2, "max_calls_per_tenant": -1},
        {"max_calls": 2, "max_sessions_per_tenant": 0},
    ],
)
def test_a_bound_that_is_not_a_positive_integer_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(BadRequest, match="positive integer"):
        AdmissionGate(**kwargs)  # type: ignore[arg-type]
