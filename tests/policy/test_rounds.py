"""Slot scheduler: SP admission window, when a slot closes, round-robin order, staging guess."""

from __future__ import annotations

import pytest

from talaria.config import PolicyConfig
from talaria.errors import ConfigError, UnknownModel
from talaria.policy.rounds import RoundScheduler, SlotClose, SlotDemand
from tests.helpers import examples

SP = PolicyConfig(name="sp", slot_max_s=30.0, slot_linger_s=2.0)
NO_SP = PolicyConfig(name="no-sp", session_prefill=False, slot_max_s=30.0, slot_linger_s=2.0)
WAITING = SlotDemand(waiting=1)


def rounds(policy: PolicyConfig = SP, models: tuple[str, ...] = ("a", "b", "c")) -> RoundScheduler:
    return RoundScheduler(models, policy)


def test_needs_models() -> None:
    with pytest.raises(ConfigError):
        RoundScheduler((), SP)


def test_may_admit_only_the_open_slots_model() -> None:
    r = rounds()
    assert r.current is None and not r.may_admit("a")
    slot = r.open("a", now=5.0)
    assert (slot.model, slot.opened_s) == ("a", 5.0)
    assert r.current == "a" and r.slots_opened == 1
    assert r.may_admit("a") and not r.may_admit("b")


def test_with_sp_the_slot_keeps_admitting_after_the_opening_pass() -> None:
    r = rounds(SP)
    r.open("a", 0.0)
    r.end_opening_pass()
    assert r.may_admit("a")


def test_without_sp_admission_closes_after_the_opening_pass() -> None:
    r = rounds(NO_SP)
    r.open("a", 0.0)
    assert r.may_admit("a")
    r.end_opening_pass()
    assert not r.may_admit("a")
    r.open("a", 1.0)  # the next round admits again
    assert r.may_admit("a")


def test_close_if_due_without_a_slot() -> None:
    assert rounds().close_if_due(0.0, {})


def test_nobody_else_waiting_keeps_the_slot_open_past_the_quantum() -> None:
    r = rounds()
    r.open("a", 0.0)
    idle = {"a": SlotDemand(), "b": SlotDemand(running=0, expected_back_s=0.1)}
    assert not r.close_if_due(1000.0, idle)
    assert r.may_admit("a")


def test_quantum_closes_a_busy_slot_when_others_wait() -> None:
    r = rounds()
    r.open("a", 10.0)
    demand = {"a": SlotDemand(waiting=3, running=4), "b": WAITING}
    assert not r.close_if_due(39.9, demand)
    assert r.close_if_due(40.0, demand)
    assert r.slot is not None and r.slot.closing
    assert not r.may_admit("a")  # closing: drain, admit nothing more
    assert r.slot.closed_for is SlotClose.QUANTUM
    assert r.close_if_due(41.0, demand)  # still closing, counted once
    assert r.closes == {SlotClose.QUANTUM: 1}


def test_linger_keeps_an_idle_slot_for_a_session_expected_back() -> None:
    r = rounds()
    r.open("a", 0.0)
    soon = {"a": SlotDemand(expected_back_s=2.0), "b": WAITING}
    assert not r.close_if_due(1.0, soon)  # back within slot_linger_s (2 s)
    late = {"a": SlotDemand(expected_back_s=2.5), "b": WAITING}
    assert r.close_if_due(1.0, late)
    assert r.closes == {SlotClose.IDLE: 1}


def test_idle_slot_with_no_session_expected_closes_when_others_wait() -> None:
    r = rounds()
    r.open("a", 0.0)
    assert r.close_if_due(0.1, {"a": SlotDemand(), "b": WAITING})


def test_linger_does_not_apply_without_sp() -> None:
    r = rounds(NO_SP)
    r.open("a", 0.0)
    r.end_opening_pass()
    demand = {"a": SlotDemand(running=1), "b": WAITING}
    assert not r.close_if_due(1.0, demand)  # its batch still runs
    drained = {"a": SlotDemand(expected_back_s=0.1), "b": WAITING}
    assert r.close_if_due(1.0, drained)


def test_no_linger_policy_closes_as_soon_as_the_batch_drains() -> None:
    r = rounds(PolicyConfig(name="work-conserving", slot_linger_s=0.0))
    r.open("a", 0.0)
    assert not r.close_if_due(0.5, {"a": SlotDemand(running=2), "b": WAITING})
    assert r.close_if_due(0.5, {"a": SlotDemand(expected_back_s=0.01), "b": WAITING})


