"""Fit the additive step model's prices to a step grid, and check them on held-out points.

The model is :mod:`talaria.cost.step_prices`: a step's seconds are counts the step knows
(weight bytes, KV bytes, FLOPs, sequences) times measured prices. :func:`fit_steps` finds
the prices by non-negative least squares on relative error (a 20 ms step and a 2 s step
count alike) over :class:`~talaria.calibration.grid.StepPoint` rows of several models:
one set of prices for every model, so the prices are rates of the machine and the engine,
not constants of one model. :func:`cross_validate` holds out every k-th point in turn and
reports the error on the points each fit never saw.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from talaria.calibration.grid import StepPoint
from talaria.config import ModelSpec
from talaria.cost.step_prices import TERMS, StepPrices, step_counts
from talaria.cost.step_shape import StepShape
from talaria.errors import ConfigError


def point_shape(p: StepPoint) -> StepShape:
    """The step a grid point timed."""
    if p.is_decode:
        return StepShape(0, 0.0, p.batch, p.batch * p.context, 0, 0.0)
    k = p.prefilling
    attended = k * (p.chunk * p.prefix + p.chunk * (p.chunk + 1) / 2)
    return StepShape(k * p.chunk, attended, 0, 0, k, float(k * p.prefix))


def predict(prices: StepPrices, spec: ModelSpec, p: StepPoint) -> float:
    """The seconds ``prices`` give point ``p`` of model ``spec``."""
    return prices.step_s(spec, point_shape(p))


def _design(
    points: Sequence[StepPoint], specs: Mapping[str, ModelSpec]
) -> list[tuple[ModelSpec, StepShape, float]]:
    missing = {p.model for p in points} - set(specs)
    if missing:
        raise ConfigError(f"no ModelSpec for {sorted(missing)}")
    return [(specs[p.model], point_shape(p), p.seconds) for p in points]


def fit_steps(
    points: Sequence[StepPoint], specs: Mapping[str, ModelSpec], small_rows: int
) -> StepPrices:
    """:func:`fit_shapes` over grid points (``specs`` names each point's model)."""
    return fit_shapes(_design(points, specs), small_rows)


def fit_shapes(steps: Sequence[tuple[ModelSpec, StepShape, float]], small_rows: int) -> StepPrices:
    """Non-negative least squares of relative error over measured steps (each a model, the
    step's shape and its seconds): every subset of the prices is solved unconstrained and the
    best one whose prices are all >= 0 wins (exact, and cheap for nine prices); the overhead
    is always in. ``small_rows``: the rows the engine multiplies with its small-batch
    product (0 if it has none)."""
    if len(steps) < len(TERMS):
        raise ConfigError(f"a step fit needs at least {len(TERMS)} steps, got {len(steps)}")
    if any(not seconds > 0 for _, _, seconds in steps):
        raise ConfigError("every measured step needs a positive time")
    a = np.array([step_counts(spec, shape, small_rows) for spec, shape, _ in steps])
    t = np.array([seconds for _, _, seconds in steps])
    aw, tw = a / t[:, None], np.ones_like(t)  # relative residuals
    scale = np.maximum(np.abs(aw).max(axis=0), 1e-300)  # every column to ~1
    best: tuple[float, np.ndarray] | None = None
    counted = [j for j in range(1, len(TERMS)) if np.any(aw[:, j])]  # a zero column stays 0
    for k in range(len(counted) + 1):
        for subset in itertools.combinations(counted, k):
            cols = [0, *subset]
            x, *_ = np.linalg.lstsq(aw[:, cols] / scale[cols], tw, rcond=None)
            if np.any(x < 0):
                continue
            sse = float(np.sum((aw[:, cols] / scale[cols] @ x - tw) ** 2))
            if best is None or sse < best[0]:
                full = np.zeros(len(TERMS))
                full[cols] = x / scale[cols]
                best = (sse, full)
    if best is None:
        raise ConfigError("no non-negative fit of the measured steps")
    return StepPrices(tuple(float(v) for v in best[1]), small_rows)


@attrs.frozen
class Residuals:
    """Relative errors (predicted - measured) / measured, one per point, and summaries."""

    errors: tuple[float, ...]

    @property
    def median_abs(self) -> float:
        return float(statistics.median(abs(e) for e in self.errors))

    @property
    def p90_abs(self) -> float:
        return float(np.quantile([abs(e) for e in self.errors], 0.9))

    @property
    def max_abs(self) -> float:
        return max(abs(e) for e in self.errors)

    def summary(self) -> dict[str, float]:
        return {"median_abs": self.median_abs, "p90_abs": self.p90_abs, "max_abs": self.max_abs}


def residuals(
    prices: StepPrices, points: Sequence[StepPoint], specs: Mapping[str, ModelSpec]
) -> Residuals:
    """Each point's relative error under ``prices``, in the order of ``points``."""
    return Residuals(
        tuple((predict(prices, specs[p.model], p) - p.seconds) / p.seconds for p in points)
    )


def cross_validate(
    points: Sequence[StepPoint], specs: Mapping[str, ModelSpec], small_rows: int, folds: int = 5
) -> Residuals:
    """Each point's relative error under the fit of the other folds (point ``i`` is in
    fold ``i % folds``), in the order of ``points``."""
    if folds < 2:
        raise ConfigError("cross_validate needs at least 2 folds")
    errors = [0.0] * len(points)
    for f in range(folds):
        train = [p for i, p in enumerate(points) if i % folds != f]
        prices = fit_steps(train, specs, small_rows)
        for i, p in enumerate(points):
            if i % folds == f:
                errors[i] = (predict(prices, specs[p.model], p) - p.seconds) / p.seconds
    return Residuals(tuple(errors))
