"""The live loop's record of executed schedules: what each did, how long it took, and
what the simulator's cost model would have priced it at (the fidelity reports read it)."""

from __future__ import annotations

from typing import Final

import attrs

from talaria.cost.estimator import Estimator
from talaria.cost.pricing import price
from talaria.schedule import Schedule

__all__ = ["STEP_LOG", "StepTiming"]

STEP_LOG: Final = 100_000  # executed schedules remembered for inspection


@attrs.frozen
class StepTiming:
    """One executed schedule: what it did and how long the executor took (seconds)."""

    instance: str
    start_s: float
    seconds: float
    model: str | None
    prefill_tokens: int
    decodes: int
    context_tokens: int
    prefill_chunks: int  # sequences prefilling in the step
    prefill_attn_tokens: float  # keys their tokens attend in all (cached prefixes included)
    switch_bytes: int
    stage_bytes: int
    kv_bytes: int
    predicted_s: float  # the simulator's price of it (``talaria.cost.pricing``), serial part
    loop_cpu_s: float = 0.0  # CPU time the event loop's thread used while the step ran

    @classmethod
    def of(
        cls,
        instance: str,
        sched: Schedule,
        start_s: float,
        seconds: float,
        est: Estimator,
        loop_cpu_s: float = 0.0,
    ) -> StepTiming:
        step = sched.step
        moves = list(sched.kv_moves) + (list(step.kv_moves) if step is not None else [])
        kv = sum(m.nbytes for m in moves)
        # the simulator's price of the same schedule: a stage runs alongside, not in series
        predicted = price(est, sched).serial_s
        return cls(
            instance,
            start_s,
            seconds,
            step.model if step is not None else None,
            step.prefill_tokens if step is not None else 0,
            len(step.decode) if step is not None else 0,
            step.decode_context_tokens if step is not None else 0,
            len(step.prefill) if step is not None else 0,
            step.prefill_attn_tokens if step is not None else 0.0,
            sched.switch.total_bytes if sched.switch is not None else 0,
            sched.stage.total_bytes if sched.stage is not None else 0,
            kv,
            predicted,
            loop_cpu_s,
        )