def test_without_sp_a_drained_slot_ends_the_round_for_its_own_late_arrivals() -> None:
    # a continuation queued after the opening pass must get a new round even when no other
    # model has work (otherwise it would wait forever)
    r = rounds(NO_SP)
    r.open("a", 0.0)
    r.end_opening_pass()
    assert not r.close_if_due(1.0, {"a": SlotDemand(waiting=1, running=1)})
    assert r.close_if_due(1.0, {"a": SlotDemand(waiting=1)})
    assert r.next_model({"a": SlotDemand(waiting=1)}) == "a"
    assert r.closes == {SlotClose.DRAINED: 1}


def test_next_model_is_round_robin_after_the_current_one() -> None:
    r = rounds()
    r.open("b", 0.0)
    assert r.next_model({"a": WAITING, "c": WAITING}) == "c"
    assert r.next_model({"a": WAITING, "b": WAITING}) == "a"
    assert r.next_model({"b": WAITING}) == "b"  # only the current one: itself again
    assert r.next_model({"a": SlotDemand(running=3, expected_back_s=0.1)}) is None
    assert r.next_model({}) is None


def test_next_model_before_any_slot_starts_from_the_first() -> None:
    r = rounds()
    assert r.next_model({"a": WAITING, "c": WAITING}) == "a"
    assert r.next_model({"c": WAITING}) == "c"


def test_predict_next_prefers_waiting_work_then_sessions_in_gaps() -> None:
    r = rounds()
    r.open("a", 0.0)
    assert r.predict_next({"a": WAITING, "c": WAITING}) == "c"
    assert r.predict_next({"b": WAITING, "c": WAITING}) == "b"
    gaps = {
        "a": SlotDemand(in_gap=5),  # the current model is never predicted
        "b": SlotDemand(),
        "c": SlotDemand(in_gap=1),
    }
    assert r.predict_next(gaps) == "c"
    assert r.predict_next({**gaps, "b": SlotDemand(in_gap=2)}) == "b"  # round-robin order
    assert r.predict_next({"a": WAITING}) is None
    assert r.predict_next({}) is None


def test_models_ahead_in_round_robin_order() -> None:
    r = rounds()
    assert r.models_ahead("c") == ("a", "b")  # no slot yet: from the first model
    assert r.models_ahead("a") == ()
    r.open("a", 0.0)
    assert r.models_ahead("b") == ()
    assert r.models_ahead("c") == ("b",)
    assert r.models_ahead("a") == ("b", "c")  # its own next slot is a whole round away
    with pytest.raises(UnknownModel):
        r.models_ahead("zzz")
    with pytest.raises(UnknownModel):
        r.open("zzz", 0.0)
    assert r.current == "a"  # the refused open changed nothing


# ---------------------------------------------------------------------------- properties

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _slot_demand(
    calls: int, running: int, wait_s: float, back_s: float, **priced: st.SearchStrategy[float]
) -> st.SearchStrategy[SlotDemand]:
    """Slot demands with up to ``calls`` waiting, returning or in a gap, ``running``
    running, waits up to ``wait_s`` and returns up to ``back_s`` away (and ``priced``)."""
    return st.builds(
        SlotDemand,
        waiting=st.integers(0, calls),
        oldest_wait_s=st.floats(0.0, wait_s),
        running=st.integers(0, running),
        expected_back_s=st.one_of(st.none(), st.floats(0.0, back_s)),
        returning=st.integers(0, calls),
        in_gap=st.integers(0, calls),
        **priced,
    )


_demand = _slot_demand(1000, 256, 1e9, 1e9)
_demands = st.dictionaries(st.sampled_from("abc"), _demand)


