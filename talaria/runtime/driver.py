"""One instance's driver state in the live loop (:mod:`talaria.runtime.live`).

The loop's driver task for an instance keeps here what lives between its steps: the
executor it drives, the calls to drop and to abort, its failure and recovery state, and
the plan a placement made for it while it waited (``planned``). It is touched only on the
event loop thread.
"""

from __future__ import annotations

import anyio
import attrs

from talaria.errors import TalariaError
from talaria.executor import Executor
from talaria.memory.kv import CallKey
from talaria.schedule import Schedule


@attrs.define
class Driver:
    """What one instance's driver task keeps between steps."""

    runner: Executor
    dropped: list[CallKey] = attrs.field(factory=list)  # ended calls the executor may forget
    wake: anyio.Event = attrs.field(factory=anyio.Event)
    aborts: list[tuple[CallKey, TalariaError]] = attrs.field(factory=list)
    failures: int = 0
    down: bool = False
    backoff_s: float = 0.0  # wait before the next recovery attempt (set by the cluster)
    downs: int = 0  # times taken out of service
    lost: bool = False  # its process is gone (InstanceLost): it comes back with restart
    limiter: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))
    idle: bool = False  # waiting for work (``wait``): a placement plans its next schedule
    planned: Schedule | None = None  # planned at a placement, to run next
    idle_since: float | None = None  # when its instance last ran out of calls (keep-alive)

    async def wait(self, timeout: float) -> None:
        """Wait for ``wake`` (work, an event, a placement) or ``timeout`` seconds."""
        self.idle = True
        try:
            with anyio.move_on_after(timeout):
                await self.wake.wait()
        finally:
            self.idle = False
        self.wake = anyio.Event()
