"""Hardware profiles: what one server can compute, hold and move, with a source for each number.

A :class:`HardwareProfile` describes ONE server: its devices (per-device memory, HBM bandwidth,
dense bf16 FLOP/s, interconnect and host-link bandwidth), its host memory and disk, and the
efficiency factors that turn datasheet peaks into achieved rates. The cost model
(:mod:`talaria.cost.cost_model`) reads the factors from here and never tunes them itself.

Units are in the field names: ``_bytes``, ``_Bps`` (bytes per second), ``_s`` (seconds);
``peak_flops_bf16`` is FLOP/s. Every numeric field must be named by at least one entry of
``sources`` (``"<field>: <where the number comes from>"``); construction fails otherwise.

Two profiles ship (:func:`profiles`):

- ``h200-tp8``: one 8 x H200 SXM server (DGX/HGX H200), datasheet numbers plus conservative,
  cited efficiency factors;
- ``cpu``: the machine it was measured on, from ``cpu_profile.json`` that
  ``benchmarks/cpu_profile.py`` and ``benchmarks/engine_calibration.py`` write by measuring
  it (achieved rates, so the efficiency factors are 1).

Another machine runs the engine at other rates: :mod:`talaria.calibration.cache` keeps a
``cpu`` profile measured where Talaria runs (same document, same :func:`cpu_profile_from_dict`),
which the embedded replay and server use in place of the shipped one.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import attrs

from talaria import validators as valid
from talaria.config import InstanceSpec
from talaria.cost.step_prices import StepPrices
from talaria.errors import ConfigError

CPU_PROFILE_FILE: Final = "cpu_profile.json"

EFFICIENCY_FIELDS: Final = (
    "mfu",
    "hbm_efficiency",
    "host_link_efficiency",
    "disk_efficiency",
    "d2d_efficiency",
    "interconnect_efficiency",
)
"""The achieved-rate factors (each in (0, 1]); a measured profile's are all 1."""

