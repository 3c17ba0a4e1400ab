"""The backend registry: each engine Talaria can drive, by the name a config gives
(``TalariaConfig.backend``), and the builder that makes it from the config. Every builder
returns a :class:`~talaria.backends.served.ServedCluster`, so the API reads one shape
whatever runs underneath. ``TalariaConfig.ray`` places the instances in Ray actors
instead of this process (``ON_RAY``: the embedded engine's, or vLLM engines)."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

from talaria.api.config import TalariaConfig
from talaria.backends.embedded import build_embedded_cluster
from talaria.backends.served import ServedCluster
from talaria.backends.vllm.cluster import build_vllm_cluster
from talaria.calibration.plan import cached_profiles
from talaria.engine.threads import in_own_thread

Builder = Callable[[TalariaConfig], ServedCluster[Any]]


def _embedded(cfg: TalariaConfig) -> ServedCluster[Any]:
    """Loaded on a thread that exits, so that its torch work leaves no OpenMP team beside
    the steps' (:mod:`talaria.engine.threads`)."""
    return in_own_thread(
        lambda: build_embedded_cluster(
            cfg.instance_specs(), cfg.models, cfg.policy_config(), cfg.torch_dtype, cfg.device
        )
    )


def _vllm(cfg: TalariaConfig) -> ServedCluster[Any]:
    return build_vllm_cluster(
        cfg.vllm_catalog(),
        cfg.policy_config(),
        hardware=cfg.hardware,
        host_memory_bytes=cfg.host_memory_bytes,
        block_size=cfg.block_size,
        memory_utilization=cfg.memory_utilization,
    )


def _embedded_on_ray(cfg: TalariaConfig, address: str) -> ServedCluster[Any]:
    from talaria.backends.ray.cluster import build_ray_cluster  # ray: an optional extra

    return build_ray_cluster(
        cfg.instance_specs(),
        cfg.models,
        cfg.policy_config(),
        address=address,
        dtype=cfg.dtype,
        device=cfg.device,
        resource=cfg.ray_resource,
        cpus=cfg.ray_cpus,
        hardware=cached_profiles(cfg.torch_dtype, cfg.device),
    )


def _vllm_on_ray(cfg: TalariaConfig, address: str) -> ServedCluster[Any]:
    from talaria.backends.ray.vllm_cluster import build_ray_vllm_cluster

    return build_ray_vllm_cluster(
        cfg.vllm_catalog(),
        cfg.policy_config(),
        instances=cfg.instances,
        address=address,
        resource=cfg.ray_resource,
        cpus=cfg.ray_cpus,
        gpus=cfg.ray_gpus,
        hardware=cfg.hardware,
        host_memory_bytes=cfg.host_memory_bytes,
        block_size=cfg.block_size,
        memory_utilization=cfg.memory_utilization,
    )


BUILDERS: Mapping[str, Builder] = types.MappingProxyType({"embedded": _embedded, "vllm": _vllm})
ON_RAY: Mapping[str, Callable[[TalariaConfig, str], ServedCluster[Any]]] = types.MappingProxyType(
    {"embedded": _embedded_on_ray, "vllm": _vllm_on_ray}
)


def build(cfg: TalariaConfig) -> ServedCluster[Any]:
    """The backend ``cfg`` names, built (its instances in Ray actors when ``cfg.ray`` is
    set)."""
    if cfg.ray is not None:
        return ON_RAY[cfg.backend](cfg, cfg.ray)
    return BUILDERS[cfg.backend](cfg)
