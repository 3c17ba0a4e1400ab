"""Sensitivity sweep: speedup over ``round`` as the session count and tool-gap scale vary."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from rich.progress import Progress

from talaria.policy.baselines import policy
from talaria.swebench_replay.driver import ReplayOptions, run_replay
from talaria.swebench_replay.setup import load_workload


def _point(
    args: argparse.Namespace,
    names: Sequence[str],
    sessions: int,
    gap_scale: float,
    progress: Progress,
) -> dict[str, Any]:
    workload = load_workload(
        trace=args.trace,
        synthetic=args.synthetic,
        n_sessions=sessions,
        target_calls=sessions * args.calls_per_session,
        seed=args.seed,
        arrival=args.arrival,
    )
    options = ReplayOptions(
        tuple(policy(n) for n in names),
        hardware=args.hardware,
        n_instances=args.instances,
        gap_scale=gap_scale,
        references=False,  # the sweep compares speedups over round; no yardsticks
        no_hints_run=False,
    )
    task = progress.add_task(
        f"{sessions} sessions, gap x{gap_scale:g}", total=workload.replay.n_calls * len(names)
    )
    done: dict[str, int] = {}

    def tick(name: str, n: int) -> None:
        done[name] = n
        progress.update(task, completed=sum(done.values()))

    results = run_replay(workload.replay, options, workload.tool_table, tick)
    return {
        "sessions": sessions,
        "gap_scale": gap_scale,
        "calls": workload.replay.n_calls,
        "policies": {
            n: {k: v for k, v in p.items() if k != "session_sct_s"}
            for n, p in results["policies"].items()
        },
    }


def run_sweep(
    args: argparse.Namespace,
    names: Sequence[str],
    session_counts: Sequence[int],
    gap_scales: Sequence[float],
    progress: Progress,
) -> list[dict[str, Any]]:
    """Rows for each session count (gap scale 1) and each gap scale (30 sessions)."""
    rows = []
    for n in session_counts:
        rows.append({"axis": "sessions", **_point(args, names, n, 1.0, progress)})
    for g in gap_scales:
        rows.append({"axis": "gap_scale", **_point(args, names, 30, g, progress)})
    return rows
