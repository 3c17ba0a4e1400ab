"""What keep-alive costs and saves on the serverless pool of ``talaria load``, in the simulator.

An instance with nothing to serve stays provisioned for ``keep_alive_s`` seconds, then
scales to zero (``talaria.policy.keep_alive``): its devices go back, its weights leave the
device and its KV is demoted to the host tier; the next call there loads its model again
from host or disk. A per-request policy has only that timer. Talaria also keeps an instance
while it holds a soft reservation (a session it expects back soon); ``talaria-no-reserve``
is talaria without reservations, so the difference between the two is what the
reservations add to keep-alive.

For each policy, keep-alive and rate, the test part's arrivals of each seed run on the pool
(the same arrivals as ``talaria load``'s); the table and the plot set device-seconds *held*
per session (what a serverless pool pays for) against SCT p50 / p95. The policies' latency
knobs come from a ``talaria load`` result tuned on the tune part (``--tuned``; tuned there
with instances never scaling to zero); ``talaria-no-reserve`` takes talaria's knobs where
the result has none of its own. Keep-alive is not tuned: the curve is the result. A second
table sets chosen pairs against each other, paired over seeds. ``--provision S`` makes a
woken instance wait ``S`` seconds for its devices before its switch (the simulator's
keep-alive is otherwise a lower bound on what scaling to zero costs in latency).

    python benchmarks/keep_alive.py --jobs 2 --out docs/results/keep-alive
    python benchmarks/keep_alive.py --report docs/results/keep-alive/keep_alive.json
    python benchmarks/keep_alive.py --report after.json --against before.json
    python benchmarks/keep_alive.py --report talaria.json --report autoscale.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from talaria.cli_compare import progress_bar
from talaria.config import PolicyConfig
from talaria.errors import BadRequest
from talaria.policy.baselines import POLICIES
from talaria.policy.knobs import with_knobs
from talaria.sim.pool_catalog import pool_catalog
from talaria.swebench_replay import load_sweep as ls
from talaria.swebench_replay.split import Part
from talaria.swebench_replay.stats import ratio_interval

DEFAULT_TUNED = Path("docs/results/load-sweep-hold/load.json")
KEYS = (
    "sct_p50_s",
    "sct_p95_s",
    "device_held_s_per_session",
    "device_busy_s_per_session",
    "scale_to_zero_per_h",
    "cold_starts_per_h",
    "slo_met_share",
)


def tuned_knobs(
    paths: Sequence[Path],
    names: Sequence[str],
    setting: ls.LoadSetting,
    any_sessions: bool = False,
) -> dict[str, dict[str, float]]:
    """Each policy's knobs from tuned ``talaria load`` results for the same pool and
    points, the first of ``paths`` that tuned it (talaria's for ``talaria-no-reserve`` where
    none has its own); ``BadRequest`` if one was not tuned on the tune part or ran another
    setting, or none tuned a policy. ``any_sessions``: knobs tuned with another number of
    arrivals a point are taken too (the pool must still be the same), e.g. knobs tuned at
    a light load carried to a sweep past saturation, where tuning every policy again at
    hundreds of sessions a point costs hours."""
    found: dict[str, Any] = {}
    for path in paths:
        doc = json.loads(path.read_text())
        tuning = doc.get("tuning", {})
        if not tuning.get("tuned") or tuning.get("part") != Part.TUNE.value:
            raise BadRequest(f"{path} was not tuned on the tune part: run talaria load first")
        ran = (doc["instances"], doc["workload"]["sessions_per_rate"])
        if ran[0] != setting.n_instances or (ran[1] != setting.sessions and not any_sessions):
            raise BadRequest(
                f"{path} was tuned on {ran[0]} instances and {ran[1]} sessions a point; "
                "pass the same --instances and --sessions (or --tuned-any-sessions)"
            )
        found = {**tuning["policies"], **found}  # the first file's knobs win
    out = {}
    for name in names:
        source = name if name in found else "talaria" if name == "talaria-no-reserve" else None
        if source is None or source not in found:
            raise BadRequest(f"no tuned knobs for {name!r} in {', '.join(map(str, paths))}")
        out[name] = dict(found[source]["knobs"])
    return out


def variants(names: Sequence[str], specs: Sequence[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """Each policy as it runs: (label, policy, knob overrides). A ``--vary`` spec
    ``POLICY:KNOB=V1,V2`` replaces that policy's run by one per value, labelled
    ``POLICY KNOB=V`` (the knob set over its tuned value); ``BadRequest`` for a policy not
    run, a field ``PolicyConfig`` lacks or that is not a number, or a value not a number
    (the policy's validators refuse values out of range when it is built)."""
    fields = attrs.fields_dict(PolicyConfig)
    varied: dict[str, list[tuple[str, Any]]] = {}
    for spec in specs:
        policy, sep, rest = spec.partition(":")
        knob, eq, values = rest.partition("=")
        if not (sep and eq and values) or policy not in names or knob not in fields:
            raise BadRequest(
                f"--vary {spec!r}: want POLICY:KNOB=V1,V2 with POLICY one of --policies "
                f"({', '.join(names)}) and KNOB a PolicyConfig field"
            )
        kind = type(getattr(POLICIES[policy], knob))
        if kind not in (int, float):
            raise BadRequest(f"--vary {spec!r}: {knob} is not a number")
        try:
            numbers = [float(v) for v in values.split(",")]
        except ValueError as exc:
            raise BadRequest(f"--vary {spec!r}: {exc}") from None
        if kind is int and not all(x.is_integer() for x in numbers):
            raise BadRequest(f"--vary {spec!r}: {knob} takes whole numbers")
        varied.setdefault(policy, []).extend((knob, kind(x)) for x in numbers)
    out: list[tuple[str, str, dict[str, Any]]] = []
    for name in names:
        if name not in varied:
            out.append((name, name, {}))
        for knob, value in varied.get(name, []):
            out.append((f"{name} {knob}={value:g}", name, {knob: value}))
    return out


def merge(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Runs on the same pool, seeds and provisioning as one: the first's fields, every
    run's points (a point in two runs: the first's). ``BadRequest`` where they differ."""
    first = docs[0]
    key = ("instances", "sessions_per_point", "seeds", "provision_s", "part")
    for doc in docs[1:]:
        if any(doc[k] != first[k] for k in key):
            raise BadRequest(f"reports to merge must share {', '.join(key)}")
    seen: set[tuple[Any, ...]] = set()
    points = []
    for doc in docs:
        for p in doc["points"]:
            at = (p["policy"], p["keep_alive_s"], p["rate_per_s"])
            if at not in seen:
                seen.add(at)
                points.append(p)
    return {**first, "points": points}


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise BadRequest(f"unknown policies {unknown}; known: {sorted(POLICIES)}")
    keep = [float(x) for x in args.keep_alive.split(",")]
    rates = ls.check_rates([float(x) for x in args.rates.split(",")])
    seeds = [int(x) for x in args.seeds.split(",")]
    setting = ls.LoadSetting(
        pool_catalog(), args.instances, args.sessions, provision_s=args.provision
    )
    tuned = args.tuned or [DEFAULT_TUNED]
    knobs = tuned_knobs(tuned, names, setting, args.tuned_any_sessions)
    runs = variants(names, args.vary or [])
    plan = [(label, k, r) for label, _, _ in runs for k in keep for r in rates]
    configs = {
        label: attrs.evolve(with_knobs(POLICIES[n], knobs[n]), **over) for label, n, over in runs
    }
    jobs = [
        ls.Job(setting, attrs.evolve(configs[n], keep_alive_s=k), *rs)
        for n, k, r in plan
        for rs in ((Part(args.part), r, s) for s in seeds)
    ]
    started = time.monotonic()
    with progress_bar(console) as bar:
        task = bar.add_task("isolated times", total=None)
        isolated = ls.isolated_times(
            setting, seeds, rates[0], args.jobs, _tell(bar, task), Part(args.part)
        )
        task = bar.add_task("policies x keep-alive x rates", total=None)
        played_all = ls.execute_all(ls.play, jobs, args.jobs, _tell(bar, task))
    played = iter(played_all)
    points = []
    for n, k, r in plan:
        entry = ls.point_metrics([next(played) for _ in seeds], isolated, setting)
        points.append(
            {
                "policy": n,
                "keep_alive_s": k if math.isfinite(k) else None,
                "rate_per_s": r,
                **{key: entry[key] for key in KEYS},
                "per_seed": [{key: m[key] for key in KEYS} for m in entry["per_seed"]],
            }
        )
    return {
        "command": "python benchmarks/keep_alive.py " + " ".join(sys.argv[1:]),
        "substrate": "sim",
        "instances": args.instances,
        "sessions_per_point": args.sessions,
        "provision_s": args.provision,
        "seeds": seeds,
        "part": args.part,
        "knobs": knobs,
        "varied": {label: over for label, _, over in runs if over},
        "tuned_from": [str(p) for p in tuned],
        "points": points,
        "wall_s": time.monotonic() - started,
    }


# (policy, keep-alive) pairs set against each other: None is "never"
PAIRS = (
    (("talaria", 0.0), ("talaria", None)),
    (("serverless", 10.0), ("serverless", None)),
    (("talaria", 0.0), ("talaria-no-reserve", 0.0)),
    (("talaria", 0.0), ("serverless", 10.0)),
    (("autoscale", 10.0), ("autoscale", None)),
    (("talaria", 0.0), ("autoscale", 0.0)),
    (("talaria", 0.0), ("autoscale", 10.0)),
    (("talaria", 0.0), ("autoscale", 60.0)),
    (("talaria", None), ("autoscale", None)),
    (("talaria", None), ("serverless", None)),
)


def ratio_cell(a: dict[str, Any], b: dict[str, Any], key: str) -> str:
    """``key`` of point ``a`` over point ``b``, paired over their seeds: the geometric mean
    and 95% interval of the per-seed ratio (``ratio_interval``); one seed: the ratio alone."""
    x, y = [s[key] for s in a["per_seed"]], [s[key] for s in b["per_seed"]]
    if len(x) < 2:
        return f"{x[0] / y[0]:.2f}"
    iv = ratio_interval(x, y)
    return f"{iv.value:.2f} [{iv.low:.2f}, {iv.high:.2f}]"


_Side = tuple[str, float | None]


def pairs_of(points: Sequence[dict[str, Any]]) -> list[tuple[_Side, _Side]]:
    """The pairs a run's ``points`` can show: ``PAIRS``, then for each varied policy (a
    point labelled ``POLICY KNOB=V``, see ``variants``) what ``POLICY`` is set against in
    ``PAIRS``, and the knob's effect: the variant against ``POLICY`` itself at the same
    keep-alive (from another run, merged), or else against the first variant of ``POLICY``
    there (a run that varies the knob has no plain ``POLICY`` point)."""
    out = list(PAIRS)
    first_variant: dict[_Side, _Side] = {}
    for label, keep in dict.fromkeys((p["policy"], p["keep_alive_s"]) for p in points):
        base, sep, _ = label.partition(" ")
        if not sep:
            continue
        out += [((label, keep), second) for first, second in PAIRS if first == (base, keep)]
        out.append(((label, keep), (base, keep)))
        head = first_variant.setdefault((base, keep), (label, keep))
        if head != (label, keep):
            out.append(((label, keep), head))
    return out


def paired(doc: dict[str, Any]) -> Table:
    """Paired ratios over the seeds (geometric mean and 95% interval of the per-seed ratio,
    ``ratio_interval``) of held and busy device-seconds and SCT p50 and p95, for the pairs
    the run has (``pairs_of``)."""
    pts = {(p["policy"], p["keep_alive_s"], p["rate_per_s"]): p for p in doc["points"]}
    rates = sorted({p["rate_per_s"] for p in doc["points"]})
    t = Table(title="paired over seeds: first / second (95% interval)")
    for col in ("first", "second", "rate/s", "held dev-s", "busy dev-s", "SCT p50", "SCT p95"):
        t.add_column(col, justify="right" if col in ("rate/s",) else "left")

    def name(side: _Side) -> str:
        return f"{side[0]}, " + ("never" if side[1] is None else f"{side[1]:g} s")

    for first, second in pairs_of(doc["points"]):
        for r in rates:
            a, b = pts.get((*first, r)), pts.get((*second, r))
            if a is None or b is None:
                continue
            cells = [
                ratio_cell(a, b, key)
                for key in (
                    "device_held_s_per_session",
                    "device_busy_s_per_session",
                    "sct_p50_s",
                    "sct_p95_s",
                )
            ]
            t.add_row(name(first), name(second), f"{r:g}", *cells)
    return t


def against(doc: dict[str, Any], base: dict[str, Any]) -> Table:
    """This run's points against the same points (policy, keep-alive, rate) of ``base``
    (another run on the same seeds: before and after a change), paired over seeds."""
    if (doc["instances"], doc["seeds"]) != (base["instances"], base["seeds"]):
        raise BadRequest("--against needs a run on the same instances and seeds")
    pts = {(p["policy"], p["keep_alive_s"], p["rate_per_s"]): p for p in base["points"]}
    t = Table(title="this run / the other run, paired over seeds (95% interval)")
    cols = ("policy", "rate/s", "keep-alive s", "SCT p50", "SCT p95", "held dev-s")
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right")
    for a in doc["points"]:
        b = pts.get((a["policy"], a["keep_alive_s"], a["rate_per_s"]))
        if b is None:
            continue
        cells = [
            ratio_cell(a, b, key) for key in ("sct_p50_s", "sct_p95_s", "device_held_s_per_session")
        ]
        ka = a["keep_alive_s"]
        t.add_row(a["policy"], f"{a['rate_per_s']:g}", "inf" if ka is None else f"{ka:g}", *cells)
    return t


def doubling(doc: dict[str, Any]) -> Table:
    """Where each (policy, keep-alive) line's SCT p95 doubles over its own value at the
    lowest rate (``load_sweep.doubling_rate``), and where it reaches one bound common to
    every line, twice the least of their SCT p95s at the lowest rate (the same p95 for
    all: ``load_sweep.rate_reaching``); each interpolated between the rates around it,
    seed by seed, with the mean where every seed reaches it within the sweep."""
    lines = _lines(doc)
    bound = 2 * min(pts[0]["sct_p95_s"] for pts in lines.values())
    t = Table(title=f"rate at which SCT p95 doubles, and at which it reaches {bound:.0f} s")
    cols = ("policy", "keep-alive s", "lowest rate/s", "its SCT p95", "doubles", "reaches")
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right")
    for (name, keep), pts in lines.items():
        rates = [p["rate_per_s"] for p in pts]
        curves = [
            [p["per_seed"][i]["sct_p95_s"] for p in pts] for i in range(len(pts[0]["per_seed"]))
        ]
        t.add_row(
            name,
            "inf" if keep is None else f"{keep:g}",
            f"{rates[0]:g}",
            f"{pts[0]['sct_p95_s']:.0f}",
            _rates_cell([ls.doubling_rate(rates, c) for c in curves]),
            _rates_cell([ls.rate_reaching(rates, c, bound) for c in curves]),
        )
    return t


def _lines(doc: dict[str, Any]) -> dict[_Side, list[dict[str, Any]]]:
    """The run's points by (policy, keep-alive), in the order they first appear, each line
    by rate."""
    lines: dict[_Side, list[dict[str, Any]]] = {}
    for p in doc["points"]:
        lines.setdefault((p["policy"], p["keep_alive_s"]), []).append(p)
    for pts in lines.values():
        pts.sort(key=lambda p: p["rate_per_s"])
    return lines


def _rates_cell(per_seed: Sequence[float | None]) -> str:
    """Rates per seed ("none": not within the sweep), then their mean if every seed has one."""
    cell = ", ".join("none" if r is None else f"{r:.3g}" for r in per_seed)
    found = [r for r in per_seed if r is not None]
    if found and len(found) == len(per_seed):
        cell += f"; mean {sum(found) / len(found):.3g}"
    return cell


def _tell(bar: Progress, task: TaskID) -> Callable[[int, int], None]:
    def tell(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return tell


def table(doc: dict[str, Any]) -> Table:
    wake = doc.get("provision_s") or 0
    title = f"keep-alive: {doc['instances']} instances, seeds {doc['seeds']}"
    t = Table(title=title + (f", {wake:g} s to provision" if wake else ""))
    cols = ("policy", "rate/s", "keep-alive s", "SCT p50", "SCT p95", "held dev-s")
    for col in (*cols, "busy dev-s", "to zero/h", "cold/h", "in SLO"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for p in doc["points"]:
        ka = p["keep_alive_s"]
        t.add_row(
            p["policy"],
            f"{p['rate_per_s']:g}",
            "inf" if ka is None else f"{ka:g}",
            f"{p['sct_p50_s']:.0f}",
            f"{p['sct_p95_s']:.0f}",
            f"{p['device_held_s_per_session']:.0f}",
            f"{p['device_busy_s_per_session']:.0f}",
            f"{p['scale_to_zero_per_h']:.0f}",
            f"{p['cold_starts_per_h']:.0f}",
            f"{p['slo_met_share']:.0%}",
        )
    return t


def plot_rates(doc: dict[str, Any], path: Path) -> None:
    """SCT p95 (the mean over seeds) against the arrival rate, a line per policy and
    keep-alive."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ((name, keep), pts) in enumerate(_lines(doc).items()):
        ka = "never" if keep is None else f"{keep:g} s"
        ax.plot(
            [p["rate_per_s"] for p in pts],
            [p["sct_p95_s"] for p in pts],
            marker="os^vD"[i % 5],
            label=f"{name}, keep-alive {ka}",
        )
    ax.set_xlabel("session arrival rate (sessions/s)")
    ax.set_ylabel(f"SCT p95 (s), mean over seeds {doc['seeds']}")
    ax.set_title(f"{doc['instances']} instances, {doc['sessions_per_point']} sessions a point")
    _save(fig, [ax], path)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Held device-seconds per session against SCT p95, a panel per rate, a line per
    policy through its keep-alive values (labelled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({p["rate_per_s"] for p in doc["points"]})
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        names = list(dict.fromkeys(p["policy"] for p in doc["points"]))
        for i, name in enumerate(names):  # the first policy on top, each its own marker
            pts = [p for p in doc["points"] if p["policy"] == name and p["rate_per_s"] == rate]
            xs = [p["device_held_s_per_session"] for p in pts]
            ys = [p["sct_p95_s"] for p in pts]
            marker, style = "os^vD"[i % 5], ("-", "--", ":")[i % 3]
            ax.plot(xs, ys, marker=marker, ls=style, label=name, zorder=len(names) - i)
            for p, x, y in zip(pts, xs, ys, strict=True):
                ka = p["keep_alive_s"]
                ax.annotate("inf" if ka is None else f"{ka:g}", (x, y), fontsize=7)
        ax.set_xlabel("device-seconds held per session")
        ax.set_ylabel("SCT p95 (s)")
        ax.set_title(f"{doc['instances']} instances, {rate:g} sessions/s (labels: keep-alive s)")
    _save(fig, axes[0], path)


def _save(fig: Any, axes: Sequence[Any], path: Path) -> None:
    """Grid and legend on each of ``axes``, then ``fig`` written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _several_rates(doc: dict[str, Any]) -> bool:
    return len({p["rate_per_s"] for p in doc["points"]}) > 1


def _print_tables(console: Console, doc: dict[str, Any]) -> None:
    """The points, the pairs, and where a run sweeps rates, where each line's p95 doubles."""
    console.print(table(doc))
    console.print(paired(doc))
    if _several_rates(doc):
        console.print(doubling(doc))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--sessions", type=int, default=40, help="arrivals per point")
    p.add_argument("--rates", default="0.05,0.5")
    p.add_argument("--seeds", default="0,1,2", help="seeds of the part's arrivals")
    p.add_argument(
        "--part",
        choices=[Part.TEST.value, Part.TUNE.value],
        default=Part.TEST.value,
        help="the traces' part the arrivals draw from: test (default), or tune, to choose a "
        "trade-off knob (--vary) before a test run",
    )
    p.add_argument("--keep-alive", default="0,10,60,300,inf", help="seconds, a list")
    p.add_argument("--policies", default="talaria,talaria-no-reserve,serverless")
    p.add_argument(
        "--provision",
        type=float,
        default=0.0,
        help="seconds an instance at zero waits for its devices when work wakes it (a "
        "process or container start, a device allocation); default 0: at once",
    )
    p.add_argument(
        "--tuned",
        type=Path,
        action="append",
        help=f"a tuned load.json (again for more; a policy's knobs from the first that "
        f"tuned it); default {DEFAULT_TUNED}",
    )
    p.add_argument(
        "--tuned-any-sessions",
        action="store_true",
        help="take --tuned knobs tuned with another number of sessions a point (the same "
        "--instances still): e.g. knobs tuned at 40 sessions for a sweep of hundreds past "
        "saturation",
    )
    p.add_argument(
        "--vary",
        action="append",
        metavar="POLICY:KNOB=V1,V2",
        help="run POLICY once per value of a PolicyConfig knob, over its tuned setting (e.g. "
        "talaria:wake_charge_s=0,10,30 or autoscale:concurrency_target=2,8,64); each run is "
        "a point labelled 'POLICY KNOB=V'. Again for another policy",
    )
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/keep-alive"))
    p.add_argument(
        "--report",
        type=Path,
        action="append",
        help="print the tables of a keep_alive.json, no run (again for more: runs on the "
        "same pool and seeds as one, so pairs may cross runs)",
    )
    p.add_argument(
        "--against",
        type=Path,
        default=None,
        help="with --report: set its points against another keep_alive.json's (before/after)",
    )
    args = p.parse_args()
    console = Console(width=150)
    if args.report:
        doc = merge([json.loads(path.read_text()) for path in args.report])
        _print_tables(console, doc)
        if args.against is not None:
            console.print(against(doc, json.loads(args.against.read_text())))
        return 0
    doc = run(args, console)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "keep_alive.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, args.out / "keep_alive.png")
    if _several_rates(doc):
        plot_rates(doc, args.out / "keep_alive_rates.png")
    _print_tables(console, doc)
    console.print(f"wrote {args.out} in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