# Fields that hold numbers; each needs a "<field>: ..." entry in ``sources``.
NUMERIC_FIELDS: Final = (
    "n_devices",
    "device_memory_bytes",
    "hbm_bandwidth_Bps",
    "peak_flops_bf16",
    "interconnect_Bps",
    "host_link_Bps",
    "host_memory_bytes",
    "disk_Bps",
    *EFFICIENCY_FIELDS,
    "step_overhead_s",
    "allreduce_latency_s",
    "copy_latency_s",
)
OPTIONAL_FIELDS: Final = (
    "kv_read_Bps",
    "attention_flops_per_s",
    "decode_seq_overhead_s",
    "stage_step_slowdown",
    "stage_share_beside_steps",
    "step_prices",
    "co_run_slowdown",
    "provision_s",
)
"""Numbers a profile may leave None; cited in ``sources`` when set."""


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class HardwareProfile:
    """One server: its devices, host memory, disk, and achieved-rate efficiency factors.

    Per device: ``device_memory_bytes``, ``hbm_bandwidth_Bps``, ``peak_flops_bf16`` (dense),
    ``interconnect_Bps`` (device-to-device link, one direction, e.g. NVLink) and
    ``host_link_Bps`` (device-to-host link, one direction, e.g. PCIe). Per server:
    ``host_memory_bytes`` and ``disk_Bps`` (aggregate sequential read).

    Efficiency factors in (0, 1] multiply the peaks: ``mfu`` (matmul FLOP/s achieved),
    ``hbm_efficiency`` (HBM bandwidth achieved by weight and KV reads), ``host_link_efficiency``,
    ``disk_efficiency``, ``d2d_efficiency`` (on-device copies) and ``interconnect_efficiency``
    (allreduce bandwidth). Fixed costs in seconds: ``step_overhead_s`` per engine iteration,
    ``allreduce_latency_s`` per tensor-parallel allreduce (a layer does two), and
    ``copy_latency_s`` per copy.

    Attention may have rates of its own (per device, achieved; None: priced like the rest):
    ``kv_read_Bps`` for reading cached K/V (else the HBM rate) and ``attention_flops_per_s``
    for attention score and value FLOPs (else the matmul rate); and ``decode_seq_overhead_s``,
    seconds per decoding sequence per step (else 0: a GPU engine's per-sequence work hides
    under the step). The embedded CPU engine's attention runs far below its matmul and
    weight-read rates and each decoding sequence adds host work, so its calibration sets
    all three; the GPU profiles leave them None.

    A weight stage (the next model's copy into lent KV blocks while the current one runs)
    contends with the steps beside it: ``stage_step_slowdown`` (>= 1) is how many times
    longer a step takes while a stage copies, and ``stage_share_beside_steps`` (in (0, 1])
    the share of its idle copy rate the stage keeps while steps run; both measured (None:
    no contention, a stage delays nothing). A stage and host-to-device KV moves share the
    host link half and half (:mod:`talaria.sim.simulator`).

    ``step_prices`` (a calibration's step grid, :mod:`talaria.cost.step_prices`) replaces
    the roofline for a step's time where it is measured: the CPU engine's parts add up.
    ``co_run_slowdown`` (>= 1) is how many times longer an instance's work takes while
    another instance of this profile on the same server works (CPU instances share the
    machine's cores' memory bandwidth and caches); None: instances do not slow each other.
    ``provision_s`` is how long an instance that scaled to zero waits for its devices when
    work wakes it (a process or container start, a device allocation), before its switch
    copies anything; None: at once (the shipped profiles: the delay belongs to the
    platform, not the server, and a run that models one sets it, cited).
    """

    name: str = attrs.field(validator=valid.name)
    description: str
    n_devices: int = attrs.field(validator=valid.positive_int)
    device_memory_bytes: int = attrs.field(validator=valid.positive_int)
    hbm_bandwidth_Bps: float = attrs.field(validator=valid.positive)
    peak_flops_bf16: float = attrs.field(validator=valid.positive)
    interconnect_Bps: float = attrs.field(validator=valid.positive)
    host_link_Bps: float = attrs.field(validator=valid.positive)
    host_memory_bytes: int = attrs.field(validator=valid.positive_int)
    disk_Bps: float = attrs.field(validator=valid.positive)
    mfu: float = attrs.field(validator=valid.fraction)
    hbm_efficiency: float = attrs.field(validator=valid.fraction)
    host_link_efficiency: float = attrs.field(validator=valid.fraction)
    disk_efficiency: float = attrs.field(validator=valid.fraction)
    d2d_efficiency: float = attrs.field(validator=valid.fraction)
    interconnect_efficiency: float = attrs.field(validator=valid.fraction)
    step_overhead_s: float = attrs.field(validator=valid.non_negative)
    allreduce_latency_s: float = attrs.field(validator=valid.non_negative)
    copy_latency_s: float = attrs.field(validator=valid.non_negative)
    sources: tuple[str, ...] = attrs.field(converter=_str_tuple)
    kv_read_Bps: float | None = attrs.field(default=None, validator=valid.optional_positive)
    attention_flops_per_s: float | None = attrs.field(
        default=None, validator=valid.optional_positive
    )
    decode_seq_overhead_s: float | None = attrs.field(
        default=None, validator=valid.optional_positive
    )
    stage_step_slowdown: float | None = attrs.field(default=None, validator=valid.optional_positive)
    stage_share_beside_steps: float | None = attrs.field(
        default=None, validator=valid.optional_positive
    )
    step_prices: StepPrices | None = None
    co_run_slowdown: float | None = attrs.field(default=None, validator=valid.optional_positive)
    provision_s: float | None = attrs.field(default=None, validator=valid.optional_positive)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.description, str):
            raise ConfigError(f"profile {self.name}: description must be a string")
        if not all(isinstance(s, str) and s.strip() for s in self.sources):
            raise ConfigError(f"profile {self.name}: sources must be non-empty strings")
        cited = {s.split(":", 1)[0].strip() for s in self.sources if ":" in s}
        optional = [f for f in OPTIONAL_FIELDS if getattr(self, f) is not None]
        missing = [f for f in (*NUMERIC_FIELDS, *optional) if f not in cited]
        slowdown, share = self.stage_step_slowdown, self.stage_share_beside_steps
        if slowdown is not None and slowdown < 1:
            raise ConfigError(f"profile {self.name}: stage_step_slowdown must be >= 1")
        if self.co_run_slowdown is not None and self.co_run_slowdown < 1:
            raise ConfigError(f"profile {self.name}: co_run_slowdown must be >= 1")
        if share is not None and share > 1:
            raise ConfigError(f"profile {self.name}: stage_share_beside_steps must be <= 1")
        if self.step_prices is not None and not isinstance(self.step_prices, StepPrices):
            raise ConfigError(f"profile {self.name}: step_prices must be StepPrices or None")
        if missing:
            raise ConfigError(
                f"profile {self.name}: every number needs a source; add a "
                f"'<field>: <source>' entry to sources for {missing}"
            )

    def source_of(self, field: str) -> tuple[str, ...]:
        """The ``sources`` entries that cite ``field`` (without the ``field:`` prefix)."""
        prefix = f"{field}:"
        return tuple(s[len(prefix) :].strip() for s in self.sources if s.startswith(prefix))

    def instances(
        self,
        n_instances: int = 1,
        host_memory_share: float = 0.8,
        block_size: int = 16,
        memory_utilization: float = 0.9,
    ) -> tuple[InstanceSpec, ...]:
        """Split the server's devices into ``n_instances`` equal tensor-parallel groups.

        Each instance gets ``n_devices / n_instances`` devices, device memory of that many
        devices, and an equal share of ``host_memory_share`` of the server's host memory (the
        rest is left to the OS, page cache and the serving runtime). Instances are named
        ``"<profile>-<i>"``. Raises ConfigError if the devices do not split evenly.
        """
        valid.require_positive_int("n_instances", n_instances)
        valid.require_fraction("host_memory_share", host_memory_share)
        if self.n_devices % n_instances:
            raise ConfigError(
                f"profile {self.name} has {self.n_devices} devices, which do not split into "
                f"{n_instances} equal tensor-parallel groups; use a divisor of {self.n_devices}"
            )
        group = self.n_devices // n_instances
        host_each = int(self.host_memory_bytes * host_memory_share) // n_instances
        return tuple(
            InstanceSpec(
                name=f"{self.name}-{i}",
                hardware=self.name,
                device_memory_bytes=self.device_memory_bytes * group,
                host_memory_bytes=host_each,
                block_size=block_size,
                n_devices=group,
                memory_utilization=memory_utilization,
            )
            for i in range(n_instances)
        )


