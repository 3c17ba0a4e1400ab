"""The vLLM backend's model catalog: what each engine loads and how the policy sees it.

A model is a Hugging Face directory (``config.json``, tokenizer files and weights), or a
directory holding only ``config.json`` and tokenizer files served with ``load_format =
"dummy"`` (random weights of a published shape, as vLLM calls it). In the TOML config::

    backend = "vllm"
    models = ["smollm2", "qwen-7b"]

    [vllm_models.smollm2]
    path = "/models/SmolLM2-135M-Instruct"

    [vllm_models.qwen-7b]
    path = "/models/qwen2.5-7b-config"   # config.json + tokenizer files only
    load_format = "dummy"
    max_model_len = 16384
    gpu_memory_utilization = 0.45        # of the device for weights + KV (GPU), or
    kv_cache_gib = 1                     # the CPU backend's KV space

Every key but ``path`` is optional; ``engine_args`` passes any other ``AsyncEngineArgs``
field through. The policy's :class:`~talaria.config.ModelSpec` (weight bytes, KV bytes per
token, context) comes from ``config.json`` through :class:`~talaria.engine.arch.ModelArch`,
so the router prices vLLM's models as it prices the embedded engine's. No I/O but
:meth:`VllmModel.arch` and :meth:`VllmModel.tokenizer`, which read the directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from talaria.config import ModelSpec
from talaria.engine.arch import ModelArch
from talaria.engine.tokenizer import Tokenizer
from talaria.errors import ConfigError

# the logits processor that replays forced answers (loaded by name in each engine core) and
# the SamplingParams.extra_args key it reads
FORCING_PROCESSOR = "talaria.backends.vllm.forcing:ForcedAnswers"
FORCED_KEY = "talaria_forced"
DEFAULT_CPU_KV_GIB = 1  # the CPU backend's KV space per engine when the catalog is silent
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_KNOWN = {
    "path",
    "load_format",
    "dtype",
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_gib",
    "kv_offloading_gib",
    "sleep_level",
    "engine_args",
}


@attrs.frozen
class VllmModel:
    """One model served by one vLLM engine (see the module docstring)."""

    name: str
    path: Path
    load_format: str = "auto"
    dtype: str = "bfloat16"
    max_model_len: int = 8192
    gpu_memory_utilization: float = 0.3
    kv_cache_gib: int | None = None  # CPU backend: VLLM_CPU_KVCACHE_SPACE (whole GiB) per engine
    kv_offloading_gib: float | None = None  # CUDA: vLLM's native host KV tier, per engine
    sleep_level: int = 1  # 1: weights kept in host memory while asleep; 2: dropped, reloaded
    extra: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)

    def __attrs_post_init__(self) -> None:
        if self.load_format not in _LOAD_FORMATS:
            raise ConfigError(
                f"vllm_models.{self.name}.load_format must be one of {list(_LOAD_FORMATS)}, "
                f"got {self.load_format!r}"
            )
        if self.dtype not in _DTYPES:
            raise ConfigError(f"vllm_models.{self.name}.dtype must be one of {sorted(_DTYPES)}")
        if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int):
            raise ConfigError(f"vllm_models.{self.name}.max_model_len must be an integer")
        if self.max_model_len < 16:
            raise ConfigError(f"vllm_models.{self.name}.max_model_len must be at least 16")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"vllm_models.{self.name}.gpu_memory_utilization must be in (0, 1]")
        kv = self.kv_cache_gib
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
            raise ConfigError(
                f"vllm_models.{self.name}.kv_cache_gib must be a whole number of GiB (vLLM's "
                f"VLLM_CPU_KVCACHE_SPACE), got {kv!r}"
            )
        off = self.kv_offloading_gib
        if off is not None and not (isinstance(off, (int, float)) and off > 0):
            raise ConfigError(
                f"vllm_models.{self.name}.kv_offloading_gib must be positive, got {off!r}"
            )
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"vllm_models.{self.name}.sleep_level must be 1 or 2")

    @classmethod
    def from_table(cls, name: str, table: Mapping[str, Any], base: Path | None = None) -> VllmModel:
        """One ``[vllm_models.NAME]`` table (``path`` relative to ``base`` when given)."""
        if not isinstance(table, Mapping):
            raise ConfigError(f"vllm_models.{name} must be a table with at least a path")
        unknown = sorted(set(table) - _KNOWN)
        if unknown:
            raise ConfigError(
                f"vllm_models.{name}: unknown keys {unknown}; known: {sorted(_KNOWN)}"
            )
        if not isinstance(table.get("path"), str) or not table["path"]:
            raise ConfigError(f"vllm_models.{name} needs path = a model directory")
        path = Path(table["path"]).expanduser()
        if base is not None and not path.is_absolute():
            path = base / path
        fields = {k: v for k, v in table.items() if k not in ("path", "engine_args")}
        extra = table.get("engine_args", {})
        if not isinstance(extra, Mapping):
            raise ConfigError(f"vllm_models.{name}.engine_args must be a table")
        try:
            return cls(name, path, extra=extra, **fields)
        except TypeError as exc:
            raise ConfigError(f"vllm_models.{name}: {exc}") from exc

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def config(self) -> dict[str, Any]:
        """The directory's ``config.json`` (ConfigError when missing or malformed)."""
        path = self.path / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(
                f"vllm_models.{self.name}: {path} does not exist; path must be a Hugging "
                "Face model directory"
            ) from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"vllm_models.{self.name}: cannot read {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"vllm_models.{self.name}: {path} is not a JSON object")
        return data

    def arch(self) -> ModelArch:
        """The model's shape, from ``config.json`` (reads the directory)."""
        try:
            return ModelArch.from_hf_config(self.config())
        except ConfigError as exc:
            raise ConfigError(f"vllm_models.{self.name}: {exc}") from exc

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_hf_dir(self.path)

    def spec(self, arch: ModelArch) -> ModelSpec:
        """How the policy sees it: weights and KV in the serving dtype, the served context."""
        spec = arch.to_spec(self.name, self.torch_dtype, source=f"vllm {self.path}")
        return attrs.evolve(spec, max_context=min(spec.max_context, self.max_model_len))

    def engine_args(self, *, sleep_mode: bool, block_size: int = 16) -> dict[str, Any]:
        """``AsyncEngineArgs`` keywords: prefix caching on (KV locality) in blocks of the
        instance's ``block_size`` (vLLM's CPU default of 128 would cache no prompt shorter than
        that), the forcing logits processor (replays), structured outputs by llguidance
        (vLLM's ``guidance`` backend: the grammars the embedded engine takes,
        ``talaria.grammar``), sleep mode and vLLM's host KV tier where asked."""
        args: dict[str, Any] = {
            "block_size": block_size,
            "model": str(self.path),
            "served_model_name": [self.name],
            "load_format": self.load_format,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": True,
            "logits_processors": [FORCING_PROCESSOR],
            "disable_log_stats": True,
            "enable_sleep_mode": sleep_mode,
            "structured_outputs_config": {"backend": "guidance", "disable_any_whitespace": True},
        }
        if self.kv_offloading_gib is not None:
            args["kv_offloading_size"] = float(self.kv_offloading_gib)
        args.update(self.extra)
        return args


def catalog_from_tables(
    tables: Mapping[str, Any], names: tuple[str, ...], base: Path | None = None
) -> tuple[VllmModel, ...]:
    """The served ``names``, each from its ``[vllm_models.NAME]`` table."""
    missing = [n for n in names if n not in tables]
    if missing:
        raise ConfigError(
            f"models {missing} have no [vllm_models.NAME] table; vllm_models has {sorted(tables)}"
        )
    return tuple(VllmModel.from_table(n, tables[n], base) for n in names)
