"""Memory pressure as a scenario knob: size each instance's device KV pool as a fraction of
the KV the workload's sessions would hold at their longest.

The *working set* of a workload is the sum over its sessions of the KV bytes of its longest
history (prompt plus answer) on its model, with the instance's KV replication; spread
evenly over the instances, it is what each would hold if every session were resident at
once. ``with_kv_fraction(cluster, spec, f)`` gives every instance the device memory whose
usable share holds its weight arena plus ``f`` times its share of that working set (1.0:
all of it; 0.1: a tenth, so sessions in tool gaps compete for KV; large: plenty). The
weights, the host tier and everything else stay as they were.
"""

from __future__ import annotations

import math

import attrs

from talaria.config import ClusterConfig
from talaria.errors import ConfigError
from talaria.swebench_replay.runs import WorkloadSpec, workload


def working_set_bytes(cluster: ClusterConfig, spec: WorkloadSpec, seed: int = 0) -> int:
    """KV bytes of every session's longest history on its model (seed ``seed``'s sample),
    with the KV replication of the cluster's first instance's tensor-parallel degree."""
    replay = workload(spec, seed).replay
    n = cluster.instances[0].n_devices
    total = 0
    for s in replay.sessions:
        longest = max(len(c.history) for c in s.calls)
        total += longest * cluster.model(s.model).kv_bytes_per_token_on(n)
    return total


def with_kv_fraction(
    cluster: ClusterConfig, spec: WorkloadSpec, fraction: float, seed: int = 0
) -> ClusterConfig:
    """``cluster`` with each instance's device KV pool ``fraction`` of its share of the
    workload's working set (module docstring). ``ConfigError`` for a fraction that is not
    positive and finite."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ConfigError(f"kv fraction must be a number, got {fraction!r}")
    if not math.isfinite(fraction) or fraction <= 0:
        raise ConfigError(f"kv fraction must be positive and finite, got {fraction!r}")
    share = working_set_bytes(cluster, spec, seed) / len(cluster.instances)
    instances = []
    for inst in cluster.instances:
        models = cluster.models_on(inst)
        arena = inst.weight_regions * max(m.weight_bytes for m in models)
        usable = arena + fraction * share
        device = math.ceil(usable / inst.memory_utilization) + 1
        instances.append(attrs.evolve(inst, device_memory_bytes=device))
    return ClusterConfig(cluster.models, tuple(instances))