def _h200_tp8() -> HardwareProfile:
    """One 8 x H200 SXM server (NVIDIA DGX H200 / HGX H200 8-GPU)."""
    return HardwareProfile(
        name="h200-tp8",
        description="8 x NVIDIA H200 SXM (141 GB HBM3e) on NVLink 4 / NVSwitch, 2 TB DDR5, "
        "8 x 3.84 TB U.2 NVMe (DGX H200)",
        n_devices=8,
        device_memory_bytes=141 * 10**9,
        hbm_bandwidth_Bps=4.8e12,
        peak_flops_bf16=989e12,
        interconnect_Bps=450e9,
        host_link_Bps=64e9,
        host_memory_bytes=2 * 10**12,
        disk_Bps=8 * 6.5e9,
        mfu=0.5,
        hbm_efficiency=0.65,
        host_link_efficiency=0.8,
        disk_efficiency=0.5,
        d2d_efficiency=0.8,
        interconnect_efficiency=0.7,
        step_overhead_s=4e-3,
        allreduce_latency_s=10e-6,
        copy_latency_s=10e-6,
        sources=_H200_SOURCES,
        stage_step_slowdown=1.18,
        stage_share_beside_steps=0.946,
    )


_H200_SOURCES: Final = (
    "n_devices: NVIDIA DGX H200 system: eight H200 GPUs (NVIDIA DGX BasePOD reference "
    "architecture, 'Core Components', docs.nvidia.com/dgx-basepod)",
    "device_memory_bytes: NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e per GPU "
    "(DGX H200: 1,128 GB total); counted as 141e9 bytes, the conservative reading",
    "hbm_bandwidth_Bps: NVIDIA H200 datasheet: 4.8 TB/s HBM3e per GPU",
    "peak_flops_bf16: NVIDIA H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with 2:4 "
    "sparsity, i.e. 989 TFLOPS dense (same GH100 compute as H100 SXM)",
    "interconnect_Bps: NVIDIA H200 datasheet: NVLink 4 900 GB/s per GPU, bidirectional, "
    "i.e. 450 GB/s per direction through NVSwitch",
    "host_link_Bps: PCIe Gen5 x16 (H200 datasheet: 128 GB/s bidirectional): 32 GT/s x 16 "
    "lanes, 128b/130b = ~63 GB/s per direction, taken as 64e9",
    "host_memory_bytes: DGX H200: 2 TB DDR5 system memory (DGX BasePOD reference "
    "architecture, 'Core Components')",
    "disk_Bps: DGX H200: eight 3.84 TB U.2 NVMe drives for storage/cache (DGX BasePOD "
    "reference architecture); assumption: ~6.5 GB/s sequential read each (PCIe Gen4 x4 "
    "enterprise U.2 class), 52 GB/s aggregate in RAID 0",
    "mfu: assumption 0.5, the middle of the 40-60% whole-model prefill MFU range reported "
    "for vLLM/SGLang chunked prefill on Hopper; even the attention kernel alone peaks at "
    "~75% of H100 FP16 peak (FlashAttention-3, Shah et al. 2024), and norms, rotary, "
    "sampling and launch gaps sit below it. TP communication is costed separately",
    "hbm_efficiency: assumption 0.65: memory-bound decode typically reaches 60-80% of peak "
    "HBM bandwidth (model bandwidth utilisation, MBU, as defined in Databricks/MosaicML "
    "'LLM Inference Performance Engineering: Best Practices', 2023, which also shows MBU "
    "falling as the tensor-parallel degree grows); low end of the range for TP8",
    "host_link_efficiency: assumption 0.8: pinned-memory cudaMemcpy over PCIe Gen5 x16 "
    "typically achieves ~50-55 GB/s of the ~63 GB/s per direction",
    "disk_efficiency: assumption 0.5: weight loading through a filesystem on software "
    "RAID 0 and safetensors deserialisation rarely sustains the drives' aggregate",
    "d2d_efficiency: assumption 0.8: on-device cudaMemcpy reaches ~80-90% of peak HBM "
    "bandwidth (read + write)",
    "interconnect_efficiency: assumption 0.7: NCCL allreduce bus bandwidth on 8-GPU "
    "NVSwitch systems stays below the 450 GB/s link rate, more so for the MB-sized "
    "per-layer messages of inference",
    "step_overhead_s: assumption 4 ms per engine iteration (scheduling, sampling, "
    "detokenisation, CUDA-graph launch) for vLLM/SGLang-class engines",
    "allreduce_latency_s: assumption 10 us per small-message allreduce across 8 GPUs on "
    "NVSwitch (NCCL low-latency protocols / vLLM custom all-reduce regime)",
    "copy_latency_s: assumption 10 us per cudaMemcpyAsync (launch + completion)",
    "stage_step_slowdown: measured on one H200 (2026-12-04, benchmarks/gpu_engine.py, "
    "benchmarks/results/gpu_check/gpu_engine.json): Llama-3.1-8B decode steps of batch 32 "
    "took 1.18x as long beside a side-stream stage of Qwen2.5-7B's weights",
    "stage_share_beside_steps: the same run: the stage copied at 52.0 GB/s beside those "
    "decode steps and 55.0 GB/s idle, 0.946 of its idle rate",
)


