"""Build a Talaria cluster whose one instance runs vLLM engines (``talaria serve --backend
vllm``, ``talaria replay --substrate vllm``).

The instance core is the same :class:`~talaria.core.instance.InstanceCore` the embedded
engine and the simulator use, sized from what vLLM will hold:

* with sleep mode (CUDA), one model is awake at a time, so the instance's device budget is
  the largest ``gpu_memory_utilization`` share of the GPU: one weight region (the largest
  model) and the rest KV, and a switch sleeps one engine and wakes the next;
* without it (the CPU backend: vLLM refuses sleep mode there), every engine stays resident
  but they share the same cores: the slot still decides which model's calls run (it
  time-slices the cores instead of letting three engines contend for them) and a switch
  moves nothing; the device budget is one weight region per model (every model stays
  resident, so the core prices no switch after the first) plus one engine's KV space
  (``kv_cache_gib``). :meth:`VllmCluster.mechanisms` says which is the case, and the
  server prints it at start. (An instance per resident model, each slot always open, was
  measured too: see docs/backends/vllm.md.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from talaria.backends.served import ServedCluster
from talaria.backends.vllm.catalog import DEFAULT_CPU_KV_GIB, VllmModel
from talaria.backends.vllm.engines import EngineSet
from talaria.backends.vllm.executor import VllmExecutor
from talaria.config import ClusterConfig, InstanceSpec, PolicyConfig
from talaria.core.cluster import ClusterCore
from talaria.cost import cluster_estimators
from talaria.engine.arch import ModelArch
from talaria.engine.tokenizer import Tokenizer
from talaria.errors import ConfigError
from talaria.session.gaps import GapPredictor

GIB = 2**30


@attrs.frozen
class VllmCluster(ServedCluster[VllmExecutor]):
    """A cluster core over the vLLM instances; per model its shape, tokenizer, directory and
    end ids, and the engines themselves."""

    engines: EngineSet

    def mechanisms(self) -> list[str]:
        """Which of Talaria's mechanisms are active on these engines, one line each."""
        e = self.engines
        lines = [
            "admission and session-prefill: Talaria admits each call into the open model "
            "slot; vLLM gets session_id and the tenant as cache_salt",
            "KV locality: vLLM's prefix cache (cached tokens are vLLM's num_cached_tokens)",
        ]
        if e.sleep_mode:
            lines.append("model switches: vLLM sleep mode (sleep/wake_up), timed per switch")
        else:
            lines.append(
                "model switches: sleep mode is unavailable on this platform, so every engine "
                "stays resident; the slot time-slices the shared cores (no weights move)"
            )
        if e.cpu_bind is not None:
            lines.append(
                f"CPU threads: each engine computes on cores {e.cpu_bind} "
                "(VLLM_CPU_OMP_THREADS_BIND; one engine computes at a time)"
            )
        if any(m.kv_offloading_gib for m in e.models.values()):
            lines.append("host KV tier: vLLM's native CPU offloading")
        else:
            lines.append(
                "host KV tier: off (vLLM keeps KV on the device only; set kv_offloading_gib "
                "on CUDA)"
            )
        return lines

    def close(self) -> None:
        self.engines.close()


def instance_specs(
    models: Sequence[VllmModel],
    archs: dict[str, ModelArch],
    *,
    sleep_mode: bool,
    hardware: str,
    host_memory_bytes: int,
    block_size: int,
    memory_utilization: float,
    device_total_bytes: int | None,
    count: int = 1,
) -> tuple[InstanceSpec, ...]:
    """The instances as vLLM will hold them (see the module docstring): ``count`` alike
    (``vllm-0``, ...; more than one where each runs its engines in a Ray actor), each one
    compute unit whose models take turns in its slot. With sleep mode they take turns on the
    device (one awake); without it every engine is resident but they still share the same
    cores, and the slot time-slices them instead of letting them contend."""
    if count < 1:
        raise ConfigError(f"vLLM instances: at least one, got {count}")
    weights = {m.name: m.spec(archs[m.name]).weight_bytes for m in models}
    host = max(host_memory_bytes, sum(weights.values()))

    def spec(name: str, usable: int, served: tuple[str, ...], regions: int) -> InstanceSpec:
        return InstanceSpec(
            name=name,
            hardware=hardware,
            device_memory_bytes=int(usable / memory_utilization),
            host_memory_bytes=host,
            block_size=block_size,
            memory_utilization=memory_utilization,
            models=served,
            weight_regions=regions,
        )

    if sleep_mode:
        if device_total_bytes is None:
            raise ConfigError("sleep mode needs the device's memory size")
        share = max(m.gpu_memory_utilization for m in models)
        usable, regions = int(device_total_bytes * share), 1
    else:
        # every engine keeps its weights loaded: one region per model, so the core prices a
        # switch at what it costs here (nothing is copied) and a model stays resident
        kv = max(m.kv_cache_gib or DEFAULT_CPU_KV_GIB for m in models)
        regions = len(models)
        usable = regions * max(weights.values()) + int(kv * GIB)
    return tuple(spec(f"vllm-{i}", usable, (), regions) for i in range(count))


