"""Admission with soft reservations: when one is taken, how it expires, what is reclaimed first.

The gap model is log-normal with sigma 1 (``GapModel``), so with a median gap ``m`` and a
horizon ``h`` a fresh gap returns within the horizon with probability ``Phi(ln(h / m))``:
``Phi(ln 10) = 0.98935`` for m = 1 s, ``Phi(ln 0.1) = 0.01065`` for m = 100 s.
"""

from __future__ import annotations

import itertools
import math

import pytest

from talaria.config import PolicyConfig
from talaria.policy.admission import Admission
from tests.helpers import examples

P_MEDIAN_1S = 0.5 * (1 + math.erf(math.log(10) / math.sqrt(2)))  # 0.98935
P_MEDIAN_100S = 0.5 * (1 + math.erf(math.log(0.1) / math.sqrt(2)))  # 0.01065


def admission(**knobs: object) -> Admission:
    """An Admission with the horizon and hold these tests' numbers were computed for."""
    knobs = {"reservation_horizon_s": 10.0, "reservation_max_hold_s": 120.0, **knobs}
    return Admission(PolicyConfig(name="t", **knobs))  # type: ignore[arg-type]


def test_offer_takes_a_soft_reservation_weighted_by_return_probability() -> None:
    adm = admission()
    res = adm.offer("s", "m", blocks=8, now=100.0, expected_gap_s=1.0)
    assert res is not None
    assert (res.session, res.model, res.blocks, res.since_s, res.hard) == (
        "s",
        "m",
        8,
        100.0,
        False,
    )
    assert res.probability == pytest.approx(P_MEDIAN_1S)
    assert res.expires_s == 100.0 + 120.0  # reservation_max_hold_s
    assert adm.held == {"s": res}
    assert adm.reserved_blocks == 8
    assert adm.weighted_reserved_blocks(100.0) == pytest.approx(8 * P_MEDIAN_1S)
    assert adm.reservations_made == 1


def test_offer_refuses_unlikely_returns() -> None:
    adm = admission()  # reservation_min_probability 0.05
    assert adm.offer("s", "m", 8, 0.0, expected_gap_s=100.0) is None  # p = 0.0107
    assert adm.held == {}
    lenient = admission(reservation_min_probability=0.01)
    res = lenient.offer("s", "m", 8, 0.0, expected_gap_s=100.0)
    assert res is not None
    assert res.probability == pytest.approx(P_MEDIAN_100S)


def test_offer_refuses_without_reservations_empty_kv_or_twice() -> None:
    off = admission(soft_reservations=False)
    assert not off.enabled
    assert off.offer("s", "m", 8, 0.0, 1.0) is None
    adm = admission()
    assert adm.enabled
    assert adm.offer("s", "m", 0, 0.0, 1.0) is None
    first = adm.offer("s", "m", 8, 0.0, 1.0)
    assert first is not None
    assert adm.offer("s", "m", 4, 1.0, 1.0) is None  # already held: the first one stays
    assert adm.held["s"] is first
    assert adm.reservations_made == 1


def test_ttl_pin_is_hard_ignores_probability_and_expires_at_ttl() -> None:
    adm = admission(soft_reservations=False, kv_pin_ttl_s=2.0)
    assert adm.enabled
    res = adm.offer("s", "m", 8, now=10.0, expected_gap_s=1000.0)  # p would be ~0
    assert res is not None
    assert res.hard and res.probability == 1.0 and res.expires_s == 12.0
    assert adm.weighted_reserved_blocks(11.0) == 8.0
    adm.update_hint("s", 5000.0, 11.0)  # hints do not weaken a pin
    assert res.probability == 1.0
    assert adm.reclaim_order(11.0) == []
    assert adm.expire(11.999) == []
    assert adm.expire(12.0) == [res]
    assert adm.held == {} and adm.reservations_expired == 1


def test_expire_after_max_hold() -> None:
    adm = admission(reservation_max_hold_s=5.0)
    res = adm.offer("s", "m", 8, now=0.0, expected_gap_s=1.0)
    assert adm.expire(4.999) == []
    assert adm.held == {"s": res}
    assert adm.expire(5.0) == [res]
    assert adm.held == {}
    assert adm.reservations_expired == 1


def test_expire_when_the_return_probability_decays() -> None:
    # horizon 0.1 s, median gap 0.1 s: P(back within 0.1 s | away 5 s) = 0.079,
    # | away 10 s) = 0.047 < 0.05
    adm = admission(reservation_horizon_s=0.1)
    res = adm.offer("s", "m", 8, now=0.0, expected_gap_s=0.1)
    assert res is not None
    assert adm.expire(5.0) == []
    # when P(back within the horizon) falls below 0.05: 9.1655 s (bisection to 1e-9)
    assert res.deadline_s == pytest.approx(9.16545909, rel=1e-8)
    assert adm.gaps.prob_back_within(res.deadline_s, 0.1, 0.1) == pytest.approx(0.05, rel=1e-8)
    assert adm.expire(10.0) == [res]


def test_update_hint_changes_probability_and_a_long_tool_expires_the_reservation() -> None:
    adm = admission()
    res = adm.offer("s", "m", 8, now=0.0, expected_gap_s=None)
    assert res is not None and res.probability > 0.99  # default median gap 0.257 s
    adm.update_hint("s", 100.0, now=0.0)
    assert res.expected_gap_s == 100.0
    assert res.probability == pytest.approx(P_MEDIAN_100S)
    assert adm.expire(0.0) == [res]  # below reservation_min_probability now
    adm.update_hint("unknown", 1.0, 0.0)  # no reservation: nothing happens
    assert adm.held == {}


