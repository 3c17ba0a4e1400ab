"""``talaria tune`` and the simulated ``talaria replay``: the tuning protocol, then an honest
comparison over seeds (:mod:`talaria.swebench_replay.tuning`, :mod:`.compare`).

Both take the workload options of ``replay`` plus:

* ``--seeds N``: seeds 0..N-1 (tune: 3 by default; replay: 5, the headline setting);
* ``--jobs N``: worker processes (default: every CPU this process may use);
* ``replay --tuned FILE``: use a tuning ``talaria tune`` wrote instead of the cached one;
  ``--retune``: tune again even if a tuning is cached.

The tuning always reads the tune part of ``--tune-trace`` (default: the bundled traces); the
comparison replays the test part of the bundled traces, or all of ``--trace`` when given
(traces a user brings are held out: never tuned on), or ``--part``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from talaria.config import PolicyConfig
from talaria.errors import ConfigError
from talaria.policy.baselines import parse_policies

TUNE_SEEDS_DEFAULT = 3
TEST_SEEDS_DEFAULT = 5


def add_protocol_args(p: argparse.ArgumentParser, seeds: int) -> None:
    """The options both commands take (see the module docstring)."""
    from talaria.swebench_replay.runs import default_jobs

    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help=f"how many seeds to run (default {seeds}; replay: from --seed on, tune: from 0; "
        "a seed draws another sample of sessions, model assignment and tool-time fills)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        help=f"simulations run side by side in worker processes (default {default_jobs()}, "
        "the CPUs here)",
    )
    p.add_argument(
        "--tune-trace",
        type=Path,
        default=None,
        help="traces whose tune part the knobs are chosen on (default: the bundled traces)",
    )
    p.add_argument(
        "--kv-fraction",
        type=float,
        default=None,
        help="simulated memory pressure: each instance's device KV pool as this fraction of "
        "the KV the workload's sessions would hold at their longest (default: what the "
        "hardware leaves after the weights)",
    )


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _setting(args: argparse.Namespace, tune_spec: Any) -> Any:
    """The simulated setting; a ``--kv-fraction`` is sized on the tune part's sessions."""
    from talaria.swebench_replay.driver import cluster_for
    from talaria.swebench_replay.pressure import with_kv_fraction
    from talaria.swebench_replay.runs import Setting

    cluster = cluster_for(args.hardware, args.instances)
    if args.kv_fraction is not None:
        cluster = with_kv_fraction(cluster, tune_spec, args.kv_fraction)
    return Setting(cluster, gap_scale=args.gap_scale, hints=not args.no_hints)


def _workloads(args: argparse.Namespace) -> tuple[Any, Any]:
    """(tune part spec, comparison spec) of the options."""
    from talaria.swebench_replay.runs import WorkloadSpec
    from talaria.swebench_replay.split import Part

    common = {
        "synthetic": args.synthetic,
        "sessions": args.sessions or 30,
        "calls": args.calls or 960,
        "arrival": args.arrival,
        "token_scale": args.token_scale or 1.0,
    }
    tune = WorkloadSpec(trace=args.tune_trace, part=Part.TUNE, **common)
    part = Part(args.part) if getattr(args, "part", None) else None
    if part is None:
        part = Part.ALL if args.trace is not None else Part.TEST
    return tune, WorkloadSpec(trace=args.trace, part=part, **common)


@contextmanager
def _bar(console: Console, label: str, total: int) -> Iterator[Callable[[Any], None]]:
    with progress_bar(console) as progress:
        task = progress.add_task(label, total=total)
        yield lambda _outcome: progress.advance(task)


