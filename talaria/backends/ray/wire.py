"""What crosses the process boundary between an instance's core and its Ray actor.

Plain picklable data, no tensors. A call's prompt crosses once (``NewCall``, with the first
schedule that runs it); each schedule then carries only its plan, the block tables of the
calls it runs and the calls to drop (``WireSchedule``); the actor answers with the ids it
sampled (``WireResult``).
"""

from __future__ import annotations

import attrs

from talaria.generation import SamplingParams, TokenLogprob
from talaria.memory.kv import CallKey, MovePlan
from talaria.memory.weights import SwitchPlan
from talaria.schedule import Placement, StepPlan

__all__ = ["NewCall", "WireResult", "WireSchedule"]


@attrs.frozen
class NewCall:
    """A call the actor has not seen: its prompt ids and how to sample it (``forced``: a
    replay's exact answer ids; ``resumed``: the prompt's last ids are its own answer so far,
    from an instance that was lost)."""

    key: CallKey
    model: str
    prompt: tuple[int, ...]
    target_output: int
    params: SamplingParams | None = None
    vocab_limit: int | None = None
    forced: tuple[int, ...] | None = None
    resumed: int = 0


@attrs.frozen
class WireSchedule:
    """One schedule as the actor executes it: the core's plan, where it sits
    (``Placement``), each running call's device block table, the calls first seen here,
    and the calls the core is done with (their state on the actor is dropped first)."""

    kv_moves: tuple[MovePlan, ...]
    step: StepPlan | None
    switch: SwitchPlan | None
    stage: SwitchPlan | None
    placement: Placement
    blocks: tuple[tuple[CallKey, tuple[int, ...]], ...] = ()
    new: tuple[NewCall, ...] = ()
    drop: tuple[CallKey, ...] = ()


@attrs.frozen
class WireResult:
    """The ids the actor sampled, in step order, the logprob entry of each one whose call
    asked for logprobs, the calls whose sampling failed (with why), and as
    :class:`~talaria.schedule.Executed` says, the calls the engine ended without a token
    (``silent``) and the prompt tokens it found cached (``cached``)."""

    sampled: tuple[tuple[CallKey, int], ...]
    logprobs: tuple[tuple[CallKey, TokenLogprob], ...] = ()
    failed: tuple[tuple[CallKey, str], ...] = ()
    silent: frozenset[CallKey] = frozenset()
    cached: tuple[tuple[CallKey, int], ...] = ()