def test_reclaim_order_is_least_valuable_first() -> None:
    adm = admission(reservation_min_probability=0.01)
    adm.offer("big", "m", 100, 0.0, 1.0)  # p 0.989 over 100 blocks
    adm.offer("small", "m", 2, 0.0, 1.0)  # p 0.989 over 2 blocks
    adm.offer("unlikely", "m", 2, 0.0, 100.0)  # p 0.0107 over 2 blocks
    adm.offer("tie", "m", 100, 0.0, 1.0)  # same value as "big": ordered by name
    order = [r.session for r in adm.reclaim_order(0.0)]
    assert order == ["unlikely", "big", "tie", "small"]
    assert [r.session for r in adm.reclaim_order(0.0, exclude=["big", "small"])] == [
        "unlikely",
        "tie",
    ]
    assert adm.held.keys() == {"big", "small", "unlikely", "tie"}  # ordering mutates nothing


def test_reclaim_and_release() -> None:
    adm = admission()
    res = adm.offer("s", "m", 8, 0.0, 1.0)
    assert adm.reclaim("s") is res
    assert adm.reservations_reclaimed == 1 and adm.held == {}
    assert adm.release("s") is None
    res2 = adm.offer("s", "m", 8, 1.0, 1.0)
    assert adm.release("s") is res2
    assert adm.reservations_reclaimed == 1


def test_should_reclaim_threshold() -> None:
    adm = admission(reclaim_after_wait_s=0.5)
    assert not adm.should_reclaim(0.0)
    assert not adm.should_reclaim(0.499)
    assert adm.should_reclaim(0.5)
    assert adm.should_reclaim(3.0)
    assert admission(reclaim_after_wait_s=0.0).should_reclaim(0.0)


def test_return_probability_only_decays_as_the_gap_lasts() -> None:
    # far in the log-normal tail the survival is tiny; the conditional probability must keep
    # falling there, not jump to certainty
    adm = admission()
    elapsed = [0.0, 1.0, 10.0, 60.0, 120.0, 300.0, 1000.0, 1e4, 1e6]
    probs = [adm.probability(0.0, t, None) for t in elapsed]
    assert all(a > b for a, b in itertools.pairwise(probs))
    assert probs[-1] < adm.policy.reservation_min_probability


# ---------------------------------------------------------------------------- properties
# Any sequence of offers, hints, expiries, returns and reclaims, at any times (gaps from
# microseconds to decades, hints at the wire format's bounds), leaves the table consistent
# and every probability and value a finite number in range.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from talaria.policy.gaps import HINT_MAX_S, HINT_MIN_S  # noqa: E402

_hints = st.one_of(st.none(), st.floats(HINT_MIN_S, HINT_MAX_S))
_ops = st.lists(
    st.tuples(
        st.sampled_from(["offer", "hint", "expire", "release", "reclaim"]),
        st.integers(0, 5),  # session
        st.floats(0.0, 1e9),  # seconds after the previous operation
        _hints,
        st.integers(0, 64),  # blocks
    ),
    max_size=40,
)


@settings(max_examples=examples(200), deadline=None)
@given(
    ops=_ops,
    ttl=st.sampled_from([0.0, 5.0]),
    p_min=st.floats(1e-9, 1.0),
    horizon=st.floats(1e-3, 1e4),
)
def test_any_operation_sequence_keeps_the_table_sound(
    ops: list[tuple[str, int, float, float | None, int]], ttl: float, p_min: float, horizon: float
) -> None:
    adm = admission(
        kv_pin_ttl_s=ttl, reservation_min_probability=p_min, reservation_horizon_s=horizon
    )
    now = 0.0
    for op, s, dt, hint, blocks in ops:
        now += dt
        sid = f"s{s}"
        if op == "offer":
            res = adm.offer(sid, "m", blocks, now, hint)
            if res is not None:
                assert 0.0 <= res.probability <= 1.0
                assert res.deadline_s >= now or res.deadline_s == res.expires_s
        elif op == "hint":
            adm.update_hint(sid, hint, now)
        elif op == "expire":
            for res in adm.expire(now):
                assert res.deadline_s <= now and res.session not in adm.held
        elif op == "release":
            adm.release(sid)
        else:
            order = adm.reclaim_order(now)
            values = [r.value(now, adm.gaps, horizon) for r in order]
            assert all(0.0 <= v <= 1.0 for v in values)
            assert values == sorted(values) and not any(r.hard for r in order)
            if order:
                adm.reclaim(order[0].session)
        held = adm.held.values()
        assert adm.reserved_blocks == sum(r.blocks for r in held)
        weighted = adm.weighted_reserved_blocks(now)
        assert math.isfinite(weighted) and 0.0 <= weighted <= adm.reserved_blocks + 1e-9
        for r in held:
            assert 0.0 <= adm.probability(r.since_s, now, r.expected_gap_s) <= 1.0
    assert adm.reservations_made >= len(adm.held)


def test_a_continuum_pin_outlives_its_ttl_while_its_next_call_waits() -> None:
    adm = admission(continuum_ttl=True, soft_reservations=False)
    res = adm.offer("s", "m", 8, now=0.0, expected_gap_s=None, reload_s=math.e)
    assert res is not None and res.expires_s == pytest.approx(1.0)  # 1 s * ln(e / 1 s)
    assert adm.due(2.0) and adm.expire(2.0, waiting={"s"}) == []  # its call is queued
    assert adm.held == {"s": res} and adm.reservations_expired == 0
    assert not adm.due(1e9)  # kept until that call's admission releases it
    assert adm.release("s") is res
