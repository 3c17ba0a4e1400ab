"""Per-tenant token budgets: exact refill arithmetic, any sequence of checks and charges,
and the live cluster refusing a spent tenant with the seconds until it may retry."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.errors import BadRequest, ConfigError, TooManyRequests
from talaria.runtime.quota import TenantQuotas, TokenBucket
from tests.helpers import examples


def test_a_bucket_refills_per_second_up_to_a_minute() -> None:
    b = TokenBucket(per_minute=120, level=120.0, updated_s=0.0)
    b.take(100, 0.0)
    assert b.level_at(0.0) == 20.0
    assert b.level_at(5.0) == 30.0  # 2 tokens a second
    assert b.level_at(1000.0) == 120.0  # never more than a minute's worth
    assert b.wait_s(40, 5.0) == 5.0 and b.wait_s(30, 5.0) == 0.0
    assert b.level_at(-10.0) == 20.0  # a clock that went back refills nothing


def test_quotas_check_then_charge_per_tenant() -> None:
    q = TenantQuotas(per_minute=60)
    q.check("a", 60, 0.0)  # a tenant starts with a full minute
    q.charge("a", 60, 0.0)
    with pytest.raises(TooManyRequests, match="retry in 10 s") as err:
        q.check("a", 10, 0.0)
    assert err.value.retry_after_s == 10.0
    q.check("b", 60, 0.0)  # another tenant's budget is its own
    q.check("a", 10, 10.0)
    assert q.available("a", 10.0) == 10.0
    with pytest.raises(BadRequest, match="more than your tenant's 60 tokens per minute"):
        q.check("b", 61, 0.0)
    unlimited = TenantQuotas(None)
    unlimited.check("a", 10**9, 0.0)
    unlimited.charge("a", 10**9, 0.0)
    assert unlimited.available("a", 0.0) is None
    for bad in (0, -5, True, 2.5):
        with pytest.raises(ConfigError):
            TenantQuotas(bad)  # type: ignore[arg-type]


@settings(max_examples=examples(300), deadline=None)
@given(
    per_minute=st.integers(1, 10**7),
    ops=st.lists(st.tuples(st.floats(0.0, 1e5), st.integers(0, 10**7)), max_size=40),
)
def test_any_sequence_keeps_the_budget_in_range_and_waits_exact(
    per_minute: int, ops: list[tuple[float, int]]
) -> None:
    q = TenantQuotas(per_minute)
    now = 0.0
    for dt, cost in ops:
        now += dt
        try:
            q.check("t", cost, now)
        except TooManyRequests as exc:
            wait = exc.retry_after_s
            assert 0.0 < wait <= 60.0 * (1 + 1e-9) and math.isfinite(wait)
            q.check("t", cost, now + wait * (1 + 1e-9) + 1e-9)  # after the wait it fits
            continue
        except BadRequest:
            assert cost > per_minute
            continue
        q.charge("t", cost, now)
        level = q.available("t", now)
        assert level is not None and -1e-6 <= level <= per_minute
