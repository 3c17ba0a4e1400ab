"""One price for a schedule: what the simulator's clock, the live loop's step timing and the
instance core's switch estimate all use, so a schedule is priced once, the same way.

A schedule's *serial* time holds its instance: its KV block moves, then the weight switch or
the engine step (with the step's own KV moves). A weight *stage* runs alongside (a copy into
lent KV blocks while steps go on) and is priced as *background* time: it delays nothing
until a switch waits for it.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from talaria.cost.estimator import Estimator
from talaria.cost.step_shape import StepShape
from talaria.memory.kv import MovePlan
from talaria.memory.weights import SwitchPlan
from talaria.schedule import Schedule, StepPlan

__all__ = ["Price", "moves_s", "plan_copy_s", "price", "step_s"]


def moves_s(est: Estimator, moves: Iterable[MovePlan]) -> float:
    """Seconds to run KV block moves one after another."""
    return sum(est.copy_s(m.nbytes, m.link) for m in moves)


def plan_copy_s(est: Estimator, plan: SwitchPlan) -> float:
    """Seconds to run a weight switch or stage plan: its wait for devices (a switch that
    wakes an instance at zero), then its copies one after another."""
    return plan.provision_s + sum(est.copy_s(s.nbytes, s.link) for s in plan.steps)


def step_s(est: Estimator, step: StepPlan, repeat: int = 1) -> float:
    """Seconds of ``repeat`` identical decode steps of ``step`` back to back (1: the step as
    planned); the decode context grows by one token per sequence per step, priced at the
    mean context of the run."""
    n = len(step.decode)
    context = step.decode_context_tokens + n * (repeat - 1) / 2
    prefix = sum(start for _, _, start in step.prefill)  # cached tokens before the chunks
    shape = StepShape(
        step.prefill_tokens, step.prefill_attn_tokens, n, int(context), len(step.prefill), prefix
    )
    return est.step_s(step.model, shape) * repeat


@attrs.frozen
class Price:
    """Seconds a schedule costs on one instance (see the module docstring)."""

    kv_s: float = 0.0  # the schedule's KV moves, and its step's
    switch_s: float = 0.0
    step_s: float = 0.0
    background_s: float = 0.0  # a stage copy alongside

    @property
    def serial_s(self) -> float:
        """What holds the instance: KV moves, then the switch or the step."""
        return self.kv_s + self.switch_s + self.step_s


def price(est: Estimator, sched: Schedule, repeat: int = 1) -> Price:
    """The price of executing ``sched`` (``repeat`` decode-only steps when it is one)."""
    kv = moves_s(est, sched.kv_moves)
    switch = plan_copy_s(est, sched.switch) if sched.switch is not None else 0.0
    step = 0.0
    if sched.step is not None:
        kv += moves_s(est, sched.step.kv_moves)
        step = step_s(est, sched.step, repeat)
    stage = plan_copy_s(est, sched.stage) if sched.stage is not None else 0.0
    return Price(kv, switch, step, stage)
