"""Keep-alive: when an instance with nothing to serve scales to zero.

Serverless pools give an idle instance's devices back after a keep-alive timer, and the
next call there pays a cold start: its model's weights come back from host memory or disk
and its sessions' KV from the host tier. The timer trades provisioned device-seconds against
those cold starts. Per-request schedulers know only the timer (``keep_alive_s`` after the
instance's last work; Continuum's TTL pins, ``ttl-pin``, are reservations too). A
session-aware policy also knows which sessions are about to come back: a soft reservation
(``talaria.policy.admission``) is its bet that a session returns within the horizon, so an
instance holding one stays provisioned until the reservation ends (the session came back,
its hold ran out, or its return became unlikely).

Pure policy: no clock, no state; the instance core asks, the driver (simulator, live loop)
keeps the time.
"""

from __future__ import annotations

from collections.abc import Iterable

from talaria.config import PolicyConfig
from talaria.policy.admission import Reservation


def release_at(policy: PolicyConfig, idle_since_s: float, held: Iterable[Reservation]) -> float:
    """When an instance idle since ``idle_since_s`` (no call waiting or running) scales to
    zero: ``policy.keep_alive_s`` later, and not before the last of its reservations ``held``
    ends. Infinity: never (the default ``keep_alive_s``)."""
    until = idle_since_s + policy.keep_alive_s
    for res in held:
        until = max(until, res.deadline_s)
    return until
