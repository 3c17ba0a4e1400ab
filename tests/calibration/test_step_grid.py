"""The step grid and its fit: exact recovery of known prices, held-out residuals, the
measured grid on a tiny model, and the calibration's prices in the cpu profile."""

from __future__ import annotations

import attrs
import pytest
import torch

from talaria.calibration.grid import (
    BareForward,
    StepGrid,
    StepPoint,
    measure_co_run,
    measure_grid,
)
from talaria.calibration.linear import (
    cross_validate,
    fit_shapes,
    fit_steps,
    point_shape,
    residuals,
)
from talaria.config import ModelSpec
from talaria.cost.step_prices import TERMS, StepPrices
from talaria.engine.loader import load_dummy
from talaria.engine.runner import flatten_weights
from talaria.errors import ConfigError
from tests.helpers import llama_config
from tests.sim.test_cost_model import DENSE

TRUE = StepPrices((0.02, 5e-4, 3e-3, 4e-11, 5e-11, 1e-10, 6e-13, 3e-12, 3e-10), small_rows=2)
GRID = StepGrid(
    decode_batches=(1, 2, 4, 8), decode_contexts=(64, 512), chunks=(8, 64), prefixes=(0, 256)
)
BIG = attrs.evolve(DENSE, name="big", total_params=2_000_000, active_params=2_000_000, n_layers=4)


def specs() -> dict[str, ModelSpec]:
    return {DENSE.name: DENSE, BIG.name: BIG}


def synthetic(prices: StepPrices) -> list[StepPoint]:
    """Every shape of GRID for DENSE and a model twice its size, timed by ``prices``."""
    out = []
    for spec in (DENSE, BIG):
        for b, c, n, p, k in GRID.shapes():
            shape = StepPoint(spec.name, b, c, n, p, 1.0, prefilling=max(k, 1))
            seconds = prices.step_s(spec, point_shape(shape))
            out.append(attrs.evolve(shape, seconds=seconds))
    return out


def test_the_fit_recovers_known_prices_and_predicts_held_out_points_exactly() -> None:
    points = synthetic(TRUE)
    fitted = fit_steps(points, specs(), 2)
    assert fitted.small_rows == 2
    for term in TERMS:
        assert fitted.price(term) == pytest.approx(TRUE.price(term), rel=1e-6)
    assert residuals(fitted, points, specs()).max_abs < 1e-9
    assert cross_validate(points, specs(), 2).max_abs < 1e-6


def test_a_term_the_data_does_not_need_is_priced_zero_not_negative() -> None:
    free_kv = StepPrices((*TRUE.prices[:5], 0.0, *TRUE.prices[6:]), small_rows=2)
    fitted = fit_steps(synthetic(free_kv), specs(), 2)
    assert all(v >= 0 for v in fitted.prices)
    assert fitted.price("decode_kv_s_per_B") == pytest.approx(0.0, abs=1e-15)


def test_a_count_no_step_has_is_priced_zero() -> None:
    # no small-batch product (small_rows 0): its weight count is 0 in every step, its price 0
    steps = [
        (spec, point_shape(p), TRUE.step_s(spec, point_shape(p)) * 1.1)
        for spec in (DENSE, BIG)
        for p in synthetic(TRUE)
        if p.model == spec.name
    ]
    prices = fit_shapes(steps, 0)
    assert prices.price("small_weight_s_per_B") == 0.0
    assert all(v >= 0 for v in prices.prices)


def test_residuals_report_a_known_error() -> None:
    points = synthetic(TRUE)
    slower = [attrs.evolve(p, seconds=p.seconds * 1.25) for p in points]
    r = residuals(TRUE, slower, specs())
    assert r.median_abs == pytest.approx(0.2) and r.max_abs == pytest.approx(0.2)


