"""Calibrate where you run: the ``cpu`` profile of this machine, measured once and cached.

:func:`calibrate` returns the :class:`~talaria.calibration.cache.Calibration` that prices a
prediction of the embedded engine on this machine:

- ``auto``: this machine's cached calibration when its key
  (:func:`~talaria.calibration.plan.calibration_key`: machine and code) matches
  and it was not measured on a busy machine (other processes over
  :data:`~talaria.calibration.cache.BUSY_SHARE` of the CPUs,
  :class:`~talaria.calibration.machine.CpuWatch`); otherwise
  it measures one and caches it;
- ``fresh``: measure again now and replace the cached one;
- ``shipped``: the shipped profile (measured on another machine), nothing measured.

Measuring runs the raw machine rates (:mod:`talaria.calibration.machine`, seconds) and
the engine microbenchmarks (:mod:`talaria.calibration.engine`) on models the caller
has already loaded, sharing their flat host weights, so a replay pays for the measurements
only, not for loading again. Its inputs are the models and the plan: a calibration never
sees a replay's (or anyone's) results. The server side, which only reads the cache, is
:func:`~talaria.calibration.plan.cached_profiles`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Final

import torch

from talaria.calibration.cache import (
    Calibration,
    CalibrationMode,
    read_cached,
    shipped_calibration,
    write_cached,
)
from talaria.calibration.engine import measure_engine
from talaria.calibration.machine import CpuWatch, measure_rates
from talaria.calibration.plan import CalibrationPlan, calibration_key
from talaria.engine.loader import LoadedModel
from talaria.engine.threads import in_own_thread

MEASURED_BY: Final = "talaria.calibration.calibrate"


def calibrate(
    mode: CalibrationMode,
    models: Mapping[str, LoadedModel],
    dtype: torch.dtype,
    host_weights: Mapping[str, torch.Tensor] | None = None,
    plan: CalibrationPlan | None = None,
    directory: Path | None = None,
    on_status: Callable[[str], None] | None = None,
) -> Calibration:
    """The calibration ``mode`` asks for, for ``models`` (their descriptions; with
    ``host_weights``, flat host weights by name, they may carry no tensors) in ``dtype``,
    measured under ``plan`` (default sizes) and cached in ``directory`` (default
    :func:`~talaria.calibration.cache.cache_dir`). ``on_status`` hears what it is doing
    (cache hit, measuring which model, how long it took). Writes only the cache file."""
    say = on_status or (lambda _msg: None)
    if mode is CalibrationMode.SHIPPED:
        shipped = shipped_calibration()
        say(f"calibration: the shipped cpu profile (measured {shipped.measured_at} elsewhere)")
        return shipped
    plan = CalibrationPlan() if plan is None else plan
    key = calibration_key(tuple(models), dtype, plan)
    why = "--calibration fresh"
    if mode is CalibrationMode.AUTO:
        cached = read_cached(key, directory)
        if cached is not None and not cached.busy:
            say(f"calibration: measured here {cached.measured_at}, cached (key {key.digest()})")
            return cached
        why = (
            "none cached for this machine and code"
            if cached is None
            else f"the cached one was measured on a busy machine ({_share(cached)})"
        )
    say(
        f"calibration: {why} (key {key.digest()}); measuring the engine on this machine "
        f"first ({len(models)} models; about 6 minutes on 2 cores for the default three), "
        "cached for later runs"
    )
    started, watch = time.perf_counter(), CpuWatch()
    doc = in_own_thread(lambda: measure_rates(plan.rates, MEASURED_BY))

    def source() -> Iterator[tuple[str, LoadedModel, torch.Tensor | None]]:
        for name, model in models.items():
            yield name, model, None if host_weights is None else host_weights[name]

    def heard(name: str) -> None:
        say(f"calibration: measuring {name} ({time.perf_counter() - started:.0f} s so far)")

    doc["engine"] = measure_engine(source, plan.engine, dtype, MEASURED_BY, heard)
    doc["contention"] = {"others_cpu_share": watch.others_share()}
    seconds = time.perf_counter() - started
    done = write_cached(key, doc, directory, seconds)
    say(f"calibration: measured here in {seconds:.0f} s, cached at {done.path}")
    if done.busy:
        say(
            f"calibration: the machine was busy ({_share(done)}): its rates may be "
            "slower than the engine runs when it is quiet; the next auto run measures again"
        )
    return done


def _share(calibration: Calibration) -> str:
    share = calibration.others_cpu_share or 0.0
    return f"other processes took {100 * share:.0f}% of the CPUs while it was measured"