_CPU_KEYS: Final = (
    "matmul_bf16_flop_s",
    "matmul_fp32_flop_s",
    "mem_copy_traffic_B_s",
    "memcpy_payload_B_s",
    "disk_read_B_s",
    "torch_op_overhead_s",
    "ram_bytes",
)

# The embedded engine's default model, SmolLM2-135M, has 30 layers of ~10 torch ops each.
_OPS_PER_STEP: Final = 300


def cpu_profile_from_dict(
    doc: Mapping[str, Any], origin: str = CPU_PROFILE_FILE
) -> HardwareProfile:
    """Build the ``cpu`` profile from a document written by ``benchmarks/cpu_profile.py``.

    The measured numbers are achieved rates, so every efficiency factor is 1. The device
    memory budget and the host tier each get a quarter of RAM (the rest is left to the OS,
    the engine's activations and the test process). Raises ConfigError naming a missing or
    invalid key.
    """
    measured = doc.get("measured")
    if not isinstance(measured, Mapping):
        raise ConfigError(f"{origin}: missing 'measured' section")
    for key in _CPU_KEYS:
        if not valid.is_number(measured.get(key)) or not measured[key] > 0:
            raise ConfigError(f"{origin}: measured.{key} must be a positive number")
    m = measured
    machine = doc.get("machine", {})
    where = (
        f"measured by {doc.get('measured_by', 'benchmarks/cpu_profile.py')} on "
        f"{machine.get('cpu', '?')}, "
        f"{machine.get('threads', '?')} threads, {doc.get('measured_at', '?')} ({origin})"
    )
    ram = int(m["ram_bytes"])
    flops, bandwidth, overhead, engine_note = _engine_fit(doc, m, origin)
    kv_rate, attn_rate, seq_s, attn_sources = _attention_fit(doc, origin)
    slowdown, share, stage_sources = _stage_fit(doc, origin)
    prices, co_run, price_sources = _step_prices(doc, origin)
    return HardwareProfile(
        name="cpu",
        description=f"this machine: {machine.get('cpu', 'CPU')}, RAM as both tiers",
        n_devices=1,
        device_memory_bytes=ram // 4,
        hbm_bandwidth_Bps=bandwidth,
        peak_flops_bf16=flops,
        interconnect_Bps=float(m["memcpy_payload_B_s"]),
        host_link_Bps=float(m["memcpy_payload_B_s"]),
        host_memory_bytes=ram // 4,
        disk_Bps=float(m["disk_read_B_s"]),
        **dict.fromkeys(EFFICIENCY_FIELDS, 1.0),  # achieved rates: every factor is 1
        step_overhead_s=overhead,
        allreduce_latency_s=0.0,
        copy_latency_s=float(m["torch_op_overhead_s"]),
        sources=_cpu_sources(where, float(m["matmul_fp32_flop_s"]), engine_note)
        + attn_sources
        + stage_sources
        + price_sources,
        kv_read_Bps=kv_rate,
        attention_flops_per_s=attn_rate,
        decode_seq_overhead_s=seq_s,
        stage_step_slowdown=slowdown,
        stage_share_beside_steps=share,
        step_prices=prices,
        co_run_slowdown=co_run,
    )


