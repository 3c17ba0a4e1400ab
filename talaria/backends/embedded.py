"""The embedded backend: models from the engine catalog on one CPU (or CUDA) instance.

``build_embedded`` loads each named catalog model (the SmolLM2 GGUF, or a published
configuration with random weights), describes it to the policy (``ModelArch.to_spec``),
builds the instance core with the cost model of the hardware profile and an
:class:`~talaria.engine.runner.EngineRunner` (an :class:`~talaria.executor.Executor`) that
executes the core's decisions on tensors, driven step by step by a
:class:`~talaria.runtime.local.LocalInstance`; it keeps each model's tokenizer.

Which ``cpu`` profile the router's estimates use: ``build_embedded`` and
``build_embedded_cluster`` (what ``talaria serve`` and ``talaria.Talaria`` start) take this
machine's cached calibration when one exists
(:func:`~talaria.calibration.plan.cached_profiles`: same machine, same code, the
default models in the serving dtype) and the shipped profile otherwise; they never measure
(``talaria replay --substrate embedded`` measures and caches one). ``cluster_from_loaded``
prices with exactly the profiles its caller passes (default: the shipped ones), so a replay
or a test does not depend on what a cache holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from talaria.backends.served import ServedCluster
from talaria.calibration.plan import cached_profiles
from talaria.config import ClusterConfig, InstanceSpec, PolicyConfig
from talaria.core.cluster import ClusterCore
from talaria.core.instance import InstanceCore
from talaria.cost import HardwareProfile, cluster_estimators, estimator_for
from talaria.engine.arch import ModelArch
from talaria.engine.catalog import Source, entry
from talaria.engine.kernels import optional_decode_kernel
from talaria.engine.loader import (
    LoadedModel,
    describe_gguf,
    gguf_tokenizer,
    load_dummy,
    load_gguf,
    smollm2_gguf,
)
from talaria.engine.runner import EngineRunner
from talaria.engine.tokenizer import Tokenizer
from talaria.engine.weight_files import WeightFiles
from talaria.errors import ConfigError
from talaria.runtime.local import LocalInstance
from talaria.session.gaps import GapPredictor


@attrs.frozen
class EmbeddedInstance:
    """An instance core with the runner executing it (``instance``, stepped by the caller),
    and the models' tokenizers."""

    instance: LocalInstance[EngineRunner]
    tokenizers: dict[str, Tokenizer | None]
    loaded_from: dict[str, str]

    @property
    def core(self) -> InstanceCore:
        return self.instance.core


def load_catalog_model(name: str, dtype: torch.dtype, weights: bool = True) -> LoadedModel:
    """Load one catalog entry in ``dtype`` (nothing is downloaded). Without ``weights``,
    everything but the tensors: what a router that does not run the model needs."""
    e = entry(name)
    if e.source is Source.GGUF_PACKAGE:
        return load_gguf(smollm2_gguf(), dtype) if weights else describe_gguf(smollm2_gguf())
    if e.config is None:
        raise ConfigError(f"catalog entry {name} has no configuration")
    loaded = load_dummy(e.config, e.seed, dtype, weights=weights)
    if e.tokenizer_of is None:
        return loaded
    if entry(e.tokenizer_of).source is not Source.GGUF_PACKAGE:
        raise ConfigError(f"{name} borrows {e.tokenizer_of}'s tokenizer, which is not a GGUF")
    tok = gguf_tokenizer(smollm2_gguf())
    return attrs.evolve(loaded, tokenizer=tok, chat_template=tok.chat_template)


def build_embedded(
    spec: InstanceSpec,
    models: Sequence[str],
    policy: PolicyConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    native_kernels: bool = True,
) -> EmbeddedInstance:
    """Load ``models`` and build one instance serving them under ``policy`` (with the
    native decode kernel where it builds, unless ``native_kernels`` is False). Its router
    prices with this machine's cached calibration when one exists (``cached_profiles``;
    nothing is measured here), else the shipped profile."""
    if not models:
        raise ConfigError("name at least one model to serve")
    loaded = {name: load_catalog_model(name, dtype) for name in models}
    specs = [m.arch.to_spec(name, dtype, source=m.source) for name, m in loaded.items()]
    estimator = estimator_for(spec, specs, cached_profiles(dtype, device))
    core = InstanceCore(spec, specs, policy, estimator)
    eos = {name: m.eos_token_ids for name, m in loaded.items()}
    runner = EngineRunner(
        core.layout,
        {name: (m.arch, m.tensors) for name, m in loaded.items()},
        dtype=dtype,
        device=device,
        eos_token_ids=eos,
        decode_kernel=optional_decode_kernel(device) if native_kernels else None,
        tokenizers={name: m.tokenizer for name, m in loaded.items()},
    )
    return EmbeddedInstance(
        LocalInstance(core, runner, eos),
        {name: m.tokenizer for name, m in loaded.items()},
        {name: m.source for name, m in loaded.items()},
    )


