"""The cost model: one place that prices a schedule, for the router's estimates (live and
simulated alike) and the simulator's clock.

* ``hardware.py``: hardware profiles with the source of every number, loaded on first use.
* ``calibration.py``: ``cpu`` profiles measured where Talaria runs, cached by machine and
  code, and which profile priced a prediction (``Calibration``).
* ``cost_model.py``: the roofline ``CostModel`` (engine steps, weight and KV copies).
* ``estimator.py``: the ``Estimator`` protocol an instance core reasons with, and
  ``CostModelEstimator``, its cost-model implementation.

Imports nothing above it (no runtime, no simulator, no torch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from talaria.config import ClusterConfig, InstanceSpec, ModelSpec
from talaria.cost.cost_model import CostModel
from talaria.cost.estimator import CostModelEstimator, Estimator
from talaria.cost.hardware import HardwareProfile, profile, profiles

__all__ = [
    "CostModel",
    "CostModelEstimator",
    "Estimator",
    "HardwareProfile",
    "cluster_estimators",
    "estimator_for",
    "profile",
    "profiles",
]


def estimator_for(
    spec: InstanceSpec,
    models: Sequence[ModelSpec],
    hardware: Mapping[str, HardwareProfile] | None = None,
) -> CostModelEstimator:
    """The cost-model estimator of one instance: its hardware profile, its tensor-parallel
    degree, the models it serves. ``hardware`` maps profile names to profiles that replace
    the shipped ones (a calibration of this machine, ``talaria.calibration.cache``); a name
    it lacks is the shipped profile."""
    chosen = (hardware or {}).get(spec.hardware) or profile(spec.hardware)
    return CostModelEstimator(CostModel(chosen, spec.n_devices), models)


def cluster_estimators(
    cluster: ClusterConfig, hardware: Mapping[str, HardwareProfile] | None = None
) -> dict[str, Estimator]:
    """``estimator_for`` every instance of ``cluster``, by instance name (``hardware``: the
    profiles that replace shipped ones, as in ``estimator_for``)."""
    return {i.name: estimator_for(i, cluster.models_on(i), hardware) for i in cluster.instances}
