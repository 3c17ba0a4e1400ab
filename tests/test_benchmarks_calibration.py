"""The engine-calibration fit, and the cpu profile that uses it (exact arithmetic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from talaria.calibration.engine import fit
from talaria.cost.hardware import cpu_profile_from_dict, load_cpu_profile
from talaria.errors import ConfigError


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
        (Path(__file__).resolve().parents[1] / "talaria" / "cost" / "cpu_profile.json").read_text()
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


def test_fit_recovers_kv_read_and_attention_rates() -> None:
    """Models measured at two context lengths: the extra decode time per extra context byte
    gives the KV rate; the extra chunk time after a cached prefix, less its KV reads, per
    extra attention FLOP gives the attention rate."""
    models = {}
    for name, kvbpt, extra_flops, weights in (
        ("a", 1e4, 2e9, 1e8),
        ("b", 3e4, 6e9, 1e9),
        ("c", 5e4, 1e10, 2.5e9),
    ):
        m = _model(weights, 2e9, 0.01)
        extra_kv = 4 * (1024 - 256) * kvbpt
        m.update(
            kv_bytes_per_token=kvbpt,
            attention_batch=4,
            long_ctx=1024,
            decode_step_s_short_ctx=0.05,
            decode_step_s_long_ctx=0.05 + extra_kv / 2e9,
            chunk_tokens=256,
            chunk_s_fresh=0.3,
            chunk_s_after_prefix=0.3 + 1024 * kvbpt / 2e9 + extra_flops / 1e11,
            attention_flops_chunk_extra=extra_flops,
            decode_step_s_batch8=m["decode_step_s_batch1"] + 7 * 256 * kvbpt / 2e9 + 7 * 0.004,
        )
        models[name] = m
    got = fit(models)
    assert got["decode_kv_B_s"] == pytest.approx(2e9, rel=1e-9)
    assert got["attention_flop_s"] == pytest.approx(1e11, rel=1e-9)
    assert got["decode_seq_s"] == pytest.approx(0.004, rel=1e-9)
    assert got["step_overhead_s"] == pytest.approx(0.01 - 0.004, rel=1e-9)  # b1 pays both
    # noise that makes the longer run faster leaves the rates out rather than negative
    for m in models.values():
        m["decode_step_s_long_ctx"] = 0.04
    assert not {"decode_kv_B_s", "attention_flop_s", "decode_seq_s"} & set(fit(models))


def test_cpu_profile_takes_attention_rates_from_the_fit() -> None:
    shipped = json.loads(
        (Path(__file__).resolve().parents[1] / "talaria" / "cost" / "cpu_profile.json").read_text()
    )
    doc = dict(shipped)
    doc["engine"] = {
        "measured_at": "test",
        "fit": {
            "prefill_flop_s": 5e11,
            "decode_weight_B_s": 2e10,
            "step_overhead_s": 0.02,
            "decode_kv_B_s": 4e9,
            "attention_flop_s": 2e11,
            "decode_seq_s": 0.003,
        },
    }
    prof = cpu_profile_from_dict(doc, "test")
    assert prof.kv_read_Bps == 4e9 and prof.attention_flops_per_s == 2e11
    assert prof.decode_seq_overhead_s == 0.003
    assert prof.source_of("kv_read_Bps") and prof.source_of("attention_flops_per_s")
    doc["engine"]["fit"]["decode_kv_B_s"] = -1.0
    with pytest.raises(ConfigError, match="decode_kv_B_s"):
        cpu_profile_from_dict(doc, "test")


def test_fit_measures_a_stage_against_the_steps_beside_it() -> None:
    def stage(alone: float, beside: float, idle: float, busy: float) -> dict[str, float]:
        return {
            "stage_decode_step_s_alone": alone,
            "stage_decode_step_s_beside": beside,
            "stage_B_s_idle": idle,
            "stage_B_s_beside_decode": busy,
        }

    models = {
        "a": {**_model(1e8, 2e8, 0.01), **stage(0.010, 0.012, 10e9, 1e9)},
        "b": {**_model(1e9, 2e9, 0.01), **stage(0.020, 0.026, 10e9, 2e9)},
        "c": {**_model(2.5e9, 5e9, 0.01), **stage(0.040, 0.036, 10e9, 5e9)},
    }
    got = fit(models)
    assert got["stage_step_slowdown"] == pytest.approx(1.2)  # median of 1.2, 1.3, 0.9
    assert got["stage_share_beside_steps"] == pytest.approx(0.2)
    for m in models.values():  # a stage that sped the steps up is noise: never below 1
        m["stage_decode_step_s_beside"] = m["stage_decode_step_s_alone"] * 0.9
    assert fit(models)["stage_step_slowdown"] == 1.0
    bare = {name: _model(1e8 * (i + 1), 2e8, 0.01) for i, name in enumerate("abc")}
    assert "stage_step_slowdown" not in fit(bare)


def test_cpu_profile_takes_stage_contention_from_the_fit() -> None:
    shipped = json.loads(
        (Path(__file__).resolve().parents[1] / "talaria" / "cost" / "cpu_profile.json").read_text()
    )
    doc = dict(shipped)
    fitted = {"prefill_flop_s": 5e11, "decode_weight_B_s": 2e10, "step_overhead_s": 0.02}
    doc["engine"] = {"measured_at": "test", "fit": fitted}
    assert cpu_profile_from_dict(doc, "test").stage_step_slowdown is None
    doc["engine"] = {
        "measured_at": "test",
        "fit": {**fitted, "stage_step_slowdown": 1.25, "stage_share_beside_steps": 0.05},
    }
    prof = cpu_profile_from_dict(doc, "test")
    assert (prof.stage_step_slowdown, prof.stage_share_beside_steps) == (1.25, 0.05)
    assert prof.source_of("stage_step_slowdown") and prof.source_of("stage_share_beside_steps")
    doc["engine"]["fit"]["stage_share_beside_steps"] = 1.5
    with pytest.raises(ConfigError, match="stage_share_beside_steps"):
        cpu_profile_from_dict(doc, "test")


def test_a_model_is_measured_alone_and_beside_a_stage_copy() -> None:
    import torch

    from talaria.backends.embedded import load_catalog_model
    from talaria.calibration.engine import measure_model
    from talaria.calibration.plan import EngineBench

    tiny = load_catalog_model("smollm2-tiny-dummy", torch.float32)
    bench = EngineBench(
        prefill_tokens=32,
        decode_steps=6,
        reps=1,
        short_ctx=16,
        long_ctx=48,
        chunk=16,
        attention_batch=2,
        device_memory_bytes=200 * 10**6,
        host_memory_bytes=200 * 10**6,
        grid=None,
    )
    out = measure_model("smollm2-tiny-dummy", tiny, bench, torch.float32)
    for key in ("stage_decode_step_s_alone", "stage_decode_step_s_beside"):
        assert 0 < out[key] < 1.0
    assert out["stage_B_s_idle"] > 1e8 and out["stage_B_s_beside_decode"] > 0


def test_the_step_grid_benchmark_runs_twice_and_reports_agreement(tmp_path: Path) -> None:
    from benchmarks.step_grid import main

    out = tmp_path / "grid.json"
    assert main(["--quick", "--runs", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 2 and doc["small_rows"] == 0  # float32: no native product
    for run in doc["runs"]:
        # two models, 6 decode, 4 one-chunk prefill and 2 four-chunk prefill shapes
        assert len(run["points"]) == 2 * 12
        assert set(run["held_out_by_kind"]) == {"decode", "prefill"}
    assert doc["agreement"]["prediction_difference_max"] >= 0
