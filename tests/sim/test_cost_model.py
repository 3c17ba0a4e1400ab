"""Hardware profiles and the roofline cost model, checked against hand-computed seconds.

The tiny profile has round numbers (peak 1e12 FLOP/s, HBM 1e9 B/s, efficiencies 1, no fixed
costs) so every expected value below is worked out in the comment next to it.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from talaria.config import ModelSpec
from talaria.cost.cost_model import CostModel, shared_params_estimate
from talaria.cost.hardware import (
    NUMERIC_FIELDS,
    HardwareProfile,
    cpu_profile_from_dict,
    load_cpu_profile,
    profile,
    profiles,
)
from talaria.cost.step_shape import StepShape
from talaria.errors import BadRequest, ConfigError
from talaria.types import Link


def make_hw(**overrides: Any) -> HardwareProfile:
    values: dict[str, Any] = {
        "name": "tiny",
        "description": "hand-built test profile",
        "n_devices": 1,
        "device_memory_bytes": 10**9,
        "hbm_bandwidth_Bps": 1e9,
        "peak_flops_bf16": 1e12,
        "interconnect_Bps": 1e9,
        "host_link_Bps": 1e9,
        "host_memory_bytes": 4 * 10**9,
        "disk_Bps": 1e9,
        "mfu": 1.0,
        "hbm_efficiency": 1.0,
        "host_link_efficiency": 1.0,
        "disk_efficiency": 1.0,
        "d2d_efficiency": 1.0,
        "interconnect_efficiency": 1.0,
        "step_overhead_s": 0.0,
        "allreduce_latency_s": 0.0,
        "copy_latency_s": 0.0,
        "sources": tuple(f"{f}: test" for f in NUMERIC_FIELDS),
    }
    values.update(overrides)
    return HardwareProfile(**values)


# weight_bytes 2e6; kv_bytes_per_token = 2 * 2 layers * 2 kv heads * 16 * 2 B = 256;
# flops_per_token = 2e6; attention_flops(c) = 4 * 2 * 4 * 16 * c = 512 c.
DENSE = ModelSpec(
    name="tiny-dense",
    n_layers=2,
    hidden_size=64,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=100,
    total_params=1_000_000,
    active_params=1_000_000,
)

# Shared estimate: 2 layers * 2 * 64 * 16 * (4 + 2) = 24,576 attention + 2 * 100 * 64 = 12,800
# embeddings = 37,376. Experts: 1,000,000 params, a token uses 250,000 of them (p = 1/4).
MOE = attrs.evolve(DENSE, name="tiny-moe", total_params=1_037_376, active_params=37_376 + 250_000)


# -- HardwareProfile ---------------------------------------------------------------------


def test_profile_accepts_valid_values_and_reports_sources() -> None:
    hw = make_hw()
    assert hw.source_of("mfu") == ("test",)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("n_devices", 0),
        ("n_devices", 2.0),
        ("n_devices", True),
        ("device_memory_bytes", -1),
        ("hbm_bandwidth_Bps", 0.0),
        ("peak_flops_bf16", math.inf),
        ("disk_Bps", math.nan),
        ("mfu", 0.0),
        ("hbm_efficiency", 1.5),
        ("d2d_efficiency", -0.1),
        ("step_overhead_s", -1e-3),
        ("allreduce_latency_s", math.nan),
        ("name", " padded "),
        ("name", ""),
    ],
)
def test_profile_rejects_bad_values(field: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=field if field != "name" else "name"):
        make_hw(**{field: bad})


def test_profile_requires_a_source_for_every_number() -> None:
    sources = tuple(f"{f}: test" for f in NUMERIC_FIELDS if f != "disk_Bps")
    with pytest.raises(ConfigError, match="disk_Bps"):
        make_hw(sources=sources)
    with pytest.raises(ConfigError, match="non-empty"):
        make_hw(sources=(*sources, "disk_Bps: x", "  "))
    with pytest.raises(ConfigError, match="provision_s"):  # optional, cited where set
        make_hw(provision_s=30.0)
    assert make_hw(provision_s=30.0, sources=(*sources, "disk_Bps: x", "provision_s: y"))


def test_profiles_mapping_is_read_only_and_lookup_names_known_profiles() -> None:
    assert set(profiles()) == {"h200-tp8", "cpu"}
    assert profile("h200-tp8") is profiles()["h200-tp8"]
    with pytest.raises(TypeError):
        profiles()["x"] = make_hw()  # type: ignore[index]
    with pytest.raises(ConfigError, match=r"known profiles: \['cpu', 'h200-tp8'\]"):
        profile("a100")


def test_h200_profile_datasheet_numbers() -> None:
    hw = profile("h200-tp8")
    assert hw.n_devices == 8
    assert hw.device_memory_bytes == 141 * 10**9
    assert hw.hbm_bandwidth_Bps == 4.8e12
    assert hw.peak_flops_bf16 == 989e12
    assert hw.host_memory_bytes == 2 * 10**12
    assert all(hw.source_of(f) for f in NUMERIC_FIELDS)


def test_cpu_profile_loads_measured_json() -> None:
    hw = profile("cpu")
    assert hw.n_devices == 1
    assert "engine_calibration.py" in hw.source_of("peak_flops_bf16")[0]
    assert "measured by benchmarks/cpu_profile.py" in hw.source_of("host_link_Bps")[0]
    assert load_cpu_profile() == hw


def test_cpu_profile_from_dict_maps_fields_and_rejects_missing_keys() -> None:
    measured = {
        "matmul_bf16_flop_s": 1e11,
        "matmul_fp32_flop_s": 5e10,
        "mem_copy_traffic_B_s": 2e10,
        "memcpy_payload_B_s": 1e10,
        "disk_read_B_s": 1e9,
        "torch_op_overhead_s": 2e-6,
        "ram_bytes": 16 * 10**9,
    }
    hw = cpu_profile_from_dict({"measured": measured})
    assert (hw.peak_flops_bf16, hw.hbm_bandwidth_Bps, hw.host_link_Bps) == (1e11, 2e10, 1e10)
    assert (hw.device_memory_bytes, hw.host_memory_bytes) == (4 * 10**9, 4 * 10**9)
    assert hw.step_overhead_s == pytest.approx(300 * 2e-6)
    del measured["disk_read_B_s"]
    with pytest.raises(ConfigError, match="disk_read_B_s"):
        cpu_profile_from_dict({"measured": measured})
    with pytest.raises(ConfigError, match="measured"):
        cpu_profile_from_dict({})


def test_instances_split_devices_into_equal_tp_groups() -> None:
    hw = make_hw(n_devices=8, device_memory_bytes=100, host_memory_bytes=1000)
    a, b = hw.instances(2, host_memory_share=0.8, block_size=32)
    assert (a.name, b.name) == ("tiny-0", "tiny-1")
    assert a.n_devices == 4 and a.device_memory_bytes == 400
    assert a.host_memory_bytes == 400  # 1000 * 0.8 / 2
    assert a.block_size == 32 and a.hardware == "tiny"
    (one,) = hw.instances()
    assert one.n_devices == 8 and one.device_memory_bytes == 800


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_instances": 3}, "equal tensor-parallel groups"),
        ({"n_instances": 0}, "n_instances"),
        ({"n_instances": 1, "host_memory_share": 0.0}, "host_memory_share"),
        ({"n_instances": 1, "host_memory_share": 1.5}, "host_memory_share"),
    ],
)
def test_instances_reject_bad_splits(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_hw(n_devices=8).instances(**kwargs)


# -- CostModel -----------------------------------------------------------------------------


def test_cost_model_validates_tp_degree() -> None:
    with pytest.raises(ConfigError, match=r"1\.\.1"):
        CostModel(make_hw(), 2)
    with pytest.raises(ConfigError, match="n_devices"):
        CostModel(make_hw(n_devices=8), 0)


def test_decode_step_memory_bound() -> None:
    cm = CostModel(make_hw(), 1)
    # compute: (1 * 2e6 + 512 * 1000) / 1e12 = 2.512e-6 s
    # memory: weights 2e6 + KV read 1000 * 256 + KV write 1 * 256 = 2,256,256 B / 1e9 B/s
    assert cm.decode_step_s(DENSE, batch=1, context_tokens=1000) == pytest.approx(2.256256e-3)


def test_prefill_step_compute_bound() -> None:
    cm = CostModel(make_hw(peak_flops_bf16=1e11), 1)
    # attention sum for 1000 new tokens, no cache: 1000 * 1001 / 2 = 500,500
    # compute: (1000 * 2e6 + 512 * 500,500) / 1e11 = 2,256,256,000 / 1e11 = 2.256256e-2 s
    # memory: 2e6 + (1000 write + 500.5 mean-context read) * 256 = 2,384,128 B -> 2.384e-3 s
    assert cm.prefill_s(DENSE, 1000) == pytest.approx(2.256256e-2)
    assert cm.recompute_s(DENSE, 1000) == cm.prefill_s(DENSE, 1000)


def test_prefill_after_cached_prefix_counts_attention_to_the_cache() -> None:
    cm = CostModel(make_hw(peak_flops_bf16=1e11), 1)
    # 100 new tokens after 1000 cached: attention sum 100 * 1000 + 100 * 101 / 2 = 105,050
    # compute: (100 * 2e6 + 512 * 105,050) / 1e11 = 253,785,600 / 1e11
    # memory: 2e6 + (100 + 1050.5) * 256 = 2,294,528 B -> 2.294528e-3 s (smaller)
    assert cm.prefill_s(DENSE, 100, cached_tokens=1000) == pytest.approx(2.537856e-3)


def test_step_mixes_prefill_and_decode_and_adds_overhead() -> None:
    cm = CostModel(make_hw(step_overhead_s=1e-3), 1)
    # 10 prefill tokens (attn 55) + 4 decode seqs over 400 context tokens, 14 tokens in all.
    # compute: (14 * 2e6 + 512 * (55 + 400)) / 1e12 = 28,232,960 / 1e12 = 2.823296e-5 s
    # memory: 2e6 + (10 + 4 + 400 + 55/10) * 256 = 2,107,392 B -> 2.107392e-3 s
    assert cm.step_s(DENSE, StepShape(10, 55, 4, 400)) == pytest.approx(2.107392e-3 + 1e-3)


def test_empty_step_costs_nothing_and_negative_inputs_are_rejected() -> None:
    cm = CostModel(make_hw(step_overhead_s=1.0), 1)
    assert cm.step_s(DENSE, StepShape()) == 0.0
    with pytest.raises(BadRequest, match="decode_seqs"):
        StepShape(0, 0.0, -1, 0)
    with pytest.raises(BadRequest, match="prefill_attn_tokens"):
        StepShape(1, math.nan, 0, 0)


def test_efficiency_factors_scale_the_roofline() -> None:
    cm = CostModel(make_hw(hbm_efficiency=0.5, mfu=0.25, peak_flops_bf16=1e11), 1)
    # memory-bound decode: 2,256,256 B / (1e9 * 0.5) = 4.512512e-3 s
    assert cm.decode_step_s(DENSE, 1, 1000) == pytest.approx(4.512512e-3)
    # compute-bound prefill: 2,256,256,000 / (1e11 * 0.25) = 9.025024e-2 s
    assert cm.prefill_s(DENSE, 1000) == pytest.approx(9.025024e-2)


def test_tensor_parallel_divides_work_and_adds_allreduces() -> None:
    hw = make_hw(n_devices=2, allreduce_latency_s=1e-6)
    cm = CostModel(hw, 2)
    # memory: (2e6 + 1 * 256) B / (2 * 1e9) = 1.000128e-3 s
    # one allreduce: 64 hidden * 1 token * 2 B = 128 B; ring 2 * 1/2 * 128 / 1e9 = 1.28e-7 s
    #   + 1e-6 latency = 1.128e-6 s; 2 per layer * 2 layers = 4.512e-6 s
    assert cm.tp_comm_s(DENSE, 1) == pytest.approx(4.512e-6)
    assert cm.decode_step_s(DENSE, 1, 0) == pytest.approx(1.000128e-3 + 4.512e-6)
    # one device: no allreduce, memory 2,000,256 B / 1e9
    assert CostModel(hw, 1).decode_step_s(DENSE, 1, 0) == pytest.approx(2.000256e-3)


def test_kv_heads_are_replicated_beyond_the_kv_head_count() -> None:
    hw = make_hw(n_devices=4)
    assert CostModel(hw, 2).kv_replication(DENSE) == 1.0
    assert CostModel(hw, 4).kv_replication(DENSE) == 2.0
    assert CostModel(hw, 4).kv_bytes_per_token(DENSE) == 512.0
    # memory at TP4: (2e6 + (1000 + 1) * 512) B / (4 * 1e9) = 2,512,512 / 4e9 = 6.28128e-4 s
    # allreduces: 4 * (2 * 3/4 * 128 B / 1e9 B/s) = 7.68e-7 s
    assert CostModel(hw, 4).decode_step_s(DENSE, 1, 1000) == pytest.approx(6.28896e-4)


def test_moe_weights_touched_grow_with_tokens_up_to_all_weights() -> None:
    cm = CostModel(make_hw(), 1)
    assert shared_params_estimate(MOE) == 37_376
    assert cm.weight_bytes_touched(MOE, 0) == 0.0
    # one token: exactly the active parameters, 287,376 * 2 B
    assert cm.weight_bytes_touched(MOE, 1) == pytest.approx(574_752)
    # two tokens: 37,376 + 1e6 * (1 - 0.75^2) = 474,876 params
    assert cm.weight_bytes_touched(MOE, 2) == pytest.approx(949_752)
    many = cm.weight_bytes_touched(MOE, 1000)
    assert many <= MOE.weight_bytes
    assert many == pytest.approx(MOE.weight_bytes, rel=1e-9)
    # dense models always read every weight
    assert cm.weight_bytes_touched(DENSE, 1) == cm.weight_bytes_touched(DENSE, 7) == 2e6


def test_moe_decode_step_uses_touched_weights() -> None:
    cm = CostModel(make_hw(), 1)
    # two sequences, no context: memory (949,752 + 2 * 256) B / 1e9; compute is tiny
    assert cm.decode_step_s(MOE, 2, 0) == pytest.approx(9.50264e-4)


def test_copy_s_for_every_link() -> None:
    hw = make_hw(
        n_devices=2,
        disk_efficiency=0.5,
        host_link_efficiency=0.8,
        d2d_efficiency=0.5,
        copy_latency_s=1e-5,
    )
    cm = CostModel(hw, 2)
    # disk: server aggregate, 1e9 * 0.5 B/s
    assert cm.copy_s(10**9, Link.DISK_TO_HOST) == pytest.approx(2.0 + 1e-5)
    # PCIe: each of 2 ranks copies its shard, 2 * 1e9 * 0.8 B/s
    assert cm.copy_s(10**9, Link.HOST_TO_DEVICE) == pytest.approx(0.625 + 1e-5)
    assert cm.copy_s(10**9, Link.DEVICE_TO_HOST) == pytest.approx(0.625 + 1e-5)
    # on device: read + write, 2 * 1e9 / 2 * 0.5 B/s
    assert cm.copy_s(10**9, Link.DEVICE_TO_DEVICE) == pytest.approx(2.0 + 1e-5)
    assert cm.copy_s(0, Link.HOST_TO_DEVICE) == 0.0
    with pytest.raises(BadRequest, match="nbytes"):
        cm.copy_s(-1, Link.DISK_TO_HOST)


def test_costs_are_deterministic_and_monotone_in_context() -> None:
    cm = CostModel(profile("h200-tp8"), 8)
    model = attrs.evolve(DENSE, n_kv_heads=4, n_heads=8)
    a = [cm.decode_step_s(model, 8, c) for c in (0, 1000, 10_000, 100_000)]
    assert a == sorted(a)
    assert a == [cm.decode_step_s(model, 8, c) for c in (0, 1000, 10_000, 100_000)]


def test_attention_rates_of_their_own_price_kv_reads_and_attention_flops() -> None:
    """With ``kv_read_Bps`` / ``attention_flops_per_s`` set (the CPU engine's calibration),
    KV traffic and attention FLOPs use them; weights and matmuls keep the main rates."""
    sources = (
        *(f"{f}: test" for f in NUMERIC_FIELDS),
        "kv_read_Bps: t",
        "attention_flops_per_s: t",
    )
    hw = make_hw(kv_read_Bps=1e8, attention_flops_per_s=1e10, sources=sources)
    cm = CostModel(hw, 1)
    # decode of 4 sequences over 4,000 context tokens:
    # memory 2e6 B / 1e9 + (4 + 4000) * 256 B / 1e8 = 0.002 + 0.0102502 s;
    # compute 4 * 2e6 / 1e12 + 512 * 4000 / 1e10 = 8e-6 + 2.048e-4 s
    assert cm.decode_step_s(DENSE, 4, 4000) == pytest.approx(0.002 + 4004 * 256 / 1e8, rel=1e-12)
    # a 100-token prefill after 1,000 cached: compute 100 * 2e6 / 1e12 + 512 * attn / 1e10
    attn = 100 * 1000 + 100 * 101 / 2
    compute = 100 * 2e6 / 1e12 + 512 * attn / 1e10
    memory = 2e6 / 1e9 + (100 + attn / 100) * 256 / 1e8
    assert cm.prefill_s(DENSE, 100, 1000) == pytest.approx(max(compute, memory), rel=1e-12)
    seq_sources = (*sources, "decode_seq_overhead_s: t")
    per_seq = CostModel(make_hw(decode_seq_overhead_s=0.005, sources=seq_sources), 1)
    assert per_seq.decode_step_s(DENSE, 4, 4000) == pytest.approx(
        max(8e-6 + 512 * 4000 / 1e12, 0.002 + 4004 * 256 / 1e9) + 4 * 0.005, rel=1e-12
    )
    plain = CostModel(make_hw(), 1)  # unset: the main rates, as before
    assert plain.kv_read_Bps == plain.hbm_Bps and plain.attention_flops_per_s == plain.flops_per_s
    with pytest.raises(ConfigError, match="kv_read_Bps"):
        make_hw(kv_read_Bps=1e8)  # set but not cited
    with pytest.raises(ConfigError, match="attention_flops_per_s"):
        make_hw(attention_flops_per_s=-1.0, sources=sources)
