"""A cluster whose instances are Ray actors, and the connection to Ray.

``build_ray_cluster`` connects to Ray (:func:`connect`), builds the cluster core in this
process from the models' descriptions (no weights are loaded here), starts one
:class:`~talaria.backends.ray.actor.InstanceWorker` actor per instance and attaches them
(each loads its models on its own node, in parallel), and wraps each in a
:class:`~talaria.backends.ray.executor.RayExecutor`.

Placement: each actor asks for one unit of the custom resource ``resource`` (default
``talaria_instance``), ``cpus`` CPUs and, on CUDA, the instance's devices as GPUs; a node
offers as many instances as it has units (``ray start --resources
'{"talaria_instance": 1}'``). Actors restart without limit: when a node dies Ray places the
lost instance's actor on a node with a unit free (one that joined), and the loop re-attaches
it (``LiveCluster`` and ``RayExecutor.restart``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import ray
import torch

from talaria.backends.embedded import load_catalog_model, loaded_cluster_core, served_models
from talaria.backends.ray.actor import InstanceWorker, Worker, WorkerInfo
from talaria.backends.ray.executor import ATTACH_TIMEOUT_S, STEP_TIMEOUT_S, RayExecutor
from talaria.backends.served import ServedCluster
from talaria.config import InstanceSpec, PolicyConfig
from talaria.core.cluster import ClusterCore
from talaria.cost import HardwareProfile
from talaria.errors import ConfigError
from talaria.executor import Layout

__all__ = [
    "DEFAULT_RESOURCE",
    "LOCAL",
    "RayCluster",
    "actor_options",
    "attach_all",
    "build_ray_cluster",
    "check_resource",
    "close_actors",
    "connect",
]

DEFAULT_RESOURCE: Final = "talaria_instance"
LOCAL: Final = "local"  # start a private single-node Ray here (no cluster needed)


def connect(address: str, instances: int, resource: str = DEFAULT_RESOURCE) -> bool:
    """Join Ray at ``address`` (``auto``: the cluster this node runs; ``ray://...`` or
    ``HOST:PORT``: that cluster), or with ``local`` start a private one here offering
    ``instances`` units of ``resource``. Returns whether this call connected (so the
    caller disconnects); an existing connection is reused."""
    if ray.is_initialized():
        return False
    if address == LOCAL:
        ray.init(
            resources={resource: instances},
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
        )
    else:
        try:
            ray.init(address=address, configure_logging=False, log_to_driver=False)
        except ConnectionError as exc:
            raise ConfigError(
                f"no Ray cluster at {address!r} ({exc}): start one with `ray start --head "
                f"--resources '{{\"{resource}\": 1}}'` (and workers with `ray start "
                f"--address HEAD:6379 --resources '{{\"{resource}\": 1}}'`), or use --ray local"
            ) from exc
    return True


class OnNode(Worker):
    """A worker as an actor: it names the node Ray placed it on."""

    def attach(self, layout: Layout) -> WorkerInfo:
        self.node_id = ray.get_runtime_context().get_node_id()
        return super().attach(layout)


class _RayWorker(OnNode, InstanceWorker):
    """The embedded engine's worker as an actor."""


EMBEDDED_LINE: Final = "the embedded engine's slots, switches, staging (inline) and host KV tier"


@attrs.define
class RayCluster(ServedCluster[RayExecutor]):
    """A cluster core over Ray actors: one ``RayExecutor`` per instance, and per model its
    architecture, tokenizer and source, as ``EmbeddedCluster``. ``close`` kills the actors
    and disconnects from Ray if this cluster connected."""

    actors: dict[str, Any]
    connected: bool = False
    engine: str = EMBEDDED_LINE  # what runs in each actor, one line

    def mechanisms(self) -> list[str]:
        return [
            f"Ray: instance {name} in an actor on node {r.info.node_id[:12]} "
            f"({r.info.hostname}, pid {r.info.pid}, {r.info.torch_threads} torch threads); "
            + self.engine
            for name, r in self.runners.items()
        ]

    def close(self) -> None:
        close_actors(self.actors, self.connected)
        self.connected = False


def close_actors(actors: dict[str, Any], connected: bool) -> None:
    """Kill ``actors`` (emptied), and disconnect from Ray if ``connected`` (this cluster
    connected)."""
    for actor in actors.values():
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            continue
    actors.clear()
    if connected and ray.is_initialized():
        ray.shutdown()


