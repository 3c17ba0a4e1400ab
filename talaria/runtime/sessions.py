"""A live session's record in the runtime (calls made and in flight, last activity for
expiry, the lock that keeps its calls one at a time; keyed by ``SessionKey`` like the
cluster core's ``Session``) and its summary at its end. Mutated on the event loop thread only
(:mod:`talaria.runtime.live`)."""

from __future__ import annotations

import anyio
import attrs


@attrs.define
class LiveSession:
    start_s: float
    last_s: float
    calls: int = 0  # accepted so far (the next call's index)
    in_flight: int = 0
    # calls of one session run one at a time (a semaphore: released by whichever task ends
    # the call's stream, which need not be the task that acquired it)
    lock: anyio.Semaphore = attrs.field(factory=lambda: anyio.Semaphore(1))


@attrs.frozen
class SessionSummary:
    """A session at its end: completion time from its first call's arrival (seconds)."""

    session_id: str
    sct_s: float
    calls: int
    expired: bool = False