@settings(max_examples=examples(300), deadline=None)
@given(
    demands=st.lists(_demands, min_size=1, max_size=20),
    opened=st.sampled_from("abc"),
    times=st.lists(st.floats(0.0, 1e6), min_size=20, max_size=20),
    sp=st.booleans(),
)
def test_slot_decisions_stay_within_the_models_and_their_work(
    demands: list[dict[str, SlotDemand]], opened: str, times: list[float], sp: bool
) -> None:
    r = rounds(SP if sp else NO_SP)
    r.open(opened, 0.0)
    r.end_opening_pass()
    now = 0.0
    for demand, dt in zip(demands, times, strict=False):
        now += dt
        current = r.current
        nxt = r.next_model(demand)
        waiting = {m for m, d in demand.items() if d.waiting}
        assert (nxt is None) == (not waiting) and (nxt is None or nxt in waiting)
        guess = r.predict_next(demand)
        assert guess is None or (guess in r.models and guess != current)
        for m in r.models:
            ahead = r.models_ahead(m)
            assert m not in ahead and set(ahead) <= set(r.models)
        closing = r.close_if_due(now, demand)
        others_wait = any(d.waiting for m, d in demand.items() if m != current)
        if current is not None and r.slot is not None and r.slot.admitting and not others_wait:
            assert not closing  # nobody else needs the device: no switch is worth its cost
        if closing and nxt is not None:
            r.open(nxt, now)
            r.end_opening_pass()
        assert r.may_admit(r.current or "") == bool(
            r.slot and r.slot.admitting and not r.slot.closing
        )


# ---------------------------------------------------------------------------- session-aware

from talaria.config import SlotOrder  # noqa: E402

SRW = PolicyConfig(name="srw", slot_order=SlotOrder.SHORTEST_REMAINING, slot_starvation_s=100.0)


def srw_demand(**per_model: SlotDemand) -> dict[str, SlotDemand]:
    return dict(per_model)


def test_session_aware_opens_the_least_remaining_work_first() -> None:
    r = rounds(SRW)
    demand = {
        "a": SlotDemand(waiting=3, remaining_s=90.0, switch_s=1.0),
        "b": SlotDemand(waiting=3, remaining_s=30.0, switch_s=5.0),
        "c": SlotDemand(waiting=1, remaining_s=40.0, switch_s=1.0),
    }
    assert r.next_model(demand) == "b"  # 30 + 5 < 40 + 1 < 90 + 1
    starving = {**demand, "a": SlotDemand(waiting=3, oldest_wait_s=100.0, remaining_s=90.0)}
    assert r.next_model(starving) == "a"  # waited the starvation bound: it goes next


def test_session_aware_orders_by_work_per_session_smiths_rule() -> None:
    """A slot serves all of its model's sessions, so the key is the slot's device seconds
    (remaining work and switch) per session: a popular model with more work in all but
    less per session goes first, and it may take the device from a model with more."""
    r = rounds(SRW, ("rare", "popular"))
    demand = {
        "popular": SlotDemand(waiting=4, remaining_s=200.0, sessions=10, switch_s=10.0),
        "rare": SlotDemand(waiting=1, remaining_s=30.0, sessions=1, switch_s=1.0),
    }
    assert demand["popular"].slot_per_session_s == 21.0  # (200 + 10) / 10
    assert demand["rare"].slot_per_session_s == 31.0
    assert r.next_model(demand) == "popular"  # 21 < 31, though 210 > 31 in all
    assert r.predict_next(demand) == "popular"
    gapped = {
        "popular": SlotDemand(in_gap=10, remaining_s=200.0, sessions=10),
        "rare": SlotDemand(in_gap=1, remaining_s=30.0, sessions=1),
    }
    assert r.predict_next(gapped) == "popular"  # 20 < 30 per session
    r.open("rare", 0.0)
    r.end_opening_pass()
    mine = SlotDemand(running=1, remaining_s=40.0, sessions=1)  # 40 per session, switch paid
    assert not r.close_if_due(1.0, {"rare": mine, "popular": demand["popular"]})  # 40 < 2 x 21
    mine = SlotDemand(running=2, remaining_s=90.0, sessions=2)  # 45 per session
    assert r.close_if_due(2.0, {"rare": mine, "popular": demand["popular"]})  # 45 > 2 x 21
    assert r.closes == {SlotClose.PREEMPTED: 1}
    assert SlotDemand().slot_per_session_s == 0.0  # no session counted: divide by one
    assert SlotDemand(remaining_s=5.0, switch_s=1.0).slot_per_session_s == 6.0


def test_session_aware_keeps_the_slot_while_its_sessions_work_or_return_soon() -> None:
    r = rounds(SRW)
    r.open("a", 0.0)
    r.end_opening_pass()
    other = SlotDemand(waiting=2, remaining_s=50.0, switch_s=2.0)
    busy = {"a": SlotDemand(running=3, remaining_s=60.0), "b": other}
    assert not r.close_if_due(500.0, busy)  # no quantum: 500 s in, still its turn
    back = {"a": SlotDemand(expected_back_s=3.0, remaining_s=60.0, reload_s=2.0), "b": other}
    assert not r.close_if_due(501.0, back)  # back in 3 s <= switch away (2) + back (2)
    late = {"a": SlotDemand(expected_back_s=5.0, remaining_s=60.0, reload_s=2.0), "b": other}
    assert r.close_if_due(502.0, late)
    assert r.closes == {SlotClose.IDLE: 1}