def _step_prices(
    doc: Mapping[str, Any], origin: str
) -> tuple[StepPrices | None, float | None, tuple[str, ...]]:
    """The additive model's prices from the engine fit's ``step_prices`` (the step grid's
    fit plus the serving path's overhead) and the co-run slowdown measured beside it, with
    their source lines; None without them."""
    engine = doc.get("engine")
    if not isinstance(engine, Mapping) or not isinstance(engine.get("fit"), Mapping):
        return None, None, ()
    stored = engine["fit"].get("step_prices")
    if stored is None:
        return None, None, ()
    if not isinstance(stored, Mapping):
        raise ConfigError(f"{origin}: engine.fit.step_prices must be an object")
    try:
        prices = StepPrices.from_json(stored)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: engine.fit.step_prices: {exc}") from None
    held = engine["fit"].get("step_grid_held_out", {})
    how = f"; held-out error median {held['median_abs']:.1%}" if "median_abs" in held else ""
    where = f"({_engine_by(engine)}, {engine.get('measured_at', '?')})"
    sources = [f"step_prices: step grid fit {where}{how}"]
    co_run = engine["fit"].get("co_run_slowdown")
    if co_run is not None:
        if not valid.is_number(co_run) or co_run < 1:
            raise ConfigError(f"{origin}: engine.fit.co_run_slowdown must be a number >= 1")
        sources.append(
            f"co_run_slowdown: steps beside a second engine stepping on another thread over "
            f"steps alone {where}, {float(co_run):.3f}"
        )
    return prices, None if co_run is None else float(co_run), tuple(sources)


