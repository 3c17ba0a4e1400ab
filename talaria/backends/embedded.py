"""The embedded substrate: models from the engine catalog on one CPU (or CUDA) instance.

``build_embedded`` loads each named catalog model (the SmolLM2 GGUF, or a published
configuration with random weights), describes it to the policy (``ModelArch.to_spec``),
builds the instance core with the cost model of the hardware profile (the measured ``cpu``
profile on this machine) and an :class:`~talaria.engine.runner.EngineRunner` that executes
the core's decisions on tensors. The result satisfies
:class:`~talaria.backends.base.Substrate` and keeps each model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from talaria.config import InstanceSpec, PolicyConfig
from talaria.engine.catalog import Source, entry
from talaria.engine.loader import LoadedModel, load_dummy, load_gguf, smollm2_gguf
from talaria.engine.runner import EngineRunner
from talaria.engine.tokenizer import Tokenizer
from talaria.errors import ConfigError
from talaria.runtime.costs import CostModelEstimator
from talaria.runtime.instance import InstanceCore
from talaria.sim.cost_model import CostModel
from talaria.sim.hardware import profile


@attrs.frozen
class EmbeddedInstance:
    """An instance core, the runner executing it, and the models' tokenizers."""

    runner: EngineRunner
    tokenizers: dict[str, Tokenizer | None]
    loaded_from: dict[str, str]

    @property
    def core(self) -> InstanceCore:
        return self.runner.core


def load_catalog_model(name: str, dtype: torch.dtype) -> LoadedModel:
    """Load one catalog entry in ``dtype`` (nothing is downloaded)."""
    e = entry(name)
    if e.source is Source.GGUF_PACKAGE:
        return load_gguf(smollm2_gguf(), dtype)
    if e.config is None:
        raise ConfigError(f"catalog entry {name} has no configuration")
    return load_dummy(e.config, e.seed, dtype)


def build_embedded(
    spec: InstanceSpec,
    models: Sequence[str],
    policy: PolicyConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> EmbeddedInstance:
    """Load ``models`` and build one instance serving them under ``policy``."""
    if not models:
        raise ConfigError("name at least one model to serve")
    loaded = {name: load_catalog_model(name, dtype) for name in models}
    specs = [m.arch.to_spec(name, dtype, source=m.source) for name, m in loaded.items()]
    cost = CostModel(profile(spec.hardware), spec.n_devices)
    core = InstanceCore(spec, specs, policy, CostModelEstimator(cost, specs))
    runner = EngineRunner(
        core,
        {name: (m.arch, m.tensors) for name, m in loaded.items()},
        dtype=dtype,
        device=device,
        eos_token_ids={name: m.eos_token_ids for name, m in loaded.items()},
    )
    return EmbeddedInstance(
        runner,
        {name: m.tokenizer for name, m in loaded.items()},
        {name: m.source for name, m in loaded.items()},
    )