def tuning_for(
    args: argparse.Namespace,
    console: Console,
    policies: tuple[PolicyConfig, ...],
    tune_spec: Any,
    setting: Any,
    bar: bool = True,
) -> dict[str, Any]:
    """The tuning document for ``policies``: ``--tuned FILE``, else the cache, else tuned
    now (and cached), with a progress bar unless ``bar`` is False (another one is live)."""
    from talaria.swebench_replay import tuning

    given = getattr(args, "tuned", None)
    if given is not None:
        try:
            doc = json.loads(Path(given).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--tuned {given}: cannot read it ({exc})") from None
        tuning.tuned_policies(policies, tuning.from_document(doc))  # all there?
        doc["origin"] = f"given: {given}"
        return dict(doc)
    n = args.seeds if args.command == "tune" and args.seeds else TUNE_SEEDS_DEFAULT
    seeds = tuple(range(n))
    key = tuning.cache_key(tune_spec, setting, policies, seeds)
    cached = None if getattr(args, "retune", False) else tuning.read_cached(key)
    if cached is not None:
        cached["origin"] = f"cached: {tuning.cache_file(key)}"
        return cached
    runs = tuning.tuning_runs(tune_spec, setting, policies, seeds)
    console.print(
        f"tuning {len(policies)} policies on the tune part: {len(runs)} simulations "
        f"({len(seeds)} seeds), {args.jobs} at a time"
    )
    from talaria.swebench_replay.runs import execute_all

    if bar:
        with _bar(console, "tuning (tune part)", len(runs)) as tick:
            outcomes = execute_all(runs, args.jobs, tick)
    else:
        outcomes = execute_all(runs, args.jobs)
    doc = tuning.to_document(tuning.choose(policies, seeds, outcomes), key, seeds)
    doc["workload"] = tune_spec.to_json()
    path = tuning.write_cached(doc)
    doc["origin"] = f"tuned now, cached: {path}"
    return doc


def cmd_tune(args: argparse.Namespace, console: Console) -> int:
    from talaria.swebench_replay.report import tuning_table

    policies = parse_policies(args.policies or "all")
    tune_spec, _ = _workloads(args)
    setting = _setting(args, tune_spec)
    started = time.perf_counter()
    doc = tuning_for(args, console, policies, tune_spec, setting)
    doc["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tuned.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    console.print(tuning_table(doc))
    console.print(f"{doc['origin']}; wrote {path}")
    return 0


def cmd_replay_sim(args: argparse.Namespace, console: Console, plots: Any) -> int:
    """The simulated replay: tuned policies on the comparison part over ``--seeds`` seeds."""
    from talaria.swebench_replay import tuning
    from talaria.swebench_replay.compare import comparison_document, comparison_runs, summarize
    from talaria.swebench_replay.report import (
        comparison_markdown,
        comparison_table,
        mechanism_table,
        policy_table,
    )
    from talaria.swebench_replay.runs import execute_all, workload

    policies = parse_policies(args.policies or "all")
    tune_spec, spec = _workloads(args)
    seeds = tuple(range(args.seed, args.seed + (args.seeds or TEST_SEEDS_DEFAULT)))
    console.print(f"[bold]workload[/]: {workload(spec, seeds[0]).replay.trace}")  # bad input
    setting = _setting(args, tune_spec)  # fails here, before a tuning runs
    started = time.perf_counter()
    if args.slot_max_s is not None:
        console.print("--slot-max-s given: every policy runs at that quantum, untuned")
        policies = tuple(attrs.evolve(p, slot_max_s=args.slot_max_s) for p in policies)
        doc_tuning: dict[str, Any] | None = None
    else:
        doc_tuning = tuning_for(args, console, policies, tune_spec, setting)
        policies = tuning.tuned_policies(policies, tuning.from_document(doc_tuning))
    runs = comparison_runs(spec, setting, policies, seeds, keep=[p.name for p in policies])
    kept: dict[str, Any] = {}
    with _bar(console, f"comparison ({spec.part.value} part)", len(runs)) as tick:
        outcomes = execute_all(runs, args.jobs, tick)
    entries = summarize(seeds, outcomes, kept.__setitem__)
    results = comparison_document("sim", args.hardware, spec, setting, seeds, entries, doc_tuning)
    results["wall_s"] = time.perf_counter() - started
    out = args.out or Path("runs") / "replay-sim"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(comparison_markdown(results))
    made = plots(results, kept, out)
    console.print(policy_table(results))
    console.print(comparison_table(results))
    console.print(mechanism_table(results))
    console.print(f"wrote {', '.join(map(str, [out / 'results.json', out / 'results.md', *made]))}")
    return 0


def add_map_parser(sub: Any) -> None:
    """``talaria map``: every tuned policy and ablation over a map of settings."""
    from talaria.swebench_replay.runs import default_jobs

    mp = sub.add_parser(
        "map",
        help="where each mechanism pays: tuned policies and ablations over many settings",
        description="For each setting of the map (memory pressure, load, instances, tool-gap "
        "length; see talaria.swebench_replay.mechanism_map.POINTS), tune every policy on the "
        "tune part, compare on the test part over seeds, and report each mechanism's effect "
        "(its ablation's SCT over talaria's) and talaria against the best tuned per-request "
        "baseline. Writes map.json, map.md and map.png. Tunings are cached.",
    )
    mp.add_argument(
        "--points", choices=["all", "quick"], default="all", help="the whole map or 4 points"
    )
    mp.add_argument("--seeds", type=int, default=3, help="test seeds per point (default 3)")
    mp.add_argument("--tune-seeds", type=int, default=2, help="tune seeds (default 2)")
    mp.add_argument("--jobs", type=int, default=default_jobs(), help="worker processes")
    mp.add_argument("--synthetic", action="store_true", help="synthetic sessions, not traces")
    mp.add_argument("--out", type=Path, default=Path("runs") / "map", help="output folder")
    mp.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows of --out's map.json made with the same seeds (a map interrupted "
        "part way goes on from its last finished point)",
    )


def _finished_rows(
    path: Path, seeds: tuple[int, ...], tune_seeds: tuple[int, ...]
) -> tuple[dict[str, dict[str, Any]], float]:
    """The rows of an earlier map.json made with these seeds, by point, and the seconds
    spent on them (none and 0 if there is no such file or it was made with other seeds)."""
    if not path.exists():
        return {}, 0.0
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON ({exc}); remove it or drop --resume") from exc
    if doc.get("seeds") != list(seeds) or doc.get("tune_seeds") != list(tune_seeds):
        return {}, 0.0
    rows = {json.dumps(row["point"], sort_keys=True): row for row in doc.get("rows", [])}
    return rows, float(doc.get("wall_s", 0.0))


def cmd_map(args: argparse.Namespace, console: Console) -> int:
    from talaria.policy.baselines import POLICIES
    from talaria.swebench_replay import mechanism_map as mm
    from talaria.swebench_replay.report import map_markdown, map_table, plot_map

    if args.seeds < 1 or args.tune_seeds < 1:
        raise ConfigError("--seeds and --tune-seeds must be at least 1")
    points = mm.POINTS if args.points == "all" else mm.QUICK
    policies = tuple(POLICIES.values())
    seeds, tune_seeds = tuple(range(args.seeds)), tuple(range(args.tune_seeds))
    per_point = mm.runs_per_point(policies, args.seeds, args.tune_seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    kept, earlier_s = (
        _finished_rows(args.out / "map.json", seeds, tune_seeds) if args.resume else ({}, 0.0)
    )
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with progress_bar(console) as progress:
        for point in points:
            done = kept.get(json.dumps(point.to_json(), sort_keys=True))
            if done is not None:
                rows.append(done)
                continue
            task = progress.add_task(point.label[:28], total=per_point)

            def tick(_outcome: Any, task: Any = task) -> None:
                progress.advance(task)

            row = mm.run_point(point, policies, seeds, tune_seeds, args.jobs, args.synthetic, tick)
            progress.update(task, completed=per_point)
            rows.append(row)
            doc = {
                "seeds": list(seeds),
                "tune_seeds": list(tune_seeds),
                "rows": rows,
                "wall_s": earlier_s + time.perf_counter() - started,  # all runs' points
            }
            (args.out / "map.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "map.md").write_text(
        "SCT p50\n\n" + map_markdown(rows, "p50") + "\nSCT p95\n\n" + map_markdown(rows, "p95")
    )
    plot = plot_map(rows, args.out / "map.png")
    console.print(map_table(rows, "p50"))
    console.print(map_table(rows, "p95"))
    console.print(f"wrote {args.out / 'map.json'}, {args.out / 'map.md'}, {plot}")
    return 0