def test_session_aware_gives_way_for_a_clear_win_or_a_starving_call() -> None:
    r = rounds(SRW)
    r.open("a", 0.0)
    r.end_opening_pass()
    big = SlotDemand(running=4, remaining_s=200.0)
    assert not r.close_if_due(1.0, {"a": big, "b": SlotDemand(waiting=1, remaining_s=100.0)})
    assert r.close_if_due(
        1.0, {"a": big, "b": SlotDemand(waiting=1, remaining_s=98.0, switch_s=1.0)}
    )
    r.open("a", 0.0)
    r.end_opening_pass()
    starving = SlotDemand(waiting=1, oldest_wait_s=100.0, remaining_s=1e9)
    assert r.close_if_due(2.0, {"a": SlotDemand(running=1), "b": starving})
    r.open("a", 0.0)
    r.end_opening_pass()
    assert not r.close_if_due(3.0, {"a": SlotDemand(), "c": SlotDemand()})  # nobody waits
    assert r.closes == {SlotClose.PREEMPTED: 1, SlotClose.STARVED: 1}


def test_session_aware_closes_in_time_for_the_bound_and_serves_the_starved_model() -> None:
    """The slot starts closing once a call's wait, the open batch's drain and its model's
    switch would reach the bound (100 s), and the model it closed for goes next even if
    another has less remaining work and the call has not yet waited the bound."""
    r = rounds(SRW)
    r.open("a", 0.0)
    r.end_opening_pass()
    mine = SlotDemand(running=2, remaining_s=10.0, drain_s=4.0)
    cheap = SlotDemand(waiting=1, oldest_wait_s=50.0, remaining_s=6.0)  # 10 < 2 x 6: no win
    early = SlotDemand(waiting=1, oldest_wait_s=94.0, remaining_s=500.0, switch_s=1.0)
    assert not r.close_if_due(1.0, {"a": mine, "b": early, "c": cheap})  # 94 + 4 + 1 < 100
    due = SlotDemand(waiting=1, oldest_wait_s=95.0, remaining_s=500.0, switch_s=1.0)
    assert r.close_if_due(2.0, {"a": mine, "b": due, "c": cheap})  # 95 + 4 + 1 = 100
    assert r.slot is not None and r.slot.starved == "b"
    drained = {"a": SlotDemand(remaining_s=10.0), "b": due, "c": cheap}
    assert r.next_model(drained) == "b"  # not c, whose remaining work is least
    r.open("b", 3.0)
    assert r.slot is not None and r.slot.starved is None
    assert r.closes == {SlotClose.STARVED: 1}


def test_a_closing_slot_counts_its_reason_once_and_still_serves_the_hungriest() -> None:
    """Once closing, a slot's reason sticks and is counted once; the model it closes for
    still moves to one whose call has waited longer."""
    r = rounds(SRW)
    r.open("a", 0.0)
    r.end_opening_pass()
    mine = SlotDemand(running=2, remaining_s=10.0, drain_s=4.0)
    due = SlotDemand(waiting=1, oldest_wait_s=95.0, remaining_s=500.0, switch_s=1.0)
    assert r.close_if_due(1.0, {"a": mine, "b": due})
    later = SlotDemand(waiting=1, oldest_wait_s=97.0, remaining_s=500.0, switch_s=1.0)
    big = SlotDemand(running=2, remaining_s=5000.0, drain_s=4.0)  # now a clear win too
    assert r.close_if_due(2.0, {"a": big, "b": due, "c": later})
    assert r.slot is not None and r.slot.starved == "c"
    assert r.slot.closed_for is SlotClose.STARVED
    assert r.closes == {SlotClose.STARVED: 1}


