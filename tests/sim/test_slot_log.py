"""``SlotLog``: the model slots of each instance, as its driver switches models."""

from __future__ import annotations

from talaria.sim.simulator import SlotLog, SlotRecord


def test_a_switch_ends_the_last_stretch_and_the_end_closes_the_open_ones() -> None:
    log = SlotLog()
    log.switch("i0", "A", 0.0)
    log.opened("i0", "A", 1.0)
    log.switch("i1", "B", 0.5)
    log.opened("i1", "B", 0.75)
    log.switch("i0", "C", 4.0)
    log.opened("i0", "C", 4.5)
    assert log.records(10.0) == (
        SlotRecord("i0", "A", 0.0, 1.0, 4.0),
        SlotRecord("i1", "B", 0.5, 0.75, 10.0),
        SlotRecord("i0", "C", 4.0, 4.5, 10.0),
    )


def test_an_opening_of_another_model_is_ignored_and_an_unopened_slot_ends_at_its_switch() -> None:
    log = SlotLog()
    log.switch("i0", "A", 2.0)
    log.opened("i0", "B", 3.0)  # not the model being switched to: a stale report
    log.opened("i9", "A", 3.0)  # an instance that never switched
    assert log.records(1.0) == (SlotRecord("i0", "A", 2.0, 2.0, 2.0),)
    assert SlotLog().records(5.0) == ()
