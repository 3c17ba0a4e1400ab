"""The engine-calibration fit, and the cpu profile that uses it (exact arithmetic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine_calibration import fit
from talaria.sim.hardware import cpu_profile_from_dict, load_cpu_profile


def _model(weight_bytes: float, flops_per_token: float, overhead: float) -> dict[str, float]:
    return {
        "weight_bytes": weight_bytes,
        "flops_per_token": flops_per_token,
        "attention_flops_prefill": 0.0,
        "prefill_tokens": 1000,
        "prefill_s": overhead + 1000 * flops_per_token / 4e11,
        "decode_step_s_batch1": overhead + weight_bytes / 5e9,
    }


def test_fit_recovers_bandwidth_overhead_and_flop_rate() -> None:
    models = {
        "a": _model(1e8, 2e8, 0.01),
        "b": _model(1e9, 2e9, 0.01),
        "c": _model(2.5e9, 5e9, 0.01),
    }
    got = fit(models)
    assert got["decode_weight_B_s"] == pytest.approx(5e9, rel=1e-9)
    assert got["step_overhead_s"] == pytest.approx(0.01, rel=1e-9)
    assert got["prefill_flop_s"] == pytest.approx(4e11, rel=1e-9)


def test_cpu_profile_prefers_the_engine_fit(tmp_path: Path) -> None:
    shipped = json.loads(
        (Path(__file__).resolve().parents[1] / "talaria" / "sim" / "cpu_profile.json").read_text()
    )
    raw = shipped["measured"]
    doc = {k: v for k, v in shipped.items() if k != "engine"}
    doc["engine"] = {
        "measured_at": "test",
        "fit": {
            "prefill_flop_s": raw["matmul_bf16_flop_s"] / 2,
            "decode_weight_B_s": raw["mem_copy_traffic_B_s"] / 4,
            "step_overhead_s": 0.02,
        },
    }
    prof = cpu_profile_from_dict(doc, "test")
    assert prof.peak_flops_bf16 == raw["matmul_bf16_flop_s"] / 2
    assert prof.hbm_bandwidth_Bps == raw["mem_copy_traffic_B_s"] / 4
    assert prof.step_overhead_s == 0.02 and prof.mfu == 1.0
    assert any("engine microbenchmarks" in s for s in prof.sources)
    plain = cpu_profile_from_dict({k: v for k, v in doc.items() if k != "engine"}, "test")
    assert plain.peak_flops_bf16 == raw["matmul_bf16_flop_s"]
    assert plain.hbm_bandwidth_Bps == raw["mem_copy_traffic_B_s"]
    assert load_cpu_profile().name == "cpu"
