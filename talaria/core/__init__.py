"""The pure core: one instance's and the cluster's policy and memory, composed.

:class:`~talaria.core.instance.InstanceCore` (one instance: its calls, KV manager, weight
arena, slots, admission) and :class:`~talaria.core.cluster.ClusterCore` (the instances, the
session table, routing) decide; they never touch tensors, never do I/O and never read a
clock. The simulator (:mod:`talaria.sim`) and the drivers of real executors
(:mod:`talaria.runtime`) run this same code: only the executor and the clock differ
(docs/architecture.md).
"""
