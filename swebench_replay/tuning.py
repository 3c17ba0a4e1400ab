"""The tuning protocol: every policy at its best setting of its own knobs, chosen on the tune
part of the sessions only, before any comparison runs.

For each policy, every setting of :func:`talaria.policy.knobs.grid` is simulated on the tune
part under each tune seed; the chosen setting has the lowest mean SCT p50 over the seeds,
ties (within 1%) going to the lowest mean SCT p95, then to the earliest in grid order
(:func:`talaria.policy.knobs.best`). A tuning reads the tune part and nothing else: it
refuses a workload of any other part.

A tuning is cached under a key of everything it depends on (the workload, the setting, the
policies' defaults, the seeds, the grids and the source of the code that decides the
outcome), in ``$TALARIA_CACHE_DIR/tuned`` (see :func:`talaria.config.cache_dir`), and written
into each comparison's ``results.json`` with every setting tried and its scores.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs

import talaria
from talaria.calibration.cache import source_hash
from talaria.config import PolicyConfig, cache_dir
from talaria.errors import ConfigError
from talaria.policy import knobs as knob_grids
from talaria.policy.knobs import Knobs, best, grid, with_knobs
from talaria.swebench_replay.runs import Outcome, Run, Setting, WorkloadSpec, execute_all
from talaria.swebench_replay.split import Part

TUNE_SEEDS = (0, 1, 2)
TIE = 0.01  # relative SCT p50 difference within which two settings tie
RULE = (
    "lowest mean SCT p50 over the tune seeds; settings within 1% of it tie, and the tie goes "
    "to the lowest mean SCT p95, then to the earliest in grid order"
)
# The code whose change can change a tuning's outcome (relative to the talaria package).
CODE = (
    "*.py",
    "policy/*.py",
    "memory/**/*.py",
    "runtime/*.py",
    "sim/*.py",
    "cost/*.py",
    "cost/*.json",
    "session/*.py",
    "session/*.json",
    "swebench_replay/*.py",
)


@attrs.frozen
class Trial:
    """One setting's scores: SCT p50 and p95 per tune seed (seconds)."""

    knobs: Knobs
    p50_s: tuple[float, ...]
    p95_s: tuple[float, ...]

    @property
    def mean_p50_s(self) -> float:
        return sum(self.p50_s) / len(self.p50_s)

    @property
    def mean_p95_s(self) -> float:
        return sum(self.p95_s) / len(self.p95_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "knobs": dict(self.knobs),
            "sct_p50_s": list(self.p50_s),
            "sct_p95_s": list(self.p95_s),
            "mean_sct_p50_s": self.mean_p50_s,
            "mean_sct_p95_s": self.mean_p95_s,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Trial:
        return cls(
            MappingProxyType(dict(doc["knobs"])),
            tuple(float(x) for x in doc["sct_p50_s"]),
            tuple(float(x) for x in doc["sct_p95_s"]),
        )


@attrs.frozen
class Tuned:
    """A policy's tuning: the chosen ``knobs`` and every ``trial`` (grid order)."""

    policy: str
    knobs: Knobs
    trials: tuple[Trial, ...]

    def to_json(self) -> dict[str, Any]:
        return {"knobs": dict(self.knobs), "trials": [t.to_json() for t in self.trials]}

    @classmethod
    def from_json(cls, name: str, doc: Mapping[str, Any]) -> Tuned:
        trials = tuple(Trial.from_json(t) for t in doc["trials"])
        return cls(name, MappingProxyType(dict(doc["knobs"])), trials)


def tuning_runs(
    workload: WorkloadSpec,
    setting: Setting,
    policies: Sequence[PolicyConfig],
    seeds: Sequence[int] = TUNE_SEEDS,
) -> list[Run]:
    """Every simulation a tuning needs: each policy's every setting under every seed."""
    if workload.part is not Part.TUNE:
        raise ConfigError(
            f"a tuning reads the tune part only; got a workload of the {workload.part.value} part"
        )
    if not seeds:
        raise ConfigError("name at least one tune seed")
    return [
        Run(workload, seed, setting, with_knobs(policy, point))
        for policy in policies
        for point in grid(policy)
        for seed in seeds
    ]


def choose(
    policies: Sequence[PolicyConfig], seeds: Sequence[int], outcomes: Sequence[Outcome]
) -> dict[str, Tuned]:
    """Each policy's tuning from the outcomes of its :func:`tuning_runs` (in their order)."""
    out: dict[str, Tuned] = {}
    it = iter(outcomes)
    for policy in policies:
        trials = []
        for point in grid(policy):
            entries = [next(it).entries[policy.name] for _ in seeds]
            trials.append(
                Trial(
                    point,
                    tuple(e["sct_p50_s"] for e in entries),
                    tuple(e["sct_p95_s"] for e in entries),
                )
            )
        pick = best([(t.mean_p50_s, t.mean_p95_s) for t in trials], TIE)
        out[policy.name] = Tuned(policy.name, trials[pick].knobs, tuple(trials))
    return out


def tune(
    workload: WorkloadSpec,
    setting: Setting,
    policies: Sequence[PolicyConfig],
    seeds: Sequence[int] = TUNE_SEEDS,
    jobs: int = 1,
    on_done: Callable[[Outcome], None] | None = None,
) -> dict[str, Tuned]:
    """Tune every policy on ``workload`` (the tune part) in ``setting`` (module docstring)."""
    runs = tuning_runs(workload, setting, policies, seeds)
    return choose(policies, seeds, execute_all(runs, jobs, on_done))


def tuned_policies(
    policies: Sequence[PolicyConfig], tuned: Mapping[str, Tuned]
) -> tuple[PolicyConfig, ...]:
    """``policies`` at their tuned knobs; a policy without a tuning raises ``ConfigError``."""
    missing = [p.name for p in policies if p.name not in tuned]
    if missing:
        raise ConfigError(f"no tuning for {missing}: run `talaria tune` with these policies")
    return tuple(with_knobs(p, tuned[p.name].knobs) for p in policies)


# ------------------------------------------------------------------------------- cache


def cache_key(
    workload: WorkloadSpec,
    setting: Setting,
    policies: Sequence[PolicyConfig],
    seeds: Sequence[int],
) -> str:
    """A digest of everything a tuning's outcome depends on (module docstring)."""
    doc = {
        "workload": workload.to_json(),
        "setting": attrs.asdict(setting),
        "policies": [attrs.asdict(p) for p in policies],
        "seeds": list(seeds),
        "grids": [
            knob_grids.QUANTUM_S,
            knob_grids.LINGER_S,
            knob_grids.STARVATION_S,
            knob_grids.PREEMPT_RATIO,
            knob_grids.LOAD_CAP,
            TIE,
        ],
    }
    code = source_hash(Path(talaria.__file__).parent, CODE, {})
    text = json.dumps(doc, sort_keys=True, default=str) + code
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_file(key: str, directory: Path | None = None) -> Path:
    return (cache_dir() if directory is None else directory) / "tuned" / f"tuned-{key}.json"


def to_document(tuned: Mapping[str, Tuned], key: str, seeds: Sequence[int]) -> dict[str, Any]:
    """A tuning as the JSON ``talaria tune`` writes and a comparison embeds."""
    return {
        "key": key,
        "part": Part.TUNE.value,
        "seeds": list(seeds),
        "rule": RULE,
        "policies": {name: t.to_json() for name, t in tuned.items()},
    }


def from_document(doc: Mapping[str, Any]) -> dict[str, Tuned]:
    """The tunings of a document :func:`to_document` wrote; ``ConfigError`` if it is not one."""
    try:
        return {name: Tuned.from_json(name, t) for name, t in doc["policies"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"not a tuning document ({type(exc).__name__}: {exc})") from None


def read_cached(key: str, directory: Path | None = None) -> dict[str, Any] | None:
    """The cached tuning document of ``key``, or None (absent or unreadable)."""
    path = cache_file(key, directory)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("key") == key else None


def write_cached(doc: Mapping[str, Any], directory: Path | None = None) -> Path:
    path = cache_file(str(doc["key"]), directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path