def build_vllm_cluster(
    models: Sequence[VllmModel],
    policy: PolicyConfig,
    *,
    hardware: str = "cpu",
    host_memory_bytes: int = 6 * 10**9,
    block_size: int = 16,
    memory_utilization: float = 0.9,
    sleep_mode: bool | None = None,
    progress: Callable[[str], None] | None = None,
) -> VllmCluster:
    """Start one vLLM engine per model (minutes on a CPU) and the instance core over them.
    ``sleep_mode`` None: on where the platform supports it (CUDA)."""
    if not models:
        raise ConfigError("name at least one vLLM model to serve")
    for m in models:
        m.arch()  # a bad directory fails here, before vLLM spends minutes starting
    engines = EngineSet(models, sleep_mode=sleep_mode, block_size=block_size)
    engines.start(progress)
    try:
        return cluster_over(
            engines,
            policy,
            hardware=hardware,
            host_memory_bytes=host_memory_bytes,
            memory_utilization=memory_utilization,
        )
    except BaseException:
        engines.close()
        raise


def cluster_over(
    engines: EngineSet,
    policy: PolicyConfig,
    *,
    hardware: str = "cpu",
    host_memory_bytes: int = 6 * 10**9,
    memory_utilization: float = 0.9,
) -> VllmCluster:
    """A fresh cluster core (``policy``) over engines already started: a replay runs every
    policy on the same engines, their prefix caches reset in between."""
    models = list(engines.models.values())
    served = ServedModels.of(models)
    total = device_total_bytes() if engines.sleep_mode else None
    specs = instance_specs(
        models,
        served.archs,
        sleep_mode=engines.sleep_mode,
        hardware=hardware,
        host_memory_bytes=host_memory_bytes,
        block_size=engines.block_size,
        memory_utilization=memory_utilization,
        device_total_bytes=total,
    )
    core = served.core(models, specs, policy)
    runners = {
        name: VllmExecutor(
            list(inst.models), engines, vocab_sizes=served.vocab_sizes, eos_token_ids=served.eos
        )
        for name, inst in core.instances.items()
    }
    return VllmCluster(
        core, runners, served.archs, served.tokenizers, loaded_from(models), served.eos, engines
    )


@attrs.frozen
class ServedModels:
    """What serving reads of each vLLM model, from its directory: the shape as served, the
    tokenizer the API uses (None for a random-weight model whose vocabulary is wider than
    its borrowed tokenizer's: the API then limits its sampling to the tokenizer's ids), and
    the end ids."""

    archs: dict[str, ModelArch]
    tokenizers: dict[str, Tokenizer | None]
    eos: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, models: Sequence[VllmModel]) -> ServedModels:
        archs = {m.name: _served(m.arch(), m.max_model_len) for m in models}
        own = {m.name: m.tokenizer() for m in models}
        eos = {m.name: _eos_ids(archs[m.name], m, own[m.name]) for m in models}
        tokenizers: dict[str, Tokenizer | None] = {
            n: (t if t.vocab_size >= archs[n].vocab_size else None) for n, t in own.items()
        }
        return cls(archs, tokenizers, eos)

    @property
    def vocab_sizes(self) -> dict[str, int]:
        return {n: a.vocab_size for n, a in self.archs.items()}

    def core(
        self, models: Sequence[VllmModel], specs: Sequence[InstanceSpec], policy: PolicyConfig
    ) -> ClusterCore:
        """A cluster core of ``specs`` over ``models`` (as served)."""
        cluster = ClusterConfig([m.spec(self.archs[m.name]) for m in models], list(specs))
        return ClusterCore(
            cluster, policy, cluster_estimators(cluster), learner=GapPredictor.default()
        )


def loaded_from(models: Sequence[VllmModel]) -> dict[str, str]:
    """Where each model came from, as the API reports it."""
    dummy = {m.name: " (dummy weights)" if m.load_format == "dummy" else "" for m in models}
    return {m.name: f"vllm: {m.path}{dummy[m.name]}" for m in models}


def _served(arch: ModelArch, max_model_len: int) -> ModelArch:
    """The shape as served: the context cut to ``max_model_len`` (vLLM refuses longer)."""
    if arch.max_context <= max_model_len:
        return arch
    return attrs.evolve(arch, max_position_embeddings=max_model_len, rope_scaling=None)


def _eos_ids(arch: ModelArch, model: VllmModel, tok: Tokenizer | None) -> tuple[int, ...]:
    """End ids: ``eos_token_id`` (int or list) of ``config.json`` and of
    ``generation_config.json`` (vLLM stops on both; Llama 3's ``<|eot_id|>`` is only in
    the latter), and the tokenizer's."""
    ids: set[int] = set()
    for raw in (model.config().get("eos_token_id"), _generation_eos(model)):
        ids |= {raw} if isinstance(raw, int) else set(raw or ())
    if tok is not None and tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return tuple(sorted(i for i in ids if isinstance(i, int) and 0 <= i < arch.vocab_size))


def _generation_eos(model: VllmModel) -> Any:
    path = model.path / "generation_config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"vllm_models.{model.name}: cannot read {path}: {exc}") from exc
    return data.get("eos_token_id") if isinstance(data, dict) else None


def device_total_bytes() -> int:
    """The first CUDA device's memory, in bytes."""
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)