def test_bad_fits_are_refused() -> None:
    points = synthetic(TRUE)
    with pytest.raises(ConfigError, match="at least"):
        fit_steps(points[:3], specs(), 2)
    with pytest.raises(ConfigError, match="ModelSpec"):
        fit_steps(points, {DENSE.name: DENSE}, 2)
    with pytest.raises(ConfigError, match="folds"):
        cross_validate(points, specs(), 2, folds=1)
    with pytest.raises(ConfigError):
        StepGrid(decode_batches=())
    with pytest.raises(ConfigError):
        StepGrid(prefixes=(-1,))
    with pytest.raises(ConfigError):
        StepGrid(reps=0)
    with pytest.raises(ConfigError, match="multi"):
        StepGrid(multi=(1,))
    assert not [s for s in StepGrid(multi=()).shapes() if s[4] > 1]


def test_the_grid_is_measured_on_a_tiny_model() -> None:
    model = load_dummy(llama_config(vocab_size=256).to_dict(), seed=1, dtype=torch.float32)
    flat = flatten_weights("tiny", model.arch, model.tensors, torch.float32)
    grid = StepGrid(
        decode_batches=(1, 3), decode_contexts=(16, 40), chunks=(4, 20), prefixes=(0, 24), reps=1
    )
    points = measure_grid("tiny", model.arch, flat, torch.float32, grid)
    shapes = [(p.batch, p.context, p.chunk, p.prefix, p.prefilling) for p in points]
    assert shapes == [(b, c, n, p, max(k, 1)) for b, c, n, p, k in grid.shapes()]
    assert all(p.model == "tiny" and p.seconds > 0 for p in points)
    # 4 decode, 4 one-chunk prefill, 2 of 4 sequences prefilling 20 tokens each at once
    assert [p.is_decode for p in points] == [True] * 4 + [False] * 6
    assert [p.prefilling for p in points[-2:]] == [4, 4]
    assert StepPoint.from_json(points[0].to_json()) == points[0]


def test_a_step_beside_a_second_engine_is_timed_alone_and_beside_it() -> None:
    model = load_dummy(llama_config(vocab_size=256).to_dict(), seed=1, dtype=torch.float32)
    flat = flatten_weights("tiny", model.arch, model.tensors, torch.float32)
    grid = StepGrid(decode_batches=(1, 3), decode_contexts=(16, 40), chunks=(4, 20), reps=1)
    out = measure_co_run(model.arch, flat, torch.float32, grid)
    assert set(out) == {"co_run_s_alone", "co_run_s_beside"}
    assert out["co_run_s_alone"] > 0 and out["co_run_s_beside"] > 0


def test_each_timed_prefill_runs_a_length_the_process_has_not_run() -> None:
    model = load_dummy(llama_config(vocab_size=256).to_dict(), seed=1, dtype=torch.float32)
    flat = flatten_weights("tiny", model.arch, model.tensors, torch.float32)
    grid = StepGrid(decode_batches=(1,), decode_contexts=(16,), chunks=(4, 20), reps=3)
    fwd = BareForward(model.arch, flat, torch.float32, grid.kv_blocks)
    seen: list[tuple[tuple[int, int], ...]] = []
    forward = fwd.model.forward
    fwd.model.forward = lambda batch, kv: (  # type: ignore[method-assign]
        seen.append(tuple((len(s.token_ids), s.start) for s in batch.seqs)),
        forward(batch, kv),
    )
    step = fwd.fresh_prefill(20, 16, 4, calls=grid.reps + 1)
    for _ in range(grid.reps + 1):
        step()
    # the warm-up at 20 + 4 tokens per sequence, then 21, 19, 22: never one length twice
    assert seen == [((n, 16),) * 4 for n in (24, 21, 19, 22)]
    seen.clear()
    one = fwd.fresh_prefill(1, 0, 1, calls=3)
    for _ in range(3):
        one()
    assert seen == [((5, 0),), ((2, 0),), ((1, 0),)]  # 1 - 1 tokens floors at 1