def build_ray_cluster(
    instances: Sequence[InstanceSpec],
    models: Sequence[str],
    policy: PolicyConfig,
    *,
    address: str = LOCAL,
    dtype: str = "bfloat16",
    device: str = "cpu",
    resource: str = DEFAULT_RESOURCE,
    cpus: float = 1.0,
    hardware: Mapping[str, HardwareProfile] | None = None,
    native_kernels: bool = True,
    step_timeout_s: float | None = None,
) -> RayCluster:
    """Instances ``instances`` serving ``models`` (catalog names), each in a Ray actor.
    ``hardware`` replaces shipped profiles in the routers' estimates. Raises
    ``ConfigError`` when Ray is unreachable or offers fewer units of ``resource`` than
    there are instances (then nothing is left running)."""
    if not models:
        raise ConfigError("name at least one model to serve")
    if not instances:
        raise ConfigError("name at least one instance")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r}")
    described = {m: load_catalog_model(m, torch_dtype, weights=False) for m in models}
    core = loaded_cluster_core(instances, described, policy, torch_dtype, hardware)
    connected = connect(address, len(instances), resource)
    actors: dict[str, Any] = {}
    try:
        _start_workers(
            actors, instances, core, dtype=dtype, device=device, resource=resource,
            cpus=cpus, native_kernels=native_kernels,
        )  # fmt: skip
        runners = attach_all(actors, core, step_timeout_s)
    except BaseException:
        close_actors(actors, connected)
        raise
    return RayCluster(core, runners, *served_models(described), actors, connected)


def attach_all(
    actors: Mapping[str, Any], core: ClusterCore, step_timeout_s: float | None
) -> dict[str, RayExecutor]:
    """Each started actor attached with its instance's layout, as an executor."""
    layouts = {name: inst.layout for name, inst in core.instances.items()}
    infos: list[WorkerInfo] = ray.get(
        [a.attach.remote(layouts[name]) for name, a in actors.items()], timeout=ATTACH_TIMEOUT_S
    )
    timeout = STEP_TIMEOUT_S if step_timeout_s is None else step_timeout_s
    return {
        name: RayExecutor(name, layouts[name], actor, info, step_timeout_s=timeout)
        for (name, actor), info in zip(actors.items(), infos, strict=True)
    }


def actor_options(name: str, resource: str, cpus: float, gpus: float) -> dict[str, Any]:
    """How an instance's actor is placed and kept: one unit of ``resource``, its CPUs and
    GPUs, restarted without limit, steps never retried, a ping answered beside a step."""
    return {
        "name": f"talaria-{name}",
        "num_cpus": cpus,
        "num_gpus": gpus,
        "resources": {resource: 1},
        "max_restarts": -1,
        "max_task_retries": 0,
        "max_concurrency": 2,
    }


def check_resource(resource: str, instances: int) -> None:
    """``ConfigError`` unless the Ray cluster offers a unit of ``resource`` per instance."""
    offered = ray.cluster_resources().get(resource, 0)  # type: ignore[no-untyped-call, unused-ignore]
    if offered < instances:
        raise ConfigError(
            f"the Ray cluster offers {offered:g} units of resource {resource!r}; "
            f"{instances} instances need one each: start each node with "
            f"`ray start ... --resources '{{\"{resource}\": 1}}'`"
        )


def _start_workers(
    actors: dict[str, Any],
    instances: Sequence[InstanceSpec],
    core: ClusterCore,
    *,
    dtype: str,
    device: str,
    resource: str,
    cpus: float,
    native_kernels: bool,
) -> None:
    """Start one worker actor per instance, each taking one unit of ``resource``, into
    ``actors`` (filled as they start, so that a failure leaves the caller what to close).
    Raises ``ConfigError`` when the cluster offers too few units."""
    check_resource(resource, len(instances))
    worker = ray.remote(_RayWorker)
    for spec in instances:
        gpus = spec.n_devices if device.startswith("cuda") else 0
        actors[spec.name] = worker.options(**actor_options(spec.name, resource, cpus, gpus)).remote(
            spec.name,
            tuple(core.instances[spec.name].models),
            dtype,
            device,
            max(1, int(cpus)),
            native_kernels,
        )
