"""Slot demand and the remaining-work estimates the session-aware slot order reads, on the
hand-sized instances of ``test_instance``."""

from __future__ import annotations

import attrs
import pytest

from talaria.policy.baselines import POLICIES
from talaria.types import DEFAULT_TENANT, Call, SessionKey, TokenSeq
from tests.core.test_instance import TALARIA, Driver, core, tokens


def test_the_open_slots_drain_is_one_calls_mean_service_time() -> None:
    """The session-aware order's starvation bound reads how long the open batch has left:
    the open model's mean measured service time while it runs calls, zero otherwise (and
    zero for the other slot orders, which have no such bound)."""
    for policy, expect_drain in ((TALARIA, True), (POLICIES["talaria-no-slot-order"], False)):
        inst = core(policy, models=("A", "B"), device_blocks=40)
        d = Driver(inst)
        d.submit("A1", 0, TokenSeq(tokens(6)), 3)
        d.submit("B1", 0, TokenSeq(tokens(6)), 3)
        while not inst.calls.running_of("A"):
            d.step()
        demand = inst.estimates.demand(d.now)
        want = inst.estimates.call_cost.of("A") if expect_drain else 0.0
        assert demand["A"].drain_s == want and demand["B"].drain_s == 0.0
        assert not expect_drain or want > 0.0
        d.run()
        assert inst.estimates.demand(d.now)["A"].drain_s == 0.0


def test_slot_demand_names_only_the_models_with_work_and_the_open_slots() -> None:
    """Models with nothing waiting, running or in a tool gap are left out of the slot
    demand (a pool instance serves dozens of them), except the open slot's model."""
    inst = core(TALARIA, models=("A", "B", "C", "D"), device_blocks=40)
    d = Driver(inst)
    assert inst.estimates.demand(d.now) == {}
    d.submit("B1", 0, TokenSeq(tokens(6)), 3)
    assert set(inst.estimates.demand(d.now)) == {"B"}
    d.run()  # B1 answered: B's slot stays open, B1 is in its tool gap
    assert inst.rounds.current == "B" and inst.tool_gaps.get(SessionKey(DEFAULT_TENANT, "B1"))
    d.submit("C1", 0, TokenSeq(tokens(6)), 3)
    demand = inst.estimates.demand(d.now)
    assert set(demand) == {"B", "C"} and demand["B"].in_gap == 1 and demand["C"].waiting == 1
    inst.end_session(SessionKey(DEFAULT_TENANT, "B1"))
    assert set(inst.estimates.demand(d.now)) == {"B", "C"}  # B: the open slot's model
    d.run()  # C's slot opens and answers C1
    assert inst.rounds.current == "C" and set(inst.estimates.demand(d.now)) == {"C"}


def test_remaining_work_is_priced_by_the_windowed_mean_and_the_drain_by_the_recent_one() -> None:
    """Two calls of A, a short one then a long one: the drain reads the exponentially
    weighted service time (the recent call counts a fifth), remaining work the plain mean
    of both (one long call, the last before a slot closes, must not reprice every call to
    come), and the number of calls left times that mean is A's remaining work."""
    inst = core(TALARIA, models=("A", "B"), device_blocks=40)
    d = Driver(inst)
    short = d.submit("A1", 0, TokenSeq(tokens(6)), 2)
    d.run()
    long = d.submit("A2", 0, TokenSeq(tokens(6)), 12)
    d.run()
    served = [r.finished_s - r.admitted_s for r in (short, long)]  # type: ignore[operator]
    assert served[0] < served[1]
    assert inst.call_work.of("A") == pytest.approx(sum(served) / 2)
    assert inst.call_cost.of("A") == pytest.approx(served[0] + 0.2 * (served[1] - served[0]))
    d.submit("A1", 1, TokenSeq(tokens(9)), 2)  # A1 back; A2 in its tool gap: both count
    left = inst.lengths.expected_left(1)  # each has made one call
    remaining_s, sessions, _, _ = inst.estimates.remaining("A", d.now)
    assert remaining_s == pytest.approx(2 * left * inst.call_work.of("A"))
    assert sessions == 2  # A1's waiting call and A2's gap


def test_the_router_waits_out_the_hold_of_another_models_open_slot() -> None:
    """Under the session-aware order A's slot stays open while A1 is in its tool gap, so a
    call of B waits for that hold: A's remaining work here, at most the starvation bound,
    at least the quantum-based wait the routing bound reads. Other orders keep theirs."""
    for starvation in (1e9, 0.3):  # the hold in full, then capped by the bound
        policy = attrs.evolve(TALARIA, slot_starvation_s=starvation)
        inst = core(policy, models=("A", "B"), device_blocks=40)
        d = Driver(inst)
        d.submit("A1", 0, TokenSeq(tokens(6)), 12)
        d.run()  # A1 answered (1.1 s): A's slot stays open, A1 is in its tool gap
        est = inst.estimates
        assert inst.rounds.current == "A" and est.slot_wait_s("B") == 0.0
        work = inst.lengths.expected_left(1) * inst.call_work.of("A")
        assert work > 0.3 and est.remaining("A", d.now)[0] == pytest.approx(work)
        b1 = Call("B1", 0, "B", TokenSeq(tokens(6)), 3, 3)
        assert est.held_wait_s("B", d.now) == min(starvation, est.remaining("A", d.now)[0])
        assert est.view(b1, d.now, False).slot_wait_s == est.held_wait_s("B", d.now)
        assert est.held_wait_s("A", d.now) == 0.0  # A's own slot admits
    inst = core(POLICIES["talaria-no-slot-order"], models=("A", "B"), device_blocks=40)
    d = Driver(inst)
    d.submit("A1", 0, TokenSeq(tokens(6)), 3)
    d.run()
    assert inst.estimates.held_wait_s("B", d.now) == inst.estimates.slot_wait_s("B")


def test_a_pack_slack_discounts_the_bounds_where_a_view_holds_the_models_calls() -> None:
    """The pruned search ranks by the bounds' keys and chooses by the views': the discount
    of both reads the same table, waiting and running calls alike, and nowhere else."""
    inst = core(TALARIA, models=("A", "B"), device_blocks=40)
    d = Driver(inst)
    est = inst.estimates
    a2 = Call("A2", 0, "A", TokenSeq(tokens(6)), 3, 3)

    def discounted(model: str) -> bool:
        call = Call(f"{model}9", 0, model, TokenSeq(tokens(6)), 3, 3)
        bound, key = est.bound_s(model, 3), est.bound_s(model, 3, pack_slack=0.5)
        tight = est.prefill_bound_s(call, 3)
        tight_key = est.prefill_bound_s(call, 3, pack_slack=0.5)
        assert (key, tight_key) in ((bound, tight), (bound / 1.5, tight / 1.5))
        assert bound > 0 and tight > 0
        return key < bound

    def agree() -> bool:
        held = discounted("A")
        assert held == (est.view(a2, d.now, False).model_calls > 0)
        return held

    assert not agree() and not discounted("B")
    d.submit("A1", 0, TokenSeq(tokens(6)), 3)
    assert agree()  # waiting
    while not inst.calls.running_of("A"):
        d.step()
    assert agree() and not discounted("B")  # running
    d.run()
    assert not agree()  # answered: A1 in its tool gap holds no call
