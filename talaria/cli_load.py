"""``talaria load``: the serverless pool's load sweep (:mod:`talaria.swebench_replay.load_sweep`).

Writes ``load.json`` (the figures) and ``load_sct_p95.png`` (SCT p95 against the arrival
rate, one line per policy) into ``--out`` and prints a table per rate.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from talaria.cli_compare import progress_bar
from talaria.errors import BadRequest
from talaria.policy.baselines import BASELINES, POOL_BASELINES, parse_policies
from talaria.sim.pool_catalog import DEFAULT_ZIPF_S, POOL_SHAPES, device_memory_bytes, pool_catalog
from talaria.swebench_replay.open_loop import parse_pattern

DEFAULT_POLICIES = ",".join(("talaria", *BASELINES, *POOL_BASELINES))


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadRequest(f"{flag} takes comma-separated numbers, got {text!r}") from None


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadRequest(f"{flag} takes comma-separated integers, got {text!r}") from None


def add_load_parser(sub: Any) -> None:
    """Register ``talaria load`` on the CLI's subparsers."""
    p = sub.add_parser(
        "load",
        help="sweep open-loop arrival rates on a simulated serverless pool of many models",
        description="Simulate a pool of TP4 H200 instances serving a Zipf-popular catalog of "
        f"up to {len(POOL_SHAPES)} published models (more weights than the pool's device "
        "memory: cold starts load from disk) under open-loop arrivals of real agent "
        "sessions, at each rate of --rates, for talaria and the baselines, each tuned first "
        "on the tune part. Reports SCT p50/p95, TTFT p95, cold starts per hour, "
        "device-seconds per session, goodput within an SLO of 2x each session's isolated "
        "time, and the rate at which each policy's SCT p95 doubles.",
        epilog="example: talaria load --instances 8 --rates 0.02,0.05,0.1,0.2 --sessions 40 "
        "--out runs/load",
    )
    p.add_argument("--instances", type=int, default=8, help="TP4 instances, even (default 8)")
    p.add_argument("--rates", default="0.01,0.02,0.05,0.1", help="sessions per second, a list")
    p.add_argument("--sessions", type=int, default=60, help="arrivals per rate (default 60)")
    p.add_argument("--pattern", default="poisson", help="'poisson' or 'gamma:CV' (bursty)")
    p.add_argument("--models", type=int, default=len(POOL_SHAPES), help="catalog size")
    p.add_argument("--zipf", type=float, default=DEFAULT_ZIPF_S, help="popularity exponent")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated names")
    p.add_argument("--seeds", default="0", help="test seeds, comma-separated (default 0)")
    p.add_argument("--tune-seeds", default="0,1,2", help="tune seeds (default 0,1,2)")
    p.add_argument("--tune-rate", type=float, default=None, help="default: the middle rate")
    p.add_argument("--no-tune", action="store_true", help="every policy at its defaults")
    p.add_argument(
        "--keep-alive",
        type=float,
        default=math.inf,
        help="seconds an idle instance stays provisioned before it scales to zero, for every "
        "policy (a reservation holds it longer); default inf: never",
    )
    p.add_argument(
        "--provision",
        type=float,
        default=0.0,
        help="seconds an instance that scaled to zero waits for its devices when work wakes "
        "it (a process or container start, a device allocation); default 0: at once",
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--trace", type=Path, default=None, help="traces (default: bundled)")
    p.add_argument("--out", type=Path, default=Path("runs/load"), help="output folder")


def _tell(progress: Progress, task: TaskID) -> Callable[[int, int], None]:
    """A simulation batch's progress onto ``task`` (a second batch restarts the bar)."""

    def tell(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    return tell


def cmd_load(args: argparse.Namespace, console: Console) -> int:
    """Run the sweep ``args`` describe; write the JSON and the plot; print the table."""
    from talaria.swebench_replay import load_sweep as ls

    started = time.monotonic()
    catalog = pool_catalog(args.models, args.zipf)
    setting = ls.LoadSetting(
        catalog,
        args.instances,
        args.sessions,
        parse_pattern(args.pattern),
        args.trace,
        provision_s=args.provision,
    )
    policies = [
        attrs.evolve(p, keep_alive_s=args.keep_alive) for p in parse_policies(args.policies)
    ]
    rates = ls.check_rates(_floats(args.rates, "--rates"))
    seeds, tune_seeds = _ints(args.seeds, "--seeds"), _ints(args.tune_seeds, "--tune-seeds")
    tune_rate = None if args.no_tune else (args.tune_rate or rates[len(rates) // 2])
    with progress_bar(console) as progress:
        if tune_rate is None:
            tuned = ls.untuned(policies)
        else:
            task = progress.add_task(f"tuning at {tune_rate:g}/s", total=None)
            tuned = ls.tune_load(
                setting, policies, tune_rate, tune_seeds, args.jobs, _tell(progress, task)
            )
        task = progress.add_task("isolated, then rates", total=None)
        swept = ls.sweep(setting, policies, rates, tuned, seeds, args.jobs, _tell(progress, task))
    cluster = setting.cluster()
    doc = {
        "command": "talaria " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "talaria load",
        "substrate": "sim",
        "hardware": "h200-tp8 (two TP4 instances per server)",
        "instances": args.instances,
        "devices": setting.devices,
        "catalog": {
            "models": [m.name for m in catalog.models],
            "zipf_s": catalog.zipf_s,
            "probabilities": list(catalog.probabilities),
            "weight_bytes": catalog.weight_bytes,
            "pool_device_memory_bytes": device_memory_bytes(cluster),
        },
        "keep_alive_s": args.keep_alive if math.isfinite(args.keep_alive) else None,
        "provision_s": args.provision,
        "workload": {
            "pattern": setting.pattern.describe(),
            "sessions_per_rate": args.sessions,
            "part": "test",
            "seeds": seeds,
            "trace": str(args.trace or "bundled"),
        },
        "slo": f"SCT <= {setting.slo_factor:g} x the session's isolated SCT (alone on an idle "
        "server of the pool, talaria, from the pool's initial state)",
        "rates_per_s": rates,
        "tuning": ls.tuning_document(tuned, tune_rate, tune_seeds),
        **swept,
        "wall_s": time.monotonic() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot = plot_sct_p95(doc, args.out / "load_sct_p95.png")
    console.print(table(doc))
    console.print(f"wrote {args.out / 'load.json'} and {plot} in {doc['wall_s']:.0f} s")
    return 0


def table(doc: dict[str, Any]) -> Table:
    """The sweep's figures, one row per (policy, rate); with several seeds the SCT p95 has
    its 95% interval, and every policy's p95 is set against the first policy's."""
    t = Table(title=f"load sweep: {doc['instances']} instances, {doc['workload']['pattern']}")
    for col in (
        "policy",
        "rate/s",
        "SCT p50",
        "SCT p95",
        "TTFT p95",
        "cold/h",
        "busy dev-s",
        "held dev-s",
        "goodput/h",
        "in SLO",
        "p95 / first's",
        "p95 x2 at",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, entry in doc["policies"].items():
        dbl = entry["sct_p95_doubling_rate_per_s"]
        for i, pt in enumerate(entry["points"]):
            t.add_row(
                name if i == 0 else "",
                f"{pt['rate_per_s']:g}",
                f"{pt['sct_p50_s']:.0f}",
                _with_ci(pt, "sct_p95_s"),
                f"{pt['ttft_p95_s']:.1f}",
                f"{pt['cold_starts_per_h']:.0f}",
                f"{pt['device_busy_s_per_session']:.0f}",
                f"{pt.get('device_held_s_per_session', float('nan')):.0f}",
                f"{pt['goodput_sessions_per_h']:.1f}",
                f"{pt['slo_met_share']:.0%}",
                _ratio(pt),
                ("-" if dbl is None else f"{dbl:.3g}") if i == 0 else "",
            )
    return t


def _with_ci(point: dict[str, Any], key: str) -> str:
    """A point's figure, with its 95% interval over seeds where it has one."""
    ci = point.get("intervals", {}).get(key, {}).get("ci95", [None, None])
    text = f"{point[key]:.0f}"
    return text if ci[0] is None else f"{text} [{ci[0]:.0f},{ci[1]:.0f}]"


def _ratio(point: dict[str, Any]) -> str:
    """The point's SCT p95 over the first policy's (paired over seeds), with its interval."""
    r = point.get("sct_p95_ratio_to_reference")
    if r is None:
        return "-"
    low, high = r["ci95"]
    return f"{r['value']:.2f}" + ("" if low is None else f" [{low:.2f},{high:.2f}]")


def plot_sct_p95(doc: dict[str, Any], path: Path) -> Path:
    """SCT p95 against the arrival rate, one line per policy (writes ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, entry in doc["policies"].items():
        pts = entry["points"]
        ax.plot(
            [p["rate_per_s"] for p in pts], [p["sct_p95_s"] for p in pts], marker="o", label=name
        )
    ax.set_xlabel("session arrival rate (sessions/s)")
    ax.set_ylabel("SCT p95 (s)")
    ax.set_title(
        f"{doc['instances']} TP4 H200 instances, {len(doc['catalog']['models'])} "
        f"models, Zipf s={doc['catalog']['zipf_s']:g}, {doc['workload']['pattern']}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
