"""The ``Talaria.stats()`` snapshot: a JSON-able picture of a live cluster.

A function of ``talaria.runtime.live.LiveCluster`` alone (instances' KV tiers, queues,
reservations, counters; sessions; calls; events). Read by the HTTP server's ``/health`` and
its Prometheus collector (``talaria.server.metrics``), whose names follow these keys.
"""

from __future__ import annotations

from typing import Any

from talaria.core.counters import instance_counters
from talaria.runtime.live import LiveCluster


def snapshot(live: LiveCluster) -> dict[str, Any]:
    """A JSON-able snapshot of ``live``: per instance KV blocks per tier, queue,
    reservations, active model and counters; sessions; totals. Reads only."""
    instances: dict[str, Any] = {}
    switches = moved = 0
    for name, inst in live.core.instances.items():
        kv = inst.kv
        counters = instance_counters(inst)
        switches += inst.counters.model_switches
        moved += inst.counters.weight_bytes_moved + inst.counters.kv_bytes_moved
        instances[name] = {
            "active_model": inst.arena.active_model,
            "queue_depth": sum(len(q) for q in inst.waiting.values()),
            "running": len(inst.running),
            "reservations_held": len(inst.admission.held),
            "healthy": not live.drivers[name].down,
            "lost": live.drivers[name].lost,  # its process is gone (Ray); rejoins when back
            "kv_blocks": {
                "device_total": kv.device_blocks,
                "device_free": kv.device_free,
                "device_used": kv.device_blocks - kv.device_free,
                "host_total": kv.host_blocks,
                "host_free": kv.host_free,
                "host_used": kv.host_blocks - kv.host_free,
            },
            "counters": counters,
        }
    return {
        "instances": instances,
        "sessions": {
            "active": len(live.sessions),
            "ended": live.ended_sessions,
            "expired": live.expired_sessions,
            "total": len(live.sessions) + live.ended_sessions,
            "max_per_tenant": live.gate.max_sessions_per_tenant,
        },
        "calls": {
            "in_flight": len(live.calls),
            "finished": sum(i.counters.calls_finished for i in live.core.instances.values()),
            "failed": live.calls_failed,
            "refused": live.gate.refused,  # 429: max_calls, a tenant's share or token budget
            "rerouted": live.calls_rerouted,  # moved off a lost instance before streaming
            "resumed": live.calls_resumed,  # moved off a lost instance mid-stream, answer kept
            "tokens_recomputed": live.tokens_recomputed,
            "max": live.gate.max_calls,
            "max_per_tenant": live.gate.max_calls_per_tenant,
            "tokens_per_minute_per_tenant": live.gate.quotas.per_minute,
        },
        "instances_lost": live.instances_lost,
        "events": dict(live.events),
        "tool_gaps": _tool_gaps(live),
        "model_switches": switches,
        "bytes_moved": moved,
    }


def _tool_gaps(live: LiveCluster) -> dict[str, dict[str, float]]:
    """What the server learned of tool gaps, per key (a tool's name, ``untold`` for gaps
    nothing named): expected seconds and how many gaps taught it."""
    learner = live.core.learner
    if learner is None:
        return {}
    return {
        key: {"expected_s": seconds, "observations": learner.observations(key)}
        for key, seconds in sorted(learner.estimates().items())
    }
