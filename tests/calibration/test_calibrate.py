"""Calibrating where Talaria runs: measuring on tiny models, the cache hit, the modes, the
key of this machine, and the server's cached lookup."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import talaria.calibration.calibrate as calibrate_module
from talaria.backends.embedded import build_embedded_cluster
from talaria.calibration.cache import (
    MEASURED_HERE,
    SHIPPED,
    CalibrationMode,
    read_cached,
    write_cached,
)
from talaria.calibration.calibrate import calibrate
from talaria.calibration.grid import StepGrid
from talaria.calibration.machine import CpuWatch, RateSizes
from talaria.calibration.plan import (
    CALIBRATION_MODELS,
    STEP_TIME_SOURCES,
    CalibrationPlan,
    EngineBench,
    cached_profiles,
    calibration_key,
    this_machine,
)
from talaria.config import CACHE_ENV, InstanceSpec
from talaria.cost import profile
from talaria.cost.hardware import read_cpu_document
from talaria.engine.loader import LoadedModel, load_dummy
from talaria.policy.baselines import POLICIES
from tests.helpers import llama_config, qwen2_config

MB = 2**20
TINY_PLAN = CalibrationPlan(
    rates=RateSizes(matmul_n=64, reps=1, copy_mb=1, memcpy_mb=1, file_mb=1),
    engine=EngineBench(
        prefill_tokens=32,
        decode_steps=2,
        reps=1,
        short_ctx=16,
        long_ctx=48,
        chunk=16,
        attention_batch=2,
        device_memory_bytes=8 * MB,
        host_memory_bytes=8 * MB,
        grid=StepGrid(
            decode_batches=(1, 3),
            decode_contexts=(16, 40),
            chunks=(4, 20),
            prefixes=(0, 24),
            reps=1,
        ),
    ),
)


class QuietWatch:
    """A ``CpuWatch`` that reports ``share`` of the CPUs taken by other processes (the
    tests must not depend on what else the machine runs)."""

    share = 0.0

    def others_share(self) -> float:
        return self.share


class BusyWatch(QuietWatch):
    share = 0.6


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate_module, "CpuWatch", QuietWatch)


def tiny_models(dtype: torch.dtype = torch.float32) -> dict[str, LoadedModel]:
    """Two tiny random-weight models of different sizes (vocabulary 256)."""
    return {
        "llama-tiny": load_dummy(llama_config(vocab_size=256).to_dict(), seed=1, dtype=dtype),
        "qwen-tiny": load_dummy(
            qwen2_config(vocab_size=256, hidden_size=128, intermediate_size=256).to_dict(),
            seed=2,
            dtype=dtype,
        ),
    }


def test_calibrate_measures_caches_hits_the_cache_and_fresh_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = tiny_models()
    heard: list[str] = []

    def run(mode: CalibrationMode) -> Any:
        return calibrate(
            mode, models, torch.float32, plan=TINY_PLAN, directory=tmp_path, on_status=heard.append
        )

    measured = run(CalibrationMode.AUTO)  # nothing cached: measures (the only real measuring)
    assert measured.origin == MEASURED_HERE and measured.measured_now and measured.seconds > 0
    assert Path(measured.path).parent == tmp_path and measured.key is not None
    assert measured.key.models == ("llama-tiny", "qwen-tiny") and measured.key.dtype == "float32"
    assert any("measuring the engine" in m for m in heard)
    assert any("measuring qwen-tiny" in m for m in heard)
    stored = json.loads(Path(measured.path).read_text())
    assert set(stored["engine"]["models"]) == {"llama-tiny", "qwen-tiny"}
    assert stored["engine"]["method"].startswith("talaria.calibration.calibrate:")
    # the step grid was measured on both models and its fit prices the profile's steps
    assert all(len(m["grid"]) == 10 for m in stored["engine"]["models"].values())
    fitted = stored["engine"]["fit"]
    prices = measured.profile.step_prices
    assert prices is not None and prices.to_json() == fitted["step_prices"]
    assert prices.small_rows == 0  # float32: no native small-batch product
    assert set(fitted["step_grid_held_out"]) == {"median_abs", "p90_abs", "max_abs"}
    assert measured.profile.source_of("step_prices")
    co_run = measured.profile.co_run_slowdown
    assert co_run is not None and co_run >= 1 and measured.profile.source_of("co_run_slowdown")
    assert measured.describe()["step_prices"] == fitted["step_prices"]

    def no_measuring(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a cache hit measures nothing")

    monkeypatch.setattr(calibrate_module, "measure_engine", no_measuring)
    monkeypatch.setattr(calibrate_module, "measure_rates", no_measuring)
    hit = run(CalibrationMode.AUTO)
    assert hit.origin == MEASURED_HERE and not hit.measured_now
    assert hit.profile == measured.profile and hit.key == measured.key
    shipped = run(CalibrationMode.SHIPPED)
    assert shipped.origin == SHIPPED and shipped.profile == profile("cpu")
    assert shipped.key is None
    with pytest.raises(AssertionError, match="measures nothing"):
        run(CalibrationMode.FRESH)  # fresh measures even with a cached calibration

    # fresh replaces the cached one (a stand-in measurement, to keep the test short)
    raw = {k: v for k, v in stored.items() if k not in ("engine", "key", "schema", "digest")}
    engine = {**stored["engine"], "fit": {**stored["engine"]["fit"], "prefill_flop_s": 3e9}}
    monkeypatch.setattr(calibrate_module, "measure_rates", lambda *_a: dict(raw))
    monkeypatch.setattr(calibrate_module, "measure_engine", lambda *_a: dict(engine))
    again = run(CalibrationMode.FRESH)
    assert again.measured_now and again.path == measured.path
    assert again.profile.peak_flops_bf16 == 3e9 != measured.profile.peak_flops_bf16
    cached = read_cached(again.key, tmp_path)  # type: ignore[arg-type]
    assert cached is not None and cached.profile == again.profile
    assert len(list(tmp_path.iterdir())) == 1


def test_a_calibration_measured_on_a_busy_machine_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = read_cpu_document()
    monkeypatch.setattr(calibrate_module, "measure_rates", lambda *_a: dict(doc))
    monkeypatch.setattr(calibrate_module, "measure_engine", lambda *_a: dict(doc["engine"]))
    monkeypatch.setattr(calibrate_module, "CpuWatch", BusyWatch)
    heard: list[str] = []

    def run() -> Any:
        return calibrate(
            CalibrationMode.AUTO,
            tiny_models(),
            torch.float32,
            plan=TINY_PLAN,
            directory=tmp_path,
            on_status=heard.append,
        )

    busy = run()
    assert busy.busy and busy.others_cpu_share == 0.6 and busy.describe()["busy"]
    assert any("the machine was busy" in m and "60%" in m for m in heard)
    monkeypatch.setattr(calibrate_module, "CpuWatch", QuietWatch)
    quiet = run()  # auto does not trust the busy one: it measures again
    assert quiet.measured_now and not quiet.busy
    assert any("measured on a busy machine" in m for m in heard)
    assert not run().measured_now  # and then the quiet one is a cache hit


def test_cpu_watch_reports_a_share_of_the_machine() -> None:
    share = CpuWatch().others_share()
    assert share is None or 0.0 <= share <= 1.0


def test_calibration_takes_models_and_sizes_never_results() -> None:
    """What a calibration can see: models, weights, dtype, sizes, where to cache, a status
    callback. No replay set, script, result or measurement of a run goes in."""
    assert set(inspect.signature(calibrate).parameters) == {
        "mode",
        "models",
        "dtype",
        "host_weights",
        "plan",
        "directory",
        "on_status",
    }


def test_the_key_of_this_machine_is_stable_and_follows_sizes_and_fields() -> None:
    key = calibration_key(CALIBRATION_MODELS, torch.bfloat16)
    assert calibration_key(CALIBRATION_MODELS, torch.bfloat16) == key
    machine = this_machine()
    assert key.machine == machine and machine.threads == torch.get_num_threads()
    assert machine.torch == torch.__version__ and machine.cores >= 1 and machine.ram_bytes > 0
    assert calibration_key(CALIBRATION_MODELS, torch.bfloat16, TINY_PLAN).code != key.code
    assert calibration_key(CALIBRATION_MODELS, torch.float32).digest() != key.digest()
    other = attrs.evolve(machine, threads=machine.threads + 1)
    assert calibration_key(CALIBRATION_MODELS, torch.bfloat16, machine=other) != key
    # the disk file's directory is not a size: it does not change the key
    elsewhere = attrs.evolve(
        CalibrationPlan(), rates=attrs.evolve(CalibrationPlan().rates, directory="/x")
    )
    assert calibration_key(CALIBRATION_MODELS, torch.bfloat16, elsewhere) == key
    assert "engine/**/*.py" in STEP_TIME_SOURCES and "cost/cost_model.py" in STEP_TIME_SOURCES


def _store_default_calibration(directory: Path, others_cpu_share: float = 0.0) -> Any:
    """A calibration of this machine and code for the server's lookup (the shipped document
    with a fit of its own)."""
    doc = read_cpu_document()
    doc["engine"] = {**doc["engine"], "fit": {**doc["engine"]["fit"], "prefill_flop_s": 7.5e10}}
    doc["contention"] = {"others_cpu_share": others_cpu_share}
    return write_cached(calibration_key(CALIBRATION_MODELS, torch.bfloat16), doc, directory)


def test_the_server_lookup_uses_a_cached_calibration_and_never_measures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_measuring(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a server start measures nothing")

    monkeypatch.setattr(calibrate_module, "measure_engine", no_measuring)
    assert cached_profiles(torch.bfloat16, directory=tmp_path) == {}
    stored = _store_default_calibration(tmp_path)
    assert cached_profiles(torch.bfloat16, directory=tmp_path) == {"cpu": stored.profile}
    assert cached_profiles(torch.float32, directory=tmp_path) == {}  # another dtype's key
    assert cached_profiles(torch.bfloat16, "cuda", directory=tmp_path) == {}
    _store_default_calibration(tmp_path, others_cpu_share=0.5)  # a busy one is not used
    assert cached_profiles(torch.bfloat16, directory=tmp_path) == {}


def test_build_embedded_cluster_prices_with_the_cached_calibration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import talaria.backends.embedded as embedded

    models = tiny_models(torch.bfloat16)
    monkeypatch.setattr(embedded, "load_catalog_model", lambda name, _dtype: models[name])
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    spec = InstanceSpec("cpu-0", "cpu", 8 * MB, 8 * MB)

    def hw() -> Any:
        cluster = build_embedded_cluster([spec], ["llama-tiny"], POLICIES["talaria"])
        return cluster.core.instances["cpu-0"].estimator.cost.hw  # type: ignore[attr-defined]

    assert hw() == profile("cpu")
    stored = _store_default_calibration(tmp_path)
    assert hw() == stored.profile and stored.profile != profile("cpu")