@attrs.frozen
class EmbeddedCluster(ServedCluster[EngineRunner]):
    """A cluster core over embedded instances: one runner per instance, and per model its
    architecture, tokenizer (None for random-weight models) and where it was loaded from."""

    def mechanisms(self) -> list[str]:
        return ["embedded engine: slots, switches, staging, host KV tier all Talaria's own"]


def build_embedded_cluster(
    instances: Sequence[InstanceSpec],
    models: Sequence[str],
    policy: PolicyConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    native_kernels: bool = True,
) -> EmbeddedCluster:
    """Load each catalog model once and build a cluster whose instances each run an
    :class:`EngineRunner` (every instance keeps its own host copy of the weights it serves;
    an instance with no ``models`` listed serves all of them). The routers price with this
    machine's cached calibration of the ``cpu`` profile when one exists
    (``cached_profiles``: looked up, never measured at start), else the shipped profile."""
    if not models:
        raise ConfigError("name at least one model to serve")
    hardware = cached_profiles(dtype, device)
    loaded = {name: load_catalog_model(name, dtype) for name in models}
    return cluster_from_loaded(
        instances, loaded, policy, dtype, device, native_kernels=native_kernels, hardware=hardware
    )


def cluster_from_loaded(
    instances: Sequence[InstanceSpec],
    loaded: Mapping[str, LoadedModel],
    policy: PolicyConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    host_weights: Mapping[str, torch.Tensor] | None = None,
    native_kernels: bool = True,
    hardware: Mapping[str, HardwareProfile] | None = None,
    threads: int | None = None,
    weight_files: WeightFiles | None = None,
) -> EmbeddedCluster:
    """``build_embedded_cluster`` for models already loaded (any names). ``host_weights``
    (flat buffers of an earlier cluster's runner, ``EngineRunner.host_weights``) are shared
    instead of copied; then ``loaded`` may carry no tensors. ``native_kernels``: use the
    native decode kernel where it builds (:func:`optional_decode_kernel`). ``hardware``:
    profiles by name that replace the shipped ones in the routers' estimates (a
    calibration of this machine); default none, the shipped profiles, whatever is cached.
    ``threads``: torch threads of each runner's steps, on whichever thread executes them
    (default: ``torch.get_num_threads()`` of the thread that builds the cluster).
    ``weight_files``: the disk tier (:mod:`talaria.engine.weight_files`), holding a file of
    every model an instance does not start with on host (``ConfigError`` naming those
    missing); each runner then keeps only the host copies its arena holds."""
    if not loaded:
        raise ConfigError("name at least one model to serve")
    core = loaded_cluster_core(instances, loaded, policy, dtype, hardware)
    if weight_files is not None:
        _check_files(core, weight_files)
    archs, tokenizers, sources, eos = served_models(loaded)
    kernel = optional_decode_kernel(device) if native_kernels else None
    runners = {
        name: EngineRunner(
            inst.layout,
            {m: (loaded[m].arch, loaded[m].tensors) for m in inst.models},
            dtype=dtype,
            device=device,
            eos_token_ids=eos,
            host_weights=host_weights,
            decode_kernel=kernel,
            threads=torch.get_num_threads() if threads is None else threads,
            tokenizers={m: loaded[m].tokenizer for m in inst.models},
            weight_files=weight_files,
        )
        for name, inst in core.instances.items()
    }
    return EmbeddedCluster(core, runners, archs, tokenizers, sources, eos)


def _check_files(core: ClusterCore, files: WeightFiles) -> None:
    missing = sorted(
        {
            m
            for inst in core.instances.values()
            for m in inst.models
            if m not in inst.layout.host_models and not files.has(m, inst.layout.weights_of(m))
        }
    )
    if missing:
        raise ConfigError(
            f"models {missing} start on disk but {files.folder} holds no weight file of "
            "theirs; write them first (WeightFiles.write)"
        )


def loaded_cluster_core(
    instances: Sequence[InstanceSpec],
    loaded: Mapping[str, LoadedModel],
    policy: PolicyConfig,
    dtype: torch.dtype,
    hardware: Mapping[str, HardwareProfile] | None,
) -> ClusterCore:
    """The cluster core of ``instances`` serving ``loaded`` (each model's spec from its
    architecture in ``dtype``), its routers pricing with ``hardware`` over the shipped
    profiles and learning gaps with the default predictor."""
    specs = [m.arch.to_spec(name, dtype, source=m.source) for name, m in loaded.items()]
    cluster = ClusterConfig(specs, tuple(instances))
    estimators = cluster_estimators(cluster, hardware)
    return ClusterCore(cluster, policy, estimators, learner=GapPredictor.default())


def served_models(
    loaded: Mapping[str, LoadedModel],
) -> tuple[
    dict[str, ModelArch], dict[str, Tokenizer | None], dict[str, str], dict[str, tuple[int, ...]]
]:
    """What a :class:`ServedCluster` keeps of each loaded model, in its field order: the
    architectures, tokenizers, sources and end-of-sequence ids, by model name."""
    return (
        {name: m.arch for name, m in loaded.items()},
        {name: m.tokenizer for name, m in loaded.items()},
        {name: m.source for name, m in loaded.items()},
        {name: tuple(m.eos_token_ids) for name, m in loaded.items()},
    )
