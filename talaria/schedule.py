"""What an instance core decides and an executor executes: plain data, no torch, no I/O.

``Request`` is a call inside an instance (computed tokens catching up with known tokens);
``StepPlan`` is one engine iteration; ``Schedule`` is the next thing to do (a step, a
weight switch, a stage, KV moves); ``Executed`` is what an executor reports back from
executing a schedule (the tokens it sampled). The instance core (``talaria.runtime``) makes
them; executors (``talaria.executor``: the engine, vLLM, Ray) and the simulator read them:
they sit below both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import attrs

from talaria.generation import TokenLogprob
from talaria.memory.kv import CallKey, MovePlan
from talaria.memory.weights import SwitchPlan
from talaria.types import Call, TokenSeq

__all__ = ["Executed", "Placement", "Request", "Schedule", "StepPlan"]


@attrs.define(eq=False)
class Request:
    """A call inside an instance: computed tokens catching up with known tokens."""

    call: Call
    history: TokenSeq | None  # prompt + answer when known in advance (replay); else built
    target_output: int  # tokens to generate
    queued_s: float
    known_tokens: int = 0  # tokens of this prompt the session had computed before
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    computed: int = 0  # prompt tokens whose KV exists
    generated: int = 0
    reused_tokens: int = 0
    restored_tokens: int = 0
    recomputed_tokens: int = 0
    sp_admitted: bool = False
    error: str | None = None
    blocks: tuple[int, ...] = ()  # device block table in token order, set at admission
    stopped: bool = False  # ended early (end-of-sequence); see ``InstanceCore.stop``
    session_start_s: float | None = None  # its session's first call (program-level FCFS)

    @property
    def program_s(self) -> float:
        """When the call's session (program) started: its own arrival if not known."""
        return self.session_start_s if self.session_start_s is not None else self.call.arrival_s

    @property
    def key(self) -> CallKey:
        return self.call.key

    @property
    def prompt_len(self) -> int:
        return self.call.prompt_tokens

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    @property
    def done(self) -> bool:
        return self.stopped or self.generated >= self.target_output


@attrs.frozen
class StepPlan:
    """One engine iteration: prefill chunks ``(key, n_tokens, start)`` and decodes.

    ``repeat`` is how many identical decode-only steps may run back to back (the simulator
    fast-forwards; an engine runs one). ``kv_moves`` run before the step.
    """

    model: str
    prefill: tuple[tuple[CallKey, int, int], ...]
    decode: tuple[CallKey, ...]
    decode_context_tokens: int
    kv_moves: tuple[MovePlan, ...]
    repeat: int = 1

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n, _ in self.prefill)

    @property
    def prefill_attn_tokens(self) -> float:
        """Sum over prefill tokens of the context each attends to."""
        return sum(n * (start + (n + 1) / 2) for _, n, start in self.prefill)


@attrs.frozen
class Schedule:
    """What to do next. At most one of ``switch`` / ``step``; ``stage`` runs alongside.

    ``kv_moves`` (reclaims, evictions) run first even when nothing else does.
    """

    step: StepPlan | None = None
    switch: SwitchPlan | None = None
    stage: SwitchPlan | None = None
    kv_moves: tuple[MovePlan, ...] = ()
    waiting_for_stage: bool = False
    # the step's running calls, captured when scheduled (an executor running the step on
    # another thread reads these, never the core's mutable tables)
    requests: Mapping[CallKey, Request] = attrs.field(factory=dict)

    @property
    def idle(self) -> bool:
        return self.step is None and self.switch is None

    @property
    def empty(self) -> bool:
        """Nothing at all to execute: no step, switch, stage or KV move."""
        return self.idle and self.stage is None and not self.kv_moves


@attrs.frozen
class Executed:
    """What an executor did with one schedule (``talaria.executor``): the tokens it sampled,
    one per sequence whose prompt is complete, in step order, with their logprobs for the
    calls whose params ask (``logprobs``: call and entry, in the same order); the calls whose
    sampling failed (``failed``: the call and why; they sampled nothing and must be released,
    the step's other calls are unharmed); the calls its engine ended with no token this step
    (``silent``: vLLM stopped them on its own); the prompt tokens its engine found cached
    for calls that got their first token (``cached``: vLLM's own prefix-cache hits). A
    stage copied in the background is not done with the step (``stage_pending``); it is
    reported when it lands (``stage_landed``: the model and the lent blocks it filled)."""

    sampled: tuple[tuple[Request, int], ...] = ()
    failed: tuple[tuple[Request, str], ...] = ()
    logprobs: tuple[tuple[CallKey, TokenLogprob], ...] = ()
    silent: frozenset[CallKey] = frozenset()
    cached: tuple[tuple[CallKey, int], ...] = ()
    stage_pending: bool = False
    stage_landed: tuple[str, tuple[int, ...]] | None = None


class _Layout(Protocol):
    """What ``Placement.of`` reads of an instance core."""

    @property
    def arena(self) -> _Regions: ...

    @property
    def stage_blocks(self) -> tuple[int, ...]: ...


class _Regions(Protocol):
    def region_of(self, model: str) -> int | None: ...

    @property
    def staged_bytes(self) -> int: ...

    @property
    def staging_in_progress(self) -> str | None: ...


@attrs.frozen
class Placement:
    """Where a schedule's work sits, as its core saw it when it planned the schedule: the
    weight region of the step's model (None without a step, or if it is in none), the
    KV blocks lent to the weight stage, in order (what a stage fills and a switch to the
    staged model reads), how many bytes of the staged model go there, and the model whose
    stage the core still waits for (``staging``: an executor whose background copy is of
    another model, or into other blocks, stops it before the blocks are reused)."""

    region: int | None
    stage_blocks: tuple[int, ...] = ()
    staged_bytes: int = 0
    staging: str | None = None

    @classmethod
    def of(cls, core: _Layout, sched: Schedule) -> Placement:
        region = core.arena.region_of(sched.step.model) if sched.step is not None else None
        arena = core.arena
        return cls(region, core.stage_blocks, arena.staged_bytes, arena.staging_in_progress)
