"""Simulated replays as plain, picklable jobs: one policy, one seed, one setting each.

Tuning and comparing run hundreds of simulations that do not depend on each other, so each
is described by a :class:`Run` (what workload, which seed, which cluster, which policy) and
executed by :func:`execute`, in this process or in worker processes
(:func:`execute_all`, ``jobs`` at a time). A run's outcome is the ``results.json`` entry
of its policy (and the references' entries for a reference run); the whole
:class:`~talaria.sim.simulator.SimResult` comes back only when asked (``keep``: the
timeline plot draws it).

A worker builds each (workload, seed) once and keeps it (:func:`workload`).
"""

from __future__ import annotations

import enum
import functools
import multiprocessing
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import attrs

from talaria.config import ClusterConfig, PolicyConfig
from talaria.cost import HardwareProfile, cluster_estimators
from talaria.cost.estimator import Estimator
from talaria.errors import ConfigError
from talaria.session.gaps import GapPredictor
from talaria.sim.simulator import SimResult, Simulator
from talaria.swebench_replay.driver import simulate, to_scripts
from talaria.swebench_replay.metrics import policy_summary
from talaria.swebench_replay.references import reference_entries
from talaria.swebench_replay.setup import Workload, load_workload
from talaria.swebench_replay.split import Part


@attrs.frozen
class WorkloadSpec:
    """Which sessions a replay plays (the arguments of :func:`load_workload` but the seed)."""

    trace: Path | None = None
    synthetic: bool = False
    part: Part = Part.ALL
    sessions: int = 30
    calls: int = 960
    arrival: str = "all"
    models: tuple[str, ...] | None = None
    max_context: int | None = None
    token_scale: float = 1.0
    vocab_size: int = 32000

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["trace"] = None if self.trace is None else str(self.trace)
        out["part"] = self.part.value
        out["models"] = None if self.models is None else list(self.models)
        return out


@functools.lru_cache(maxsize=64)
def workload(spec: WorkloadSpec, seed: int) -> Workload:
    """The replay set of ``spec`` under ``seed`` (built once per process)."""
    return load_workload(
        trace=spec.trace,
        synthetic=spec.synthetic,
        n_sessions=spec.sessions,
        target_calls=spec.calls,
        seed=seed,
        arrival=spec.arrival,
        models=spec.models,
        max_context=spec.max_context,
        token_scale=spec.token_scale,
        vocab_size=spec.vocab_size,
        part=spec.part,
    )


@attrs.frozen
class Setting:
    """Where a replay runs in the simulator: the cluster, the hardware profiles that replace
    shipped ones (a calibration of this machine), and how clients behave (tool gaps scaled
    by ``gap_scale``; tool-start hints or none)."""

    cluster: ClusterConfig
    hardware: tuple[HardwareProfile, ...] = ()
    gap_scale: float = 1.0
    hints: bool = True

    def estimators(self) -> dict[str, Estimator]:
        return cluster_estimators(self.cluster, {h.name: h for h in self.hardware})


class RunKind(enum.Enum):
    POLICY = "policy"  # the policy as the clients behave in the setting
    NO_HINTS = "no-hints"  # the policy with clients that send no tool-gap hints
    REFERENCES = "references"  # the isolated and model-serial references, the policy inside


@attrs.frozen
class Run:
    """One simulation to execute (see the module docstring)."""

    workload: WorkloadSpec
    seed: int
    setting: Setting
    policy: PolicyConfig
    kind: RunKind = RunKind.POLICY
    keep: bool = False  # hand the whole SimResult back (policy runs only)


@attrs.frozen
class Outcome:
    """What a run produced: ``entries`` by name (the policy's, ``<policy>-no-hints``, or the
    references'), and the whole result when the run asked to keep it."""

    run: Run
    entries: dict[str, dict[str, Any]]
    result: SimResult | None = None


def execute(run: Run) -> Outcome:
    """Simulate ``run`` (deterministic: the same run gives the same outcome)."""
    w = workload(run.workload, run.seed)
    setting = run.setting
    hints = setting.hints and run.kind is not RunKind.NO_HINTS
    scripts = to_scripts(w.replay, w.tool_table, setting.gap_scale, hints)
    if run.kind is RunKind.REFERENCES:
        alone = Simulator(
            setting.cluster, run.policy, setting.estimators(), learner=GapPredictor.default
        )
        return Outcome(run, reference_entries(scripts, alone.run, run.policy.name))
    result = simulate(w.replay, scripts, run.policy, setting.cluster, setting.estimators())
    entry = policy_summary(result)
    name = run.policy.name
    if run.kind is RunKind.NO_HINTS:
        entry["hints"] = False
        name = f"{name}-no-hints"
    return Outcome(run, {name: entry}, result if run.keep else None)


def default_jobs() -> int:
    """Worker processes to use: the CPUs this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def execute_all(
    runs: Sequence[Run], jobs: int = 1, on_done: Callable[[Outcome], None] | None = None
) -> list[Outcome]:
    """Every run's outcome, in the order of ``runs``; ``jobs`` > 1 runs them in that many
    worker processes (started fresh: ``spawn``). ``on_done`` is told of each as it ends."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be a positive integer, got {jobs!r}")
    done: Callable[[Outcome], None] = on_done or (lambda _o: None)
    if jobs == 1 or len(runs) <= 1:
        outcomes = []
        for run in runs:
            outcomes.append(execute(run))
            done(outcomes[-1])
        return outcomes
    results: list[Outcome | None] = [None] * len(runs)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=context) as pool:
        futures = {pool.submit(execute, run): i for i, run in enumerate(_largest_first(runs))}
        order = _largest_first_index(runs)
        for future in as_completed(futures):
            outcome = future.result()
            results[order[futures[future]]] = outcome
            done(outcome)
    return [o for o in results if o is not None]


def _largest_first_index(runs: Sequence[Run]) -> list[int]:
    """Positions in ``runs`` sorted so that reference runs (several simulations each) start
    first and the pool's tail is short."""
    return sorted(range(len(runs)), key=lambda i: runs[i].kind is not RunKind.REFERENCES)


def _largest_first(runs: Sequence[Run]) -> Iterable[Run]:
    return (runs[i] for i in _largest_first_index(runs))