def _engine_fit(
    doc: Mapping[str, Any], m: Mapping[str, Any], origin: str
) -> tuple[float, float, float, str | None]:
    """(FLOP/s, weight-read bandwidth B/s, step overhead s, note): the engine's own prefill
    FLOP rate, decode weight bandwidth and per-step overhead from the ``engine`` section that
    ``benchmarks/engine_calibration.py`` writes; without it, the raw machine rates (square
    matmul, tensor copy) and a per-op overhead estimate."""
    engine = doc.get("engine")
    if not isinstance(engine, Mapping) or not isinstance(engine.get("fit"), Mapping):
        raw_overhead = _OPS_PER_STEP * float(m["torch_op_overhead_s"])
        return float(m["matmul_bf16_flop_s"]), float(m["mem_copy_traffic_B_s"]), raw_overhead, None
    fitted = engine["fit"]
    for key in ("prefill_flop_s", "decode_weight_B_s", "step_overhead_s"):
        if not valid.is_number(fitted.get(key)) or fitted[key] < 0:
            raise ConfigError(f"{origin}: engine.fit.{key} must be a non-negative number")
    note = (
        f"fit to engine microbenchmarks ({_engine_by(engine)}, "
        f"{engine.get('measured_at', '?')}): prefill {fitted['prefill_flop_s']:.3e} FLOP/s, "
        f"decode weight reads {fitted['decode_weight_B_s']:.3e} B/s, step overhead "
        f"{fitted['step_overhead_s']:.4f} s"
    )
    return (
        float(fitted["prefill_flop_s"]),
        float(fitted["decode_weight_B_s"]),
        float(fitted["step_overhead_s"]),
        note,
    )


def _attention_fit(
    doc: Mapping[str, Any], origin: str
) -> tuple[float | None, float | None, float | None, tuple[str, ...]]:
    """(KV read B/s, attention FLOP/s, seconds per decoding sequence, their source lines)
    from the engine fit's ``decode_kv_B_s`` / ``attention_flop_s`` / ``decode_seq_s`` when
    present (None otherwise)."""
    engine = doc.get("engine")
    if not isinstance(engine, Mapping) or not isinstance(engine.get("fit"), Mapping):
        return None, None, None, ()
    fitted, measured_at = engine["fit"], engine.get("measured_at", "?")
    out: list[float | None] = []
    sources: list[str] = []
    for key, field, what in (
        ("decode_kv_B_s", "kv_read_Bps", "decode steps at two context lengths"),
        ("attention_flop_s", "attention_flops_per_s", "prefill chunks after two prefix lengths"),
        ("decode_seq_s", "decode_seq_overhead_s", "decode steps of 1 and 8 sequences"),
    ):
        value = fitted.get(key)
        if value is None:
            out.append(None)
            continue
        if not valid.is_number(value) or not value > 0:
            raise ConfigError(f"{origin}: engine.fit.{key} must be a positive number")
        out.append(float(value))
        sources.append(
            f"{field}: fit to engine microbenchmarks ({_engine_by(engine)}, "
            f"{measured_at}): {what}, {float(value):.3e}"
        )
    return out[0], out[1], out[2], tuple(sources)


def _stage_fit(
    doc: Mapping[str, Any], origin: str
) -> tuple[float | None, float | None, tuple[str, ...]]:
    """(step slowdown beside a stage, the stage's share of its idle rate beside steps, their
    source lines) from the engine fit, when it measured them (None otherwise)."""
    engine = doc.get("engine")
    if not isinstance(engine, Mapping) or not isinstance(engine.get("fit"), Mapping):
        return None, None, ()
    fitted = engine["fit"]
    slowdown, share = fitted.get("stage_step_slowdown"), fitted.get("stage_share_beside_steps")
    if slowdown is None or share is None:
        return None, None, ()
    if not (
        valid.is_number(slowdown) and slowdown >= 1 and valid.is_number(share) and 0 < share <= 1
    ):
        raise ConfigError(
            f"{origin}: engine.fit.stage_step_slowdown must be >= 1 and "
            "stage_share_beside_steps in (0, 1]"
        )
    where = f"engine microbenchmarks ({_engine_by(engine)}, {engine.get('measured_at', '?')})"
    return (
        float(slowdown),
        float(share),
        (
            f"stage_step_slowdown: {where}: decode steps beside the runner's background stage "
            f"copy over steps alone, {float(slowdown):.3f}",
            f"stage_share_beside_steps: {where}: the background stage copy's rate beside "
            f"decode steps over its rate idle, {float(share):.4f}",
        ),
    )


