"""A cluster whose instances run vLLM engines in Ray actors (``backend = "vllm"`` with
``ray``): the serving side of :mod:`talaria.backends.ray.vllm_worker`.

:func:`build_ray_vllm_cluster` reads each model's directory here (its shape, tokenizer and
end ids: what the API and the cores need; the actors' nodes hold the same directories at
the same paths), connects to Ray, starts one :class:`~talaria.backends.ray.vllm_worker.
VllmWorker` actor per instance and their engines (in parallel: each actor on its own node
starts its engines), sizes every instance from what the engines report (sleep mode, block
size, device memory; :func:`~talaria.backends.vllm.cluster.instance_specs`), builds the
cluster core, attaches the actors with their layouts, and wraps each in a
:class:`~talaria.backends.ray.executor.RayExecutor`. Placement and restarts as for the
embedded engine's actors (:mod:`talaria.backends.ray.cluster`); a re-attached actor starts
its engines afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import ray

from talaria.backends.ray.cluster import (
    DEFAULT_RESOURCE,
    LOCAL,
    OnNode,
    RayCluster,
    actor_options,
    attach_all,
    check_resource,
    close_actors,
    connect,
)
from talaria.backends.ray.vllm_worker import EngineFacts, VllmWorker
from talaria.backends.vllm.catalog import VllmModel
from talaria.backends.vllm.cluster import ServedModels, instance_specs, loaded_from
from talaria.config import PolicyConfig
from talaria.errors import ConfigError

__all__ = ["START_TIMEOUT_S", "build_ray_vllm_cluster"]

START_TIMEOUT_S: Final = 1800.0  # every actor's engines started (minutes each on a CPU)


class _RayVllmWorker(OnNode, VllmWorker):
    """vLLM's worker as an actor."""


def build_ray_vllm_cluster(
    models: Sequence[VllmModel],
    policy: PolicyConfig,
    *,
    instances: int = 1,
    address: str = LOCAL,
    resource: str = DEFAULT_RESOURCE,
    cpus: float = 1.0,
    gpus: float = 0.0,
    hardware: str = "cpu",
    host_memory_bytes: int = 6 * 10**9,
    block_size: int = 16,
    memory_utilization: float = 0.9,
    sleep_mode: bool | None = None,
    step_timeout_s: float | None = None,
) -> RayCluster:
    """``instances`` instances, each the vLLM engines of ``models`` in a Ray actor taking one
    unit of ``resource``, ``cpus`` CPUs and ``gpus`` GPUs (see the module docstring).
    Raises ``ConfigError`` when a model directory is bad, Ray is unreachable or offers too
    few units, or an engine cannot start (then nothing is left running)."""
    if not models:
        raise ConfigError("name at least one vLLM model to serve")
    if instances < 1:
        raise ConfigError(f"name at least one instance, got {instances}")
    served = ServedModels.of(models)  # a bad directory fails here, before any actor starts
    connected = connect(address, instances, resource)
    actors: dict[str, Any] = {}
    try:
        check_resource(resource, instances)
        worker = ray.remote(_RayVllmWorker)
        for i in range(instances):
            name = f"vllm-{i}"
            actors[name] = worker.options(**actor_options(name, resource, cpus, gpus)).remote(
                name, tuple(models), sleep_mode=sleep_mode, block_size=block_size
            )
        facts: list[EngineFacts] = ray.get(
            [a.start.remote() for a in actors.values()], timeout=START_TIMEOUT_S
        )
        # alike where the cores are sized by them (the cores they compute on may differ)
        shapes = {(f.sleep_mode, f.block_size, f.device_total_bytes) for f in facts}
        if len(shapes) != 1:
            raise ConfigError(
                "the instances' engines differ in (sleep mode, block size, device bytes): "
                f"{sorted(shapes, key=str)}; run every instance on alike nodes"
            )
        fact = facts[0]
        specs = instance_specs(
            models,
            served.archs,
            sleep_mode=fact.sleep_mode,
            hardware=hardware,
            host_memory_bytes=host_memory_bytes,
            block_size=fact.block_size,
            memory_utilization=memory_utilization,
            device_total_bytes=fact.device_total_bytes,
            count=instances,
        )
        core = served.core(models, specs, policy)
        runners = attach_all(actors, core, step_timeout_s)
    except BaseException:
        close_actors(actors, connected)
        raise
    engine = (
        f"vLLM engines of {', '.join(m.name for m in models)} "
        + ("(sleep mode)" if fact.sleep_mode else "(every engine resident, no sleep mode)")
        + "; the core's KV moves are vLLM's own"
    )
    return RayCluster(
        core,
        runners,
        served.archs,
        served.tokenizers,
        loaded_from(models),
        served.eos,
        actors,
        connected,
        engine,
    )
