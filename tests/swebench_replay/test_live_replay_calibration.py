"""The embedded replay calibrates where it runs: ``--calibration`` picks the profile that
prices the routers and the prediction, the results say which, and the calibration is made
before any policy runs, from the models alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import talaria.calibration.calibrate as calibrate_module
import talaria.swebench_replay.live_replay as live_replay
from talaria.calibration.cache import MEASURED_HERE, SHIPPED, CalibrationMode
from talaria.cli import main
from talaria.engine.loader import LoadedModel
from talaria.engine.runner import flatten_weights
from talaria.policy.baselines import POLICIES
from talaria.swebench_replay.live_replay import EmbeddedOptions, run_embedded_replay
from talaria.swebench_replay.setup import Workload, load_workload
from tests.calibration.test_calibrate import TINY_PLAN, QuietWatch, tiny_models

MB = 2**20
MODELS = ("llama-tiny", "qwen-tiny")


def _tiny_load(_options: EmbeddedOptions) -> tuple[dict[str, LoadedModel], dict[str, Any]]:
    """What ``live_replay._load`` returns, for the tiny models."""
    bare, host = {}, {}
    for name, m in tiny_models().items():
        host[name] = flatten_weights(name, m.arch, m.tensors, torch.float32)
        bare[name] = attrs.evolve(m, tensors={})
    return bare, host


def tiny_workload(sessions: int, calls: int) -> Workload:
    """A seeded synthetic replay the tiny models can serve (short contexts, small ids)."""
    return load_workload(
        synthetic=True,
        n_sessions=sessions,
        target_calls=calls,
        seed=1,
        models=MODELS,
        max_context=240,
        token_scale=0.01,
        vocab_size=128,
    )


def _options(mode: CalibrationMode, cache: Path) -> EmbeddedOptions:
    policy = attrs.evolve(POLICIES["talaria"], slot_max_s=0.5, slot_linger_s=0.05)
    return EmbeddedOptions(
        (policy,),
        models=MODELS,
        device_memory_bytes=4 * MB,
        host_memory_bytes=8 * MB,
        dtype=torch.float32,
        gap_scale=0.02,
        calibration=mode,
        calibration_plan=TINY_PLAN,
        cache_dir=cache,
    )


def test_the_calibration_mode_prices_the_prediction_and_sees_no_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = tiny_workload(3, 15)
    monkeypatch.setattr(live_replay, "_load", _tiny_load)
    monkeypatch.setattr(calibrate_module, "CpuWatch", QuietWatch)
    played: list[str] = []
    real_play, real_calibrate = live_replay._play, live_replay.calibrate
    seen: list[tuple[int, tuple[Any, ...], dict[str, Any]]] = []

    async def play(*args: Any) -> Any:
        played.append(args[2])
        return await real_play(*args)

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append((len(played), args, kwargs))
        return real_calibrate(*args, **kwargs)

    routers: list[Any] = []
    real_cluster = live_replay.cluster_from_loaded

    def cluster(*args: Any, **kwargs: Any) -> Any:
        built = real_cluster(*args, **kwargs)
        if "hardware" in kwargs:  # a policy's cluster (the warm-up's prices nothing)
            routers.append(built.core.instances["cpu-0"].estimator.cost.hw)
        return built

    monkeypatch.setattr(live_replay, "_play", play)
    monkeypatch.setattr(live_replay, "cluster_from_loaded", cluster)
    monkeypatch.setattr(live_replay, "calibrate", spy)

    def replay(mode: CalibrationMode) -> dict[str, Any]:
        return run_embedded_replay(workload.replay, _options(mode, tmp_path), workload.tool_table)

    fresh = replay(CalibrationMode.FRESH)
    cal = fresh["calibration"]
    assert cal["origin"] == MEASURED_HERE and cal["measured_now"]
    assert cal["key"]["models"] == list(MODELS) and cal["path"].startswith(str(tmp_path))
    # measured before any policy ran, from the models: no replay set, script or result in
    (before, args, kwargs) = seen[0]
    assert before == 0 and played == ["talaria"]
    assert set(args[1]) == set(MODELS)
    inputs = [*args, *kwargs.values()]
    assert not any(x is workload.replay or x is workload.tool_table for x in inputs)
    assert not any(isinstance(x, dict) and "policies" in x for x in inputs)

    def no_measuring(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("auto with a matching cached calibration measures nothing")

    monkeypatch.setattr(calibrate_module, "measure_engine", no_measuring)
    cached = replay(CalibrationMode.AUTO)
    assert cached["calibration"]["origin"] == MEASURED_HERE
    assert not cached["calibration"]["measured_now"]
    assert cached["calibration"]["digest"] == cal["digest"]
    shipped = replay(CalibrationMode.SHIPPED)
    assert shipped["calibration"]["origin"] == SHIPPED and shipped["calibration"]["key"] is None
    # the profile is what prices: the live routers' estimates and the (deterministic)
    # simulator's prediction move with it, and only with it
    assert [p.peak_flops_bf16 for p in routers] == [
        d["calibration"]["profile"]["peak_flops_bf16"] for d in (fresh, cached, shipped)
    ]
    predicted = [d["fidelity"]["talaria"]["predicted_sct_mean_s"] for d in (fresh, cached, shipped)]
    assert predicted[0] == predicted[1] != predicted[2]
    # a calibration with step prices is checked against the roofline it replaced, on the
    # same run; the shipped profile has none, so there is nothing to set beside it
    assert fresh["calibration"]["step_prices"] is not None
    assert "roofline_error_sct_p50_s" in fresh["fidelity"]["talaria"]
    assert "roofline_error_sct_p50_s" not in shipped["fidelity"]["talaria"]
    assert fresh["step_log"]["talaria"] and "loop_cpu_s" in fresh["step_log"]["talaria"][0]

    # the command line's flag reaches the replay, and the report names the calibration
    modes: list[CalibrationMode] = []

    def fake(_replay: Any, options: EmbeddedOptions, *_a: Any, **_k: Any) -> dict[str, Any]:
        modes.append(options.calibration)
        return json.loads(
            json.dumps(cached if options.calibration is not CalibrationMode.SHIPPED else shipped)
        )

    monkeypatch.setattr(live_replay, "run_embedded_replay", fake)
    argv = ["replay", "--substrate", "embedded", "--synthetic", "--sessions", "2", "--calls", "10"]
    for flag in ("auto", "shipped", "fresh"):
        extra = [] if flag == "auto" else ["--calibration", flag]
        capsys.readouterr()
        assert main([*argv, *extra, "--out", str(tmp_path / flag)]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert (
            "cpu profile: shipped profile" if flag == "shipped" else "cpu profile: measured here"
        ) in out
        written = json.loads((tmp_path / flag / "results.json").read_text())
        assert "calibration" in written
    assert modes == [CalibrationMode.AUTO, CalibrationMode.SHIPPED, CalibrationMode.FRESH]


def test_the_simulated_replay_refuses_a_calibration_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["replay", "--synthetic", "--calibration", "fresh", "--out", str(tmp_path)])
    assert rc == 2
    assert "--calibration applies to --substrate embedded" in " ".join(
        capsys.readouterr().out.split()
    )


def test_the_embedded_replay_runs_its_policies_at_knobs_tuned_in_the_simulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tuning sees the replay's own cluster priced by the calibration, and the tune part
    of sessions shaped like the replay's; the policies then run at the chosen knobs."""
    from talaria.swebench_replay.runs import Setting, WorkloadSpec
    from talaria.swebench_replay.split import Part
    from talaria.swebench_replay.tuning import to_document, tune

    workload = tiny_workload(3, 15)
    monkeypatch.setattr(live_replay, "_load", _tiny_load)
    monkeypatch.setattr(calibrate_module, "CpuWatch", QuietWatch)
    spec = WorkloadSpec(
        synthetic=True,
        part=Part.TUNE,
        sessions=3,
        calls=15,
        models=MODELS,
        max_context=240,
        token_scale=0.01,
        vocab_size=128,
    )
    settings: list[Setting] = []

    def tuner(setting: Setting) -> dict[str, Any]:
        settings.append(setting)
        chosen = tune(spec, setting, [POLICIES["talaria"]], seeds=(0,))
        return to_document(chosen, "test-key", (0,))

    options = attrs.evolve(_options(CalibrationMode.FRESH, tmp_path), tune=tuner)
    doc = run_embedded_replay(workload.replay, options, workload.tool_table)
    (setting,) = settings
    assert [m.name for m in setting.cluster.models] == list(MODELS)
    assert setting.hardware[0].peak_flops_bf16 == doc["calibration"]["profile"]["peak_flops_bf16"]
    assert doc["tuning"]["key"] == "test-key"
    assert doc["policies"]["talaria"]["knobs"] == doc["tuning"]["policies"]["talaria"]["knobs"]
