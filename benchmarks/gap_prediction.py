"""Tool-gap prediction error of ``talaria.session`` on the real agent traces.

Replays every session of the traces (``talaria-trace/1`` files; by default the bundled
``swebench_replay/data``) in order: for each call with a measured ``tool_seconds``, the
predictor predicts the tool time from the call's tool kind *before* seeing it, then learns
it (calls without a measurement are skipped). Learning predictors run in two modes:
``shared`` (one predictor for all sessions, in file order, as a long-running client would
keep it) and ``session`` (a fresh predictor per session, starting from the priors).

Predictors:

- ``const``: the global median tool time of the priors, for every call.
- ``prior``: the per-kind prior median, no learning.
- ``ewma``: plain EWMA of seconds (alpha 0.2, no clipping).
- ``log_ewma``: EWMA of log seconds (alpha 0.2, no clipping).
- ``robust``: the shipped default (``GapModelConfig()``: log space, clipped to x2, alpha 0.2).

Reports mean and median absolute error in seconds (``mae_s_*``, ``medae_s_*``), and an
alpha x clip grid of the robust predictor (shared mode) that justifies the defaults.

Caveat: the priors (``tool_time_by_kind.json``) were computed from these same steps, so
``const`` and ``prior`` are in-sample baselines (hard to beat); learning predictors see each
duration only after predicting it.

    python benchmarks/gap_prediction.py [--traces DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from talaria.errors import TraceError
from talaria.session import GapModelConfig, GapPredictor, ToolKind, ToolPriors, load_tool_priors
from talaria.swebench_replay.split import Part, select_part
from talaria.swebench_replay.traces import TraceSession, load_trace

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = ROOT / "swebench_replay" / "data"
ALPHAS = (0.05, 0.1, 0.2, 0.3, 0.5)
CLIPS: tuple[float | None, ...] = (1.5, 2.0, 3.0, 4.0, None)

LEARNERS: tuple[tuple[str, GapModelConfig], ...] = (
    ("ewma", GapModelConfig.plain_ewma(0.2)),
    ("log_ewma", GapModelConfig(alpha=0.2, space="log", clip_ratio=None)),
    ("robust", GapModelConfig()),
)


def measured_calls(sessions: Sequence[TraceSession]) -> int:
    return sum(c.tool_seconds is not None for s in sessions for c in s.calls)


def errors_constant(
    sessions: Sequence[TraceSession], predict: Callable[[str], float]
) -> list[float]:
    """Absolute errors (seconds) of a predictor that never learns: ``predict(kind)``."""
    return [
        abs(predict(c.tool_kind.value) - c.tool_seconds)
        for s in sessions
        for c in s.calls
        if c.tool_seconds is not None
    ]


def errors_learning(
    sessions: Sequence[TraceSession], priors: ToolPriors, config: GapModelConfig, shared: bool
) -> list[float]:
    """Absolute errors (seconds) of a :class:`GapPredictor` that predicts each call's tool
    time, then observes it; one predictor for all sessions (``shared``) or one per session."""
    errors: list[float] = []
    predictor = GapPredictor(priors, config)
    for session in sessions:
        if not shared:
            predictor = GapPredictor(priors, config)
        for call in session.calls:
            if call.tool_seconds is None:
                continue
            key = call.tool_kind.value
            errors.append(abs(predictor.predict(key) - call.tool_seconds))
            predictor.observe(key, call.tool_seconds)
    return errors


def summary(errors: Sequence[float]) -> tuple[float, float]:
    """(mean, median) absolute error in seconds."""
    return statistics.fmean(errors), statistics.median(errors)


def measure(sessions: Sequence[TraceSession], priors: ToolPriors) -> dict[str, Any]:
    """Every figure of the benchmark (see the module docstring)."""
    result: dict[str, Any] = {
        "sessions": len(sessions),
        "calls": sum(len(s.calls) for s in sessions),
        "calls_measured": measured_calls(sessions),
        "priors_source": priors.source,
        "global_median_s": priors.overall.p50_s,
        "robust_config": attrs.asdict(GapModelConfig()),
    }
    rows: list[tuple[str, list[float]]] = [
        ("const", errors_constant(sessions, lambda _k: priors.overall.p50_s)),
        ("prior", errors_constant(sessions, lambda k: priors.median_s(ToolKind(k)))),
    ]
    for name, config in LEARNERS:
        for mode in ("shared", "session"):
            errs = errors_learning(sessions, priors, config, shared=mode == "shared")
            rows.append((f"{name}_{mode}", errs))
    for name, errs in rows:
        mae, medae = summary(errs)
        result[f"mae_s_{name}"] = mae
        result[f"medae_s_{name}"] = medae
    result["grid_mae_s_shared"] = [
        {
            "alpha": alpha,
            "clip_ratio": clip,
            "mae_s": summary(
                errors_learning(
                    sessions, priors, GapModelConfig(alpha=alpha, clip_ratio=clip), True
                )
            )[0],
        }
        for alpha in ALPHAS
        for clip in CLIPS
    ]
    return result


def table(result: dict[str, Any]) -> Table:
    names = [k.removeprefix("mae_s_") for k in result if k.startswith("mae_s_")]
    base = result["mae_s_const"]
    t = Table(
        title=f"Tool-gap prediction, {result['calls_measured']} measured tool times, "
        f"{result['sessions']} sessions"
    )
    for col in ("predictor", "MAE s", "median AE s", "MAE vs const"):
        t.add_column(col, justify="left" if col == "predictor" else "right")
    for name in names:
        mae = result[f"mae_s_{name}"]
        t.add_row(
            name, f"{mae:.4f}", f"{result[f'medae_s_{name}']:.4f}", f"{(mae / base - 1):+.1%}"
        )
    return t


def grid_table(result: dict[str, Any]) -> Table:
    t = Table(title="robust predictor (log space), shared: MAE s by alpha x clip_ratio")
    t.add_column("alpha", justify="right")
    for clip in CLIPS:
        t.add_column(f"clip {clip}" if clip is not None else "no clip", justify="right")
    for alpha in ALPHAS:
        cells = [g for g in result["grid_mae_s_shared"] if g["alpha"] == alpha]
        t.add_row(f"{alpha:g}", *(f"{g['mae_s']:.4f}" for g in cells))
    return t


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--traces",
        type=Path,
        default=DEFAULT_TRACES,
        help="trace directory or file (talaria-trace/1 *.jsonl; default: %(default)s)",
    )
    p.add_argument(
        "--part",
        choices=["tune", "test", "all"],
        default="tune",
        help="which part of the sessions (talaria.swebench_replay.split; default tune: the "
        "predictor's alpha and clip are chosen on it, never on the test part)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    if not args.traces.exists():
        print(
            f"error: no traces at {args.traces}; pass --traces DIR, a directory of "
            "talaria-trace/1 *.jsonl files (see swebench_replay/data/README.md)",
            file=sys.stderr,
        )
        return 2
    try:
        sessions = select_part(load_trace(args.traces), Part(args.part))
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {
        "traces": args.traces.name,
        "part": args.part,
        **measure(sessions, load_tool_priors()),
    }
    console = Console()
    console.print(table(result))
    console.print(grid_table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
