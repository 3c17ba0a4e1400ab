"""The step grid of the embedded engine on this machine: how well the additive step model
fits it, on points the fit never saw, and how much two calibrations agree.

Each run measures the library's step grid (:mod:`talaria.calibration.grid`: decode over
batch x context, prefill over chunk x cached prefix, bare forwards) on every model, one model
loaded at a time, and fits the additive model's prices to it
(:mod:`talaria.calibration.linear`). The report gives, per run, the prices and the fit's
error on its own points and under 5-fold cross-validation (every point predicted by a fit
that never saw it), overall and per step kind; and across runs, each price's relative
difference and the largest difference of the two fits' predictions over the grid (the
agreement the calibration's noise allows). Writes
``--out`` (JSON). About 2.5 minutes per run on 2 cores; ``--quick`` is a tiny grid on tiny
models (the test).

    python benchmarks/step_grid.py --runs 2 --out benchmarks/results/step_grid.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.table import Table

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from talaria.backends.embedded import load_catalog_model
from talaria.calibration.engine import small_rows
from talaria.calibration.grid import StepGrid, StepPoint, measure_grid
from talaria.calibration.linear import cross_validate, fit_steps, predict, residuals
from talaria.calibration.plan import this_machine
from talaria.config import ModelSpec
from talaria.cost.step_prices import TERMS, StepPrices
from talaria.engine.catalog import DEFAULT_MODELS
from talaria.engine.runner import flatten_weights

QUICK_MODELS = ("smollm2-tiny-dummy", "qwen2-tiny-dummy")
QUICK_GRID = StepGrid(
    decode_batches=(1, 2, 4), decode_contexts=(16, 64), chunks=(4, 32), prefixes=(0, 32), reps=1
)


def measure(
    names: Sequence[str], grid: StepGrid, dtype: torch.dtype, console: Console
) -> tuple[list[StepPoint], dict[str, ModelSpec]]:
    """The grid on every model, one model loaded at a time."""
    points: list[StepPoint] = []
    specs: dict[str, ModelSpec] = {}
    for name in names:
        console.log(f"measuring {name}")
        model = load_catalog_model(name, dtype)
        specs[name] = model.arch.to_spec(name, dtype, source=model.source)
        flat = flatten_weights(name, model.arch, model.tensors, dtype)
        points += measure_grid(name, model.arch, flat, dtype, grid)
        del model, flat
        gc.collect()
    return points, specs


def by_kind(points: Sequence[StepPoint], errors: Sequence[float]) -> dict[str, dict[str, float]]:
    """Median and largest absolute relative error of the decode and the prefill points."""
    out = {}
    for kind, decode in (("decode", True), ("prefill", False)):
        errs = [abs(e) for p, e in zip(points, errors, strict=True) if p.is_decode is decode]
        out[kind] = {"median_abs": statistics.median(errs), "max_abs": max(errs)}
    return out


def one_run(
    points: Sequence[StepPoint], specs: Mapping[str, ModelSpec], small: int
) -> dict[str, Any]:
    prices = fit_steps(points, specs, small)
    held = cross_validate(points, specs, small)
    return {
        "points": [p.to_json() for p in points],
        "prices": prices.to_json(),
        "in_sample": residuals(prices, points, specs).summary(),
        "held_out": held.summary(),
        "held_out_by_kind": by_kind(points, held.errors),
    }


def agreement(runs: Sequence[Mapping[str, Any]], specs: Mapping[str, ModelSpec]) -> dict[str, Any]:
    """Each price's relative difference between the first two runs, and the largest relative
    difference of their predictions over the first run's points."""
    a, b = (StepPrices.from_json(r["prices"]) for r in runs[:2])
    per_price = {t: (b.price(t) - a.price(t)) / a.price(t) if a.price(t) else None for t in TERMS}
    points = [StepPoint.from_json(p) for p in runs[0]["points"]]
    diffs = [abs(predict(b, specs[p.model], p) / predict(a, specs[p.model], p) - 1) for p in points]
    return {
        "price_relative_difference": per_price,
        "prediction_difference_median": statistics.median(diffs),
        "prediction_difference_max": max(diffs),
    }


def render(doc: Mapping[str, Any], console: Console) -> None:
    table = Table(title="step grid: the additive model's error (relative, absolute)")
    for col in (
        "run",
        "in-sample median",
        "held-out median",
        "held-out p90",
        "held-out max",
        "decode held-out median",
        "prefill held-out median",
    ):
        table.add_column(col, justify="right")
    for i, r in enumerate(doc["runs"]):
        k = r["held_out_by_kind"]
        table.add_row(
            str(i + 1),
            f"{r['in_sample']['median_abs']:.1%}",
            f"{r['held_out']['median_abs']:.1%}",
            f"{r['held_out']['p90_abs']:.1%}",
            f"{r['held_out']['max_abs']:.1%}",
            f"{k['decode']['median_abs']:.1%}",
            f"{k['prefill']['median_abs']:.1%}",
        )
    console.print(table)
    if "agreement" in doc:
        ag = doc["agreement"]
        parts = ", ".join(
            f"{t} {v:+.1%}" for t, v in ag["price_relative_difference"].items() if v is not None
        )
        console.print(f"run 2 against run 1: prices {parts}")
        console.print(
            f"predictions differ by {ag['prediction_difference_median']:.1%} (median), "
            f"{ag['prediction_difference_max']:.1%} (largest) over the grid"
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=2, help="grids measured one after the other")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="catalog models")
    p.add_argument("--quick", action="store_true", help="tiny models and a tiny grid")
    p.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    console = Console(stderr=True)
    dtype = torch.float32 if args.quick else torch.bfloat16
    names = QUICK_MODELS if args.quick else tuple(args.models.split(","))
    grid = QUICK_GRID if args.quick else StepGrid()
    small = small_rows(dtype)
    runs, specs = [], {}
    for i in range(args.runs):
        console.log(f"run {i + 1} of {args.runs}: {grid.describe()}")
        points, specs = measure(names, grid, dtype, console)
        runs.append(one_run(points, specs, small))
    doc: dict[str, Any] = {
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": attrs.asdict(this_machine()),
        "command": "python benchmarks/step_grid.py " + " ".join(argv or sys.argv[1:]),
        "grid": grid.describe(),
        "dtype": str(dtype),
        "small_rows": small,
        "runs": runs,
    }
    if len(runs) > 1:
        doc["agreement"] = agreement(runs, specs)
    render(doc, Console())
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        console.log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
