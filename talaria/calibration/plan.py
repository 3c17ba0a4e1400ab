"""What a calibration of this machine measures, what it is keyed by, and the cached lookup.

A calibration (:mod:`talaria.calibration.calibrate` measures it) is planned by a
:class:`CalibrationPlan`: the raw machine rates' sizes
(:class:`~talaria.calibration.machine.RateSizes`) and the engine microbenchmarks' sizes
(:class:`EngineBench`). Its key (:func:`calibration_key`,
:class:`~talaria.calibration.cache.CalibrationKey`) is :func:`this_machine` and a hash of
:data:`STEP_TIME_SOURCES` (the engine and its kernels, the cost model, the embedded
executor and the measuring code) together with the plan's sizes, the models and the dtype.

:func:`cached_profiles` is the server's side: this machine's cached calibration of the
default models, if any, as a profile override; it reads the cache and never measures.
Imports no module that builds instances (``engine`` and ``calibrate`` import this one, and
``talaria.backends.embedded`` uses :func:`cached_profiles`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import torch

from talaria.calibration.cache import (
    CalibrationKey,
    CalibrationWarning,
    Machine,
    read_cached,
    source_hash,
)
from talaria.calibration.grid import StepGrid
from talaria.calibration.machine import RateSizes, cpu_model, ram_bytes, visible_cpus
from talaria.cost.hardware import HardwareProfile
from talaria.engine.catalog import DEFAULT_MODELS
from talaria.errors import ConfigError

GB = 10**9
PACKAGE_ROOT: Final = Path(__file__).resolve().parents[1]
STEP_TIME_SOURCES: Final = (
    "engine/**/*.py",
    "engine/csrc/*.c",
    "cost/cost_model.py",
    "backends/embedded.py",
    "runtime/local.py",
    "calibration/*.py",
)
"""Source files (globs under ``talaria/``) that decide the engine's step time or how it is
measured: any change to one of them misses every cached calibration."""
CALIBRATION_MODELS: Final = DEFAULT_MODELS
"""The models a server's cached calibration is looked up for: the embedded replay's models."""


@attrs.frozen
class EngineBench:
    """What each model is measured on (tokens, steps, repetitions), the instance it runs
    on (bytes), and the step grid that prices a step's parts (None: the roofline prices).
    ``short_ctx`` < ``long_ctx``; every context must fit the models'. The defaults are the
    shipped profile's (``benchmarks/engine_calibration.py``)."""

    prefill_tokens: int = 1024
    decode_steps: int = 12
    reps: int = 3
    short_ctx: int = 256
    long_ctx: int = 1024
    chunk: int = 256
    attention_batch: int = 4
    device_memory_bytes: int = 4 * GB
    host_memory_bytes: int = 4 * GB
    grid: StepGrid | None = attrs.field(factory=StepGrid)

    def __attrs_post_init__(self) -> None:
        for name in ("prefill_tokens", "decode_steps", "reps", "short_ctx", "chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineBench.{name} must be at least 1")
        if self.long_ctx <= self.short_ctx:
            raise ConfigError("EngineBench.long_ctx must be longer than short_ctx")
        if self.attention_batch < 1:
            raise ConfigError("EngineBench.attention_batch must be at least 1")

    def describe(self) -> str:
        grid = "" if self.grid is None else "; " + self.grid.describe()
        return (
            f"decode on {self.short_ctx}-token contexts, prefill {self.prefill_tokens} tokens "
            f"in one chunk; attention: decode batch {self.attention_batch} at {self.short_ctx} "
            f"and {self.long_ctx}-token contexts, a {self.chunk}-token chunk fresh and after a "
            f"{self.long_ctx}-token cached prefix; {self.reps} reps, {self.decode_steps} "
            f"decode steps{grid}"
        )


# Where Talaria runs the raw rates only price copies (the engine fit replaces the matmul and
# bandwidth figures), so they are measured smaller than for the shipped profile: seconds.
_HERE_RATES: Final = RateSizes(matmul_n=1024, reps=3, copy_mb=256, memcpy_mb=256, file_mb=64)


@attrs.frozen
class CalibrationPlan:
    """The sizes of one calibration: raw machine rates and engine microbenchmarks."""

    rates: RateSizes = _HERE_RATES
    engine: EngineBench = EngineBench()

    def settings(self) -> dict[str, Any]:
        """The sizes as plain data (part of the key: other sizes, other calibration)."""
        rates = attrs.asdict(self.rates)
        rates.pop("directory")  # where the disk file goes does not change what is measured
        return {"rates": rates, "engine": attrs.asdict(self.engine)}


def this_machine() -> Machine:
    """This process's machine: CPU model, visible CPUs, torch threads, RAM, torch version."""
    return Machine(
        cpu=cpu_model(),
        cores=visible_cpus(),
        threads=torch.get_num_threads(),
        ram_bytes=ram_bytes(),
        torch=torch.__version__,
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def calibration_key(
    models: Sequence[str],
    dtype: torch.dtype,
    plan: CalibrationPlan | None = None,
    machine: Machine | None = None,
) -> CalibrationKey:
    """The key of a calibration of ``models`` in ``dtype`` under ``plan`` (default sizes) on
    ``machine`` (default: this one). Reads and hashes the step-time sources (milliseconds)."""
    plan = CalibrationPlan() if plan is None else plan
    code = source_hash(PACKAGE_ROOT, STEP_TIME_SOURCES, plan.settings())
    return CalibrationKey(machine or this_machine(), code, tuple(models), dtype_name(dtype))


def cached_profiles(
    dtype: torch.dtype, device: str = "cpu", directory: Path | None = None
) -> dict[str, HardwareProfile]:
    """``{"cpu": profile}`` from this machine's cached calibration of
    :data:`CALIBRATION_MODELS` in ``dtype`` (default plan) when the engine runs on the CPU
    and one is cached for this machine and code (and was not measured on a busy machine);
    else ``{}`` (the shipped profiles price).
    Never measures: ``talaria replay --substrate embedded`` (or
    :func:`talaria.calibration.calibrate.calibrate`) is what fills the cache. A cache file that
    cannot be trusted is ignored with a :class:`CalibrationWarning`."""
    if torch.device(device).type != "cpu":
        return {}
    try:
        key = calibration_key(CALIBRATION_MODELS, dtype)
    except ConfigError as exc:
        warnings.warn(
            f"no calibration lookup ({exc}); the shipped cpu profile prices",
            CalibrationWarning,
            stacklevel=2,
        )
        return {}
    cached = read_cached(key, directory)
    return {} if cached is None or cached.busy else {"cpu": cached.profile}
