"""The load sweep (``talaria load``): a serverless pool under open-loop load, rate by rate.

A :class:`LoadSetting` is a Zipf catalog (:mod:`talaria.sim.pool_catalog`) on ``n_instances``
TP4 H200 instances, sessions arriving open-loop (:mod:`talaria.swebench_replay.open_loop`).
For each policy and each rate the simulator plays the test part's sessions (the same
arrivals at every rate, closer together as the rate grows) and reports, per point:

* SCT p50 / p95 and TTFT p95 (seconds);
* cold starts per hour: switches and stages that read a model's weights from disk
  (``cold_loads``), per hour of the run (first arrival to last session end);
* device-seconds per session: the seconds instances were busy with a switch, a step or KV
  moves, times their devices (``device_busy_ms``); the seconds they were *held*
  (provisioned: from an instance's first work, or the work that woke it, until it scaled to
  zero after its keep-alive, :mod:`talaria.policy.keep_alive`, or the run's last work;
  ``device_held_ms``), what a serverless pool pays for; and every device of the pool for the
  whole run (a pool that never scales to zero and never leaves an instance unused);
* goodput: sessions per hour of the run that finished within the SLO, ``slo_factor`` (2)
  times the session's *isolated* time: the same session, arriving alone on an idle pool of
  one server (two instances: every instance of an idle pool is alike, and a lone session
  uses one), under talaria's policy, from the pool's initial state (a model not in the
  instance's host tier is a cold start there too).

Each policy is first tuned by the project's protocol (:mod:`talaria.swebench_replay.tuning`:
every setting of its own knobs, :func:`talaria.policy.knobs.grid`; the lowest mean SCT p50
over the tune seeds, ties within 1% to the lowest p95) on the *tune* part of the traces, at
one rate (``tune_rate``), before any test-part point runs. The rate at which a policy's SCT
p95 doubles over its value at the lowest rate is interpolated linearly between the sweep's
points (None: not within the sweep). Over several test seeds each figure is the mean of the
seeds' figures, with its 95% interval beside it (:func:`with_intervals`).

Simulations are independent jobs (:func:`execute_all`, in worker processes when ``jobs`` >
1). Mutates nothing it is given.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import attrs
import numpy as np

from talaria import validators as valid
from talaria.config import ClusterConfig, PolicyConfig
from talaria.cost import cluster_estimators
from talaria.cost.hardware import HardwareProfile, profile
from talaria.errors import BadRequest, ConfigError
from talaria.policy.baselines import TALARIA
from talaria.policy.knobs import best, grid, knobs_of, with_knobs
from talaria.session.gaps import GapPredictor
from talaria.sim.pool_catalog import INSTANCES_PER_SERVER, PoolCatalog, pool_cluster
from talaria.sim.simulator import Simulator
from talaria.swebench_replay.metrics import percentile
from talaria.swebench_replay.open_loop import (
    ArrivalPattern,
    Draw,
    OpenLoad,
    build_load,
    check_rate,
    draw_arrivals,
    trace_sessions,
)
from talaria.swebench_replay.split import Part
from talaria.swebench_replay.stats import mean_interval, ratio_interval
from talaria.swebench_replay.traces import find_traces
from talaria.swebench_replay.tuning import RULE, TIE, TUNE_SEEDS, Trial, Tuned
from talaria.types import SessionScript

SLO_FACTOR: Final = 2.0
# The figures each point reports with an interval over its seeds.
INTERVAL_METRICS: Final = (
    "sct_p50_s",
    "sct_p95_s",
    "goodput_sessions_per_h",
    "slo_met_share",
    "device_busy_s_per_session",
    "device_held_s_per_session",
)


@attrs.frozen
class LoadSetting:
    """What a load sweep runs on (module docstring); ``sessions`` arrivals per point."""

    catalog: PoolCatalog
    n_instances: int = 8
    sessions: int = 60
    pattern: ArrivalPattern = attrs.field(factory=ArrivalPattern)
    trace: Path | None = None
    gap_scale: float = 1.0
    hints: bool = True
    slo_factor: float = SLO_FACTOR
    # seconds an instance that scaled to zero waits for its devices when work wakes it
    provision_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.sessions, bool) or not isinstance(self.sessions, int):
            raise BadRequest(f"sessions must be an integer, got {self.sessions!r}")
        if self.sessions < 1:
            raise BadRequest(f"a load point needs at least one session, got {self.sessions}")
        if not (isinstance(self.slo_factor, (int, float)) and self.slo_factor >= 1):
            raise BadRequest(f"slo_factor must be a number >= 1, got {self.slo_factor!r}")
        if not (valid.is_number(self.provision_s) and 0 <= self.provision_s < math.inf):
            raise BadRequest(f"provision_s must be a finite number >= 0, got {self.provision_s!r}")
        pool_cluster(self.catalog, self.n_instances)  # ConfigError: a model fits no instance

    def cluster(self, alone: bool = False) -> ClusterConfig:
        """The pool; ``alone``: one server of it (where isolated times are taken)."""
        return pool_cluster(self.catalog, INSTANCES_PER_SERVER if alone else self.n_instances)

    def hardware(self) -> dict[str, HardwareProfile]:
        """The pool's hardware profiles where they differ from the shipped ones: with a
        ``provision_s`` delay (a platform's, swept by the caller, not measured here)."""
        if self.provision_s == 0:
            return {}
        out = {}
        for name in {i.hardware for i in self.cluster().instances}:
            shipped = profile(name)
            why = f"provision_s: {self.provision_s:g} s set by the load sweep (a swept delay)"
            out[name] = attrs.evolve(
                shipped, provision_s=self.provision_s, sources=(*shipped.sources, why)
            )
        return out

    @property
    def devices(self) -> int:
        return sum(i.n_devices for i in self.cluster().instances)


@attrs.frozen
class Job:
    """One simulation: ``policy`` on ``part`` at ``rate_per_s`` under ``seed``."""

    setting: LoadSetting
    policy: PolicyConfig
    part: Part
    rate_per_s: float
    seed: int


@attrs.frozen
class Played:
    """What a job produced: each session's SCT and model, the calls' TTFT p95, the
    counters and the run's end (seconds)."""

    job: Job
    sct_s: Mapping[str, float]
    models: Mapping[str, str]
    trace_keys: Mapping[str, tuple[str, str]]
    ttft_p95_s: float
    counters: Mapping[str, int]
    end_s: float


def open_load(setting: LoadSetting, part: Part, rate_per_s: float, seed: int) -> OpenLoad:
    """The arrivals of one point (the same sessions at every rate of one seed)."""
    sessions, path = trace_sessions(setting.trace, part)
    draws = draw_arrivals(
        sessions, setting.catalog, setting.sessions, rate_per_s, setting.pattern, seed
    )
    return build_load(
        draws, seed, trace_path=path, gap_scale=setting.gap_scale, hints=setting.hints
    )


def pool_history(setting: LoadSetting, part: Part) -> tuple[int, ...]:
    """Calls per session the pool has served before a run of ``part``: a test run follows
    the tune part's sessions (its cluster core starts with their lengths learned, as a pool
    that has served before would); a tune run has no history."""
    if part is not Part.TEST:
        return ()
    return _tune_lengths(find_traces(setting.trace))  # resolved first: the cache key


@functools.lru_cache(maxsize=8)
def _tune_lengths(path: Path | None) -> tuple[int, ...]:
    """Calls per session of the tune part of the traces at ``path`` (read once a process:
    every test run of a sweep starts from them; ``ConfigError`` when there are none)."""
    sessions, _ = trace_sessions(path, Part.TUNE)
    return tuple(s.n_calls for s in sessions)


def _key(d: Draw) -> tuple[str, str]:
    return (f"{d.trace.source}#{d.trace_id}", d.model)


def play(job: Job) -> Played:
    """Simulate ``job`` (deterministic)."""
    load = open_load(job.setting, job.part, job.rate_per_s, job.seed)
    cluster = job.setting.cluster()
    estimators = cluster_estimators(cluster, job.setting.hardware())
    sim = Simulator(
        cluster,
        job.policy,
        estimators,
        learner=GapPredictor.default,
        history=pool_history(job.setting, job.part),
    )
    result = sim.run(load.scripts)
    by = load.by_session
    return Played(
        job,
        {s.session_id: s.sct_s for s in result.sessions},
        {s.session_id: s.model for s in result.sessions},
        {sid: _key(d) for sid, d in by.items()},
        percentile([c.ttft_s for c in result.calls], 95),
        dict(result.counters),
        result.end_s,
    )


def isolated_s(setting: LoadSetting, script: SessionScript) -> float:
    """``script``'s SCT alone on an idle server of the pool (module docstring)."""
    cluster = setting.cluster(alone=True)
    lone = attrs.evolve(script, start_s=0.0)
    sim = Simulator(cluster, TALARIA, cluster_estimators(cluster), learner=GapPredictor.default)
    return sim.run([lone]).sessions[0].sct_s


def _isolated_job(args: tuple[LoadSetting, SessionScript]) -> float:
    return isolated_s(*args)


Progress = Callable[[int, int], None]  # (jobs done, jobs in the batch)


def execute_all(
    fn: Callable[[Any], Any],
    jobs: Sequence[Any],
    workers: int = 1,
    on_done: Progress | None = None,
) -> list[Any]:
    """``fn`` of every job, in order; ``workers`` > 1 runs them in that many fresh worker
    processes (``spawn``). ``on_done(done, total)`` is told as each result comes in, in
    order."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"jobs must be a positive integer, got {workers!r}")
    tell: Progress = on_done or (lambda _done, _total: None)
    out: list[Any] = []
    if workers == 1 or len(jobs) <= 1:
        for j in jobs:
            out.append(fn(j))
            tell(len(out), len(jobs))
        return out
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context) as pool:
        for result in pool.map(fn, jobs):
            out.append(result)
            tell(len(out), len(jobs))
    return out


# ---------------------------------------------------------------------------- tuning


def tune_load(
    setting: LoadSetting,
    policies: Sequence[PolicyConfig],
    rate_per_s: float,
    seeds: Sequence[int] = TUNE_SEEDS,
    workers: int = 1,
    on_done: Progress | None = None,
) -> dict[str, Tuned]:
    """Each policy's :class:`Tuned` on the tune part at ``rate_per_s`` (module docstring):
    the tuning protocol's grid and rule, with open-loop arrivals for the workload."""
    check_rate(rate_per_s)
    if not seeds:
        raise ConfigError("name at least one tune seed")
    plan = [(p, point) for p in policies for point in grid(p)]
    jobs = [
        Job(setting, with_knobs(p, point), Part.TUNE, rate_per_s, seed)
        for p, point in plan
        for seed in seeds
    ]
    played = iter(execute_all(play, jobs, workers, on_done))
    trials: dict[str, list[Trial]] = {p.name: [] for p in policies}
    for p, point in plan:
        runs = [next(played) for _ in seeds]
        p50 = tuple(percentile(list(r.sct_s.values()), 50) for r in runs)
        p95 = tuple(percentile(list(r.sct_s.values()), 95) for r in runs)
        trials[p.name].append(Trial(point, p50, p95))
    out = {}
    for p in policies:
        ts = trials[p.name]
        pick = best([(t.mean_p50_s, t.mean_p95_s) for t in ts], TIE)
        out[p.name] = Tuned(p.name, ts[pick].knobs, tuple(ts))
    return out


def untuned(policies: Sequence[PolicyConfig]) -> dict[str, Tuned]:
    """Each policy at its defaults, recorded as a tuning of one trial-less setting."""
    return {p.name: Tuned(p.name, MappingProxyType(knobs_of(p)), ()) for p in policies}


# ---------------------------------------------------------------------------- metrics


def point_metrics(
    played: Sequence[Played], isolated: Mapping[tuple[str, str], float], setting: LoadSetting
) -> dict[str, Any]:
    """One (policy, rate) point: each figure the mean over its seeds' runs."""
    per_seed = [_seed_metrics(p, isolated, setting) for p in played]
    out: dict[str, Any] = {k: float(np.mean([m[k] for m in per_seed])) for k in per_seed[0]}
    out["per_seed"] = per_seed
    return out


def _seed_metrics(
    p: Played, isolated: Mapping[tuple[str, str], float], setting: LoadSetting
) -> dict[str, float]:
    scts = list(p.sct_s.values())
    hours = max(p.end_s, 1e-9) / 3600
    met = sum(
        1 for sid, sct in p.sct_s.items() if sct <= setting.slo_factor * isolated[p.trace_keys[sid]]
    )
    n = len(scts)
    return {
        "sessions": float(n),
        "sct_p50_s": percentile(scts, 50),
        "sct_p95_s": percentile(scts, 95),
        "ttft_p95_s": p.ttft_p95_s,
        "cold_starts": float(p.counters.get("cold_loads", 0)),
        "cold_starts_per_h": p.counters.get("cold_loads", 0) / hours,
        "device_busy_s_per_session": p.counters.get("device_busy_ms", 0) / 1000 / n,
        "device_held_s_per_session": p.counters.get("device_held_ms", 0) / 1000 / n,
        "scale_to_zero_per_h": p.counters.get("scale_to_zero", 0) / hours,
        "device_provisioned_s_per_session": setting.devices * p.end_s / n,
        "goodput_sessions_per_h": met / hours,
        "slo_met_share": met / n,
        "makespan_s": p.end_s,
    }


def doubling_rate(rates: Sequence[float], p95s: Sequence[float]) -> float | None:
    """The rate at which SCT p95 reaches twice its value at the lowest rate, interpolated
    linearly between the points around it (rates ascending); None if it never does."""
    if len(rates) != len(p95s) or not rates:
        raise BadRequest("doubling_rate needs one p95 per rate")
    return rate_reaching(rates, p95s, 2 * p95s[0])


def rate_reaching(rates: Sequence[float], p95s: Sequence[float], bound: float) -> float | None:
    """The rate at which SCT p95 first reaches ``bound`` past the lowest rate, interpolated
    linearly between the points around it (rates ascending); None if it never does (or
    where the lowest rate's p95 is already at the bound: no load is light enough). One
    bound for several policies compares them at the same p95 (``doubling_rate`` sets each
    its own, twice its light-load value)."""
    if len(rates) != len(p95s) or not rates:
        raise BadRequest("rate_reaching needs one p95 per rate")
    if p95s[0] >= bound:
        return None
    for i in range(1, len(rates)):
        if p95s[i] >= bound:
            lo, hi = p95s[i - 1], p95s[i]
            return rates[i - 1] + (bound - lo) / (hi - lo) * (rates[i] - rates[i - 1])
    return None


def with_intervals(policies: Mapping[str, Any]) -> dict[str, Any]:
    """The sweep's ``policies`` document with what its seeds say about each figure added
    (the first policy is the reference; nothing else changes):

    * each point's ``intervals``: the mean over seeds of each of ``INTERVAL_METRICS`` with
      its 95% t-interval (``stats.mean_interval``; no bounds with one seed);
    * each point's ``sct_p95_ratio_to_reference``: the policy's SCT p95 over the reference
      policy's at that rate, paired seed by seed (``stats.ratio_interval``);
    * each policy's ``sct_p95_doubling_rate_per_seed``: the doubling rate of each seed's
      own p95 curve (None where it does not double within the sweep).

    Pure: reads the points' ``per_seed`` figures, so an earlier run's JSON gains them too."""
    out = {name: dict(entry) for name, entry in policies.items()}
    if not out:
        return out
    reference = next(iter(out.values()))["points"]
    for entry in out.values():
        points = [dict(pt) for pt in entry["points"]]
        for pt, ref in zip(points, reference, strict=True):
            seeds = pt["per_seed"]
            pt["intervals"] = {
                k: mean_interval([m[k] for m in seeds]).to_json() for k in INTERVAL_METRICS
            }
            pt["sct_p95_ratio_to_reference"] = ratio_interval(
                [m["sct_p95_s"] for m in seeds], [m["sct_p95_s"] for m in ref["per_seed"]]
            ).to_json()
        rates = [pt["rate_per_s"] for pt in points]
        n_seeds = len(points[0]["per_seed"])
        entry["sct_p95_doubling_rate_per_seed"] = [
            doubling_rate(rates, [pt["per_seed"][i]["sct_p95_s"] for pt in points])
            for i in range(n_seeds)
        ]
        entry["points"] = points
    return out


# ---------------------------------------------------------------------------- the sweep


def check_rates(rates: Sequence[float]) -> list[float]:
    """Rates ascending; ``BadRequest`` for none, a rate <= 0 or a repeated rate."""
    if not rates:
        raise BadRequest("name at least one arrival rate")
    out = sorted(check_rate(r) for r in rates)
    if len(set(out)) != len(out):
        raise BadRequest(f"arrival rates must differ, got {list(rates)}")
    return out


def isolated_times(
    setting: LoadSetting,
    seeds: Sequence[int],
    rate: float,
    workers: int = 1,
    on_done: Progress | None = None,
    part: Part = Part.TEST,
) -> dict[tuple[str, str], float]:
    """Each (trace session, model) pair ``part``'s arrivals draw: its isolated SCT."""
    scripts: dict[tuple[str, str], SessionScript] = {}
    for seed in seeds:
        load = open_load(setting, part, rate, seed)
        by = load.by_session
        for s in load.scripts:
            scripts.setdefault(_key(by[s.session_id]), s)
    keys = sorted(scripts)
    times = execute_all(_isolated_job, [(setting, scripts[k]) for k in keys], workers, on_done)
    return dict(zip(keys, times, strict=True))


def sweep(
    setting: LoadSetting,
    policies: Sequence[PolicyConfig],
    rates: Sequence[float],
    tuned: Mapping[str, Tuned],
    seeds: Sequence[int] = (0,),
    workers: int = 1,
    on_done: Progress | None = None,
) -> dict[str, Any]:
    """Every tuned policy at every rate on the test part: the ``policies`` part of the
    document (points, doubling rate, knobs) and the isolated times used."""
    ordered = check_rates(rates)
    if not seeds:
        raise ConfigError("name at least one seed")
    chosen = [with_knobs(p, tuned[p.name].knobs) for p in policies]
    isolated = isolated_times(setting, seeds, ordered[0], workers, on_done)
    jobs = [Job(setting, p, Part.TEST, r, s) for p in chosen for r in ordered for s in seeds]
    played = iter(execute_all(play, jobs, workers, on_done))
    out: dict[str, Any] = {}
    for p in chosen:
        points = []
        for r in ordered:
            entry = point_metrics([next(played) for _ in seeds], isolated, setting)
            points.append({"rate_per_s": r, **entry})
        p95 = [pt["sct_p95_s"] for pt in points]
        out[p.name] = {
            "knobs": dict(tuned[p.name].knobs),
            "points": points,
            "sct_p95_doubling_rate_per_s": doubling_rate(ordered, p95),
        }
    return {
        "policies": with_intervals(out),
        "isolated_s": {f"{k[0]} @ {k[1]}": v for k, v in isolated.items()},
    }


def tuning_document(
    tuned: Mapping[str, Tuned], rate: float | None, seeds: Sequence[int]
) -> dict[str, Any]:
    """The tuning as the results carry it (``{"tuned": false}`` without a rate)."""
    if rate is None:
        return {"tuned": False, "why": "run with --no-tune: every policy at its defaults"}
    return {
        "tuned": True,
        "part": Part.TUNE.value,
        "rate_per_s": rate,
        "seeds": list(seeds),
        "rule": RULE,
        "policies": {name: t.to_json() for name, t in tuned.items()},
    }
