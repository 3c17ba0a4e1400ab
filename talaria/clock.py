"""Clocks: the live runtime reads the wall clock; the simulator advances a virtual one.

Policy and memory code take a ``Clock`` (or plain ``now`` floats) and never call ``time``
themselves, so the same objects run live and in simulation.
"""

from __future__ import annotations

import time
from typing import Protocol

from talaria.errors import ConfigError


class Clock(Protocol):
    """Seconds as a float, monotonic non-decreasing."""

    def now(self) -> float: ...


class WallClock:
    """Monotonic wall clock, zeroed at construction."""

    def __init__(self) -> None:
        self._origin = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._origin


class VirtualClock:
    """A clock the simulator moves forward explicitly. Never goes backwards."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        """Set the time to ``t`` seconds; ``t`` earlier than now is an error."""
        if t < self._now:
            raise ConfigError(f"virtual clock cannot go back from {self._now} to {t}")
        self._now = t
