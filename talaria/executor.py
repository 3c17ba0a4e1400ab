"""The executor protocol: the whole of what a driver asks of whatever runs an instance's steps.

The driver (the live loop, :mod:`talaria.runtime.live`; a script's
:class:`~talaria.runtime.local.LocalInstance`) owns the instance's core and the calls. Each
step it asks the core for a decision (a :class:`~talaria.schedule.Schedule`), captures where
that decision sits in memory (a :class:`~talaria.schedule.Placement`), hands the executor one
:class:`Work`, and reports the :class:`~talaria.schedule.Executed` it gets back to the core
(``InstanceCore.commit``). An executor only executes: KV moves, a weight switch or stage, the
forward and sampling. It holds no policy core and no call of its own beyond what it needs to
sample (a seeded generator, an engine's request), which it drops when a call is named in
``Work.dropped``. The embedded PyTorch engine (:class:`talaria.engine.runner.EngineRunner`),
vLLM engines (:class:`talaria.backends.vllm.executor.VllmExecutor`) and an engine in a Ray
actor (:class:`talaria.backends.ray.executor.RayExecutor`) implement it.

Threading: ``execute`` and ``restart`` run on a worker thread, one at a time per executor; the
driver does not mutate a :class:`CallRecord` of a call in a ``Work`` while it executes.

Nothing here imports a tensor library (docs/architecture.md, "Executors").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import attrs

from talaria.generation import SamplingParams, TokenLogprob
from talaria.memory.kv import CallKey
from talaria.schedule import Executed, Placement, Schedule

__all__ = ["CallRecord", "Executor", "Layout", "Work"]


@attrs.frozen
class Layout:
    """An instance's fixed memory layout, which the executor's buffers are sized by and the
    core's plans index into: the weight arena (``arena_bytes``, one region of
    ``region_bytes`` per execution slot at ``region_offsets``), the KV pool
    (``device_blocks`` + ``host_blocks`` blocks of ``block_bytes``), per model its weight
    bytes, KV bytes per token and tokens per KV block, and the models whose weights the
    instance starts with in host memory (the rest start on disk)."""

    arena_bytes: int
    region_bytes: int
    region_offsets: tuple[int, ...]
    device_blocks: int
    host_blocks: int
    block_bytes: int
    models: tuple[str, ...]
    weight_bytes: tuple[int, ...]
    kv_bytes_per_token: tuple[int, ...]
    tokens_per_block: tuple[int, ...]
    host_models: tuple[str, ...] = ()  # whose weights the arena starts with on host

    def tpb(self, model: str) -> int:
        """Tokens one KV block of ``model`` holds."""
        return self.tokens_per_block[self.models.index(model)]

    def weights_of(self, model: str) -> int:
        return self.weight_bytes[self.models.index(model)]

    def kv_per_token(self, model: str) -> int:
        return self.kv_bytes_per_token[self.models.index(model)]


@attrs.define(eq=False)
class CallRecord:
    """One call, as its driver keeps it: how to sample it and what it generated.

    ``prompt``: the ids the core prefills; ``params``: how to draw (ids below
    ``vocab_limit`` only), or exactly ``forced`` (a replay's answer; the forward still
    runs); ``resumed``: the prompt's last ``resumed`` ids are the call's own answer so far,
    drawn on an instance that was lost (the executor catches its sampling state up with
    them, where it can). ``outputs`` and ``logprobs`` (one per output id, for params that
    ask) grow by the driver from each ``Executed``; executors only read them."""

    key: CallKey
    model: str
    prompt: tuple[int, ...]
    params: SamplingParams
    vocab_limit: int | None = None
    forced: tuple[int, ...] | None = None
    resumed: int = 0
    outputs: list[int] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)

    def add(self, token: int, logprob: TokenLogprob | None) -> None:
        """One generated id (and its logprob, if the params ask for them)."""
        self.outputs.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)


@attrs.frozen
class Work:
    """One step for an executor: the core's ``schedule``, where it sits (``where``, as the
    core was when it planned it), the records of the schedule's calls (``calls``, keyed as
    ``schedule.requests``), and the calls that ended since the executor's previous step
    (``dropped``: whatever the executor keeps for them may go, an engine request aborted)."""

    schedule: Schedule
    where: Placement
    calls: Mapping[CallKey, CallRecord] = attrs.field(factory=dict)
    dropped: tuple[CallKey, ...] = ()

    @property
    def empty(self) -> bool:
        return self.schedule.empty and not self.dropped


class Executor(Protocol):
    """Runs one instance's steps (the module docstring)."""

    @property
    def executes_kv_moves(self) -> bool:
        """Whether the core's planned KV moves really run here (the embedded engine copies
        them; vLLM manages its own cache, so the driver does not count them as moved)."""
        ...

    def vocab_size(self, model: str) -> int | None:
        """Token ids ``model`` accepts (None: not served here)."""
        ...

    def execute(self, work: Work) -> Executed:
        """Carry ``work`` out. Raises ``InstanceLost`` when the instance's process is gone;
        any other exception fails the step (its calls are released by the driver)."""
        ...

    def restart(self, layout: Layout) -> None:
        """After ``InstanceLost``: serve a fresh core of ``layout`` (no weights resident, no
        KV, every call's state dropped). Raises ``InstanceLost`` while the instance is still
        gone (the driver tries again later)."""
        ...