def test_two_starving_models_take_turns_a_batch_each() -> None:
    """Both models' calls are past the bound: a slot that just opened admits its batch
    before it gives way to the other (closing it at once would leave both waiting for
    ever, switching back and forth), then closes for the other."""
    r = rounds(SRW)
    starving = SlotDemand(waiting=5, oldest_wait_s=500.0, remaining_s=10.0, switch_s=1.0)
    for model, other in (("a", "b"), ("b", "a"), ("a", "b")):
        r.open(model, 0.0)
        demand = {model: starving, other: starving}
        assert not r.close_if_due(1.0, demand)  # its opening pass comes first
        r.end_opening_pass()
        running = SlotDemand(running=5, remaining_s=10.0, drain_s=2.0)
        assert r.close_if_due(1.1, {model: running, other: starving})
        assert r.next_model({model: SlotDemand(), other: starving}) == other


def test_oldest_waiting_opens_the_model_of_the_oldest_call() -> None:
    r = rounds(PolicyConfig(name="fcfs", slot_order=SlotOrder.OLDEST_WAITING))
    demand = {
        "a": SlotDemand(waiting=9, oldest_wait_s=1.0),
        "c": SlotDemand(waiting=1, oldest_wait_s=5.0),
    }
    assert r.next_model(demand) == "c"


def _busy(demand: dict[str, SlotDemand], current: str | None) -> dict[str, SlotDemand]:
    """``demand`` without its idle models (nothing waiting, running or in a gap), but the open
    slot's: what ``InstanceEstimates.demand`` reports."""
    return {m: d for m, d in demand.items() if m == current or d.waiting or d.running or d.in_gap}


_priced = _slot_demand(
    3,
    3,
    300.0,
    10.0,
    remaining_s=st.floats(0.0, 100.0),
    switch_s=st.floats(0.0, 20.0),
    reload_s=st.floats(0.0, 20.0),
    drain_s=st.floats(0.0, 10.0),
)


@settings(max_examples=examples(300), deadline=None)
@given(
    demands=st.lists(st.dictionaries(st.sampled_from("abcde"), _priced), min_size=1, max_size=12),
    order=st.sampled_from(list(SlotOrder)),
    sp=st.booleans(),
    dts=st.lists(st.floats(0.0, 60.0), min_size=12, max_size=12),
)
def test_leaving_out_idle_models_changes_no_slot_decision(
    demands: list[dict[str, SlotDemand]], order: SlotOrder, sp: bool, dts: list[float]
) -> None:
    policy = PolicyConfig(
        name="p",
        slot_order=order,
        session_prefill=sp,
        slot_max_s=30.0,
        slot_linger_s=2.0,
        slot_starvation_s=100.0,
    )
    models = ("a", "b", "c", "d", "e")
    full, busy = RoundScheduler(models, policy), RoundScheduler(models, policy)
    now = 0.0
    for demand, dt in zip(demands, dts, strict=False):
        now += dt
        pruned = _busy(demand, full.current)
        assert full.next_model(demand) == busy.next_model(pruned)
        assert full.predict_next(demand) == busy.predict_next(pruned)
        if full.current is None:
            nxt = full.next_model(demand)
            if nxt is not None:
                full.open(nxt, now)
                busy.open(nxt, now)
            continue
        assert full.close_if_due(now, demand) == busy.close_if_due(now, pruned)
        assert full.state == busy.state and full.slot == busy.slot
        if full.slot is not None and full.slot.closing:
            nxt = full.next_model(demand)
            for r in (full, busy):
                r.end_slot()
                if nxt is not None:
                    r.open(nxt, now)
        else:
            full.end_opening_pass()
            busy.end_opening_pass()


@settings(max_examples=examples(200), deadline=None)
@given(
    opened=st.one_of(st.none(), st.integers(0, 7)),
    waiting=st.sets(st.integers(0, 7)),
    gapped=st.sets(st.integers(0, 7)),
)
def test_round_robin_picks_the_first_model_with_work_after_the_open_one(
    opened: int | None, waiting: set[int], gapped: set[int]
) -> None:
    models = tuple("abcdefgh")
    r = RoundScheduler(models, SP)
    start = -1
    if opened is not None:
        r.open(models[opened], 0.0)
        start = opened
    ring = [models[(start + k) % 8] for k in range(1, 9)]  # every model once, after the open
    demand = {models[i]: SlotDemand(waiting=1) for i in waiting}
    for i in gapped - waiting:
        demand[models[i]] = SlotDemand(in_gap=1)
    want = [m for m in ring if m in demand and demand[m].waiting]
    assert r.next_model(demand) == (want[0] if want else None)
    others = [m for m in want if m != r.current]
    back = [m for m in ring if m != r.current and m in demand and demand[m].in_gap]
    assert r.predict_next(demand) == (others[0] if others else back[0] if back else None)