def _engine_by(engine: Mapping[str, Any]) -> str:
    """The program that measured an ``engine`` section (its ``method`` starts with it)."""
    method = engine.get("method")
    if isinstance(method, str) and ":" in method:
        return method.split(":", 1)[0]
    return "benchmarks/engine_calibration.py"


def _cpu_sources(where: str, fp32_flops: float, engine: str | None = None) -> tuple[str, ...]:
    achieved = "measured rates are achieved rates, so 1.0"
    return (
        "n_devices: one CPU 'device'",
        f"device_memory_bytes: a quarter of RAM ({where})",
        f"host_memory_bytes: a quarter of RAM ({where})",
        f"hbm_bandwidth_Bps: {engine}"
        if engine
        else f"hbm_bandwidth_Bps: read+write traffic of a 1 GiB tensor copy, {where}",
        f"peak_flops_bf16: {engine}"
        if engine
        else f"peak_flops_bf16: bf16 square matmul, {where}; fp32 measured {fp32_flops:.3e}",
        f"interconnect_Bps: unused with one device; set to the memcpy payload rate, {where}",
        f"host_link_Bps: payload rate of a copy between two preallocated buffers, {where}",
        f"disk_Bps: read of a fsync'd temp file after posix_fadvise(DONTNEED), {where}",
        *(f"{f}: {achieved}" for f in EFFICIENCY_FIELDS),
        f"step_overhead_s: {engine}"
        if engine
        else f"step_overhead_s: {_OPS_PER_STEP} torch ops (SmolLM2-135M: 30 layers x ~10 "
        f"ops) x measured per-op dispatch overhead, {where}",
        "allreduce_latency_s: one device, no allreduce",
        f"copy_latency_s: one torch op dispatch, {where}",
    )


SHIPPED_CPU_PROFILE: Final = f"talaria/cost/{CPU_PROFILE_FILE}"
"""Where the shipped ``cpu`` profile's document lives (as profile sources name it)."""


def read_cpu_document(path: Path | None = None) -> dict[str, Any]:
    """The JSON object of a ``cpu_profile.json`` (default: the one shipped in
    ``talaria.cost``); ConfigError when it is not one."""
    if path is None:
        resource = resources.files("talaria.cost").joinpath(CPU_PROFILE_FILE)
        origin, text = SHIPPED_CPU_PROFILE, resource.read_text(encoding="utf-8")
    else:
        origin, text = str(path), Path(path).read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{origin}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{origin}: expected a JSON object")
    return doc


def load_cpu_profile(path: Path | None = None) -> HardwareProfile:
    """Read a ``cpu_profile.json`` (default: the one shipped in ``talaria.cost``)."""
    origin = SHIPPED_CPU_PROFILE if path is None else str(path)
    return cpu_profile_from_dict(read_cpu_document(path), origin)


@functools.cache
def profiles() -> Mapping[str, HardwareProfile]:
    """Known profiles by name (read-only), read on first use (the ``cpu`` profile's file is
    only read when a profile is first asked for, never at import)."""
    return MappingProxyType({p.name: p for p in (_h200_tp8(), load_cpu_profile())})


def profile(name: str) -> HardwareProfile:
    """The profile called ``name``; ConfigError listing the known names otherwise."""
    known = profiles()
    try:
        return known[name]
    except KeyError:
        raise ConfigError(
            f"unknown hardware profile {name!r}; known profiles: {sorted(known)}"
        ) from None
