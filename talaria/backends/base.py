"""The substrate protocol: what executes one instance's decisions.

An instance's decisions come from its :class:`~talaria.runtime.instance.InstanceCore`
(routing happens above it, in the cluster core). A substrate executes them: the embedded
PyTorch engine runs them on tensors (:mod:`talaria.backends.embedded`); vLLM engines will
take them where users have GPUs. The simulator executes the same decisions in virtual time
with the cost model, driving the core directly from its event loop.

Contract: ``step(now)`` performs one action the core schedules (KV moves, a weight switch or
stage, one batched forward) and returns the calls that finished in it; a finished call's
generated ids are then available once from ``take_output``. Not thread-safe: one task drives
a substrate.
"""

from __future__ import annotations

from typing import Protocol

from talaria.memory.kv import CallKey
from talaria.runtime.instance import InstanceCore, Request


class Substrate(Protocol):
    @property
    def core(self) -> InstanceCore: ...

    @property
    def idle(self) -> bool: ...

    def step(self, now: float) -> list[Request]: ...

    def take_output(self, key: CallKey) -> tuple[int, ...]: ...
