"""One price for a schedule (``talaria.cost.pricing``), with round-number costs: copies at
1e9 B/s, prefill 1000 tok/s, a decode step 0.01 s."""

from __future__ import annotations

import pytest

from talaria.cost.pricing import price, step_s
from talaria.memory.kv import MovePlan
from talaria.memory.weights import CopyStep, SwitchPlan
from talaria.schedule import Schedule, StepPlan
from talaria.types import Link
from tests.helpers import RoundNumberEstimator

EST = RoundNumberEstimator()
DEMOTE = MovePlan(Link.DEVICE_TO_HOST, ((0, 1), (2, 3)), block_bytes=10**8)  # 0.2 s
RESTORE = MovePlan(Link.HOST_TO_DEVICE, ((5, 6),), block_bytes=10**8)  # 0.1 s
STAGE = SwitchPlan("B", (CopyStep("B", Link.HOST_TO_DEVICE, 3 * 10**9),), region=1)  # 3 s
SWITCH = SwitchPlan("B", (CopyStep("B", Link.HOST_TO_DEVICE, 2 * 10**9),), region=0)  # 2 s


def step(prefill: int = 500, decodes: int = 2) -> StepPlan:
    keys = tuple(("s", i) for i in range(decodes))
    return StepPlan("A", ((("p", 0), prefill, 0),) if prefill else (), keys, 100, (RESTORE,))


def test_a_step_with_moves_and_a_stage_alongside() -> None:
    p = price(EST, Schedule(step=step(), stage=STAGE, kv_moves=(DEMOTE,)))
    assert p.kv_s == pytest.approx(0.3)  # the schedule's demotion, then the step's restore
    assert p.step_s == pytest.approx(0.5 + 0.01)
    assert p.switch_s == 0.0
    assert p.background_s == pytest.approx(3.0)  # the stage does not hold the instance
    assert p.serial_s == pytest.approx(0.81)


def test_a_switch_and_moves_alone() -> None:
    assert price(EST, Schedule(switch=SWITCH, kv_moves=(DEMOTE,))).serial_s == pytest.approx(2.2)
    assert price(EST, Schedule(kv_moves=(DEMOTE,))).serial_s == pytest.approx(0.2)
    assert price(EST, Schedule()).serial_s == 0.0


def test_repeated_decode_steps_are_priced_per_step() -> None:
    decode_only = step(prefill=0, decodes=3)
    assert step_s(EST, decode_only, repeat=7) == pytest.approx(7 * 0.01)
    assert price(EST, Schedule(step=decode_only), repeat=7).step_s == pytest.approx(0.07)
