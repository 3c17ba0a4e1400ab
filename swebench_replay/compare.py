"""An honest comparison: every policy at its tuned knobs, on the test part, over several
seeds, with intervals.

Each seed draws another sample of sessions from the test part (and another model
assignment, token ids and tool-time fills); every policy replays every seed. A policy's
entry in ``results.json`` holds the mean over seeds of every figure of a one-run entry
(``sct_p50_s`` is the mean of the seeds' SCT p50), the 95% interval of SCT p50 and p95
(``sct_p50_s_ci95``), each seed's figures (``per_seed``), its knobs and the paired ratio
``<policy> / talaria`` of SCT p50 and p95 over the same seeds (geometric mean and
interval: above 1, talaria is faster). ``comparison`` names the best per-request baseline
at p50 and at p95 (by mean) and talaria's ratio to it, and talaria's ratio to the
model-serial reference. The session SCTs of all seeds are pooled for the CDF plot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from talaria.config import PolicyConfig
from talaria.errors import ConfigError
from talaria.policy.baselines import BASELINES, POOL_BASELINES, TALARIA
from talaria.policy.knobs import knobs_of
from talaria.sim.simulator import SimResult
from talaria.swebench_replay.metrics import add_ratios, results_document
from talaria.swebench_replay.references import REFERENCES, add_bound_ratios
from talaria.swebench_replay.runs import (
    Outcome,
    Run,
    RunKind,
    Setting,
    WorkloadSpec,
    workload,
)
from talaria.swebench_replay.split import Part
from talaria.swebench_replay.stats import Interval, mean_interval, ratio_interval

TEST_SEEDS = (0, 1, 2, 3, 4)
PER_REQUEST = tuple(b for b in (*BASELINES, *POOL_BASELINES) if b != "round")


def comparison_runs(
    spec: WorkloadSpec,
    setting: Setting,
    policies: Sequence[PolicyConfig],
    seeds: Sequence[int] = TEST_SEEDS,
    references: bool = True,
    keep: Sequence[str] = (),
) -> list[Run]:
    """Every simulation of a comparison: each policy under each seed; talaria again with
    clients that send no hints (when it runs with hints); the references under each seed.
    ``keep``: policies whose first seed's whole result comes back."""
    if spec.part is Part.TUNE:
        raise ConfigError("a comparison never runs on the tune part: use the test part")
    if not seeds:
        raise ConfigError("name at least one seed")
    runs = []
    for seed in seeds:
        for p in policies:
            runs.append(Run(spec, seed, setting, p, keep=p.name in keep and seed == seeds[0]))
        talaria = next((p for p in policies if p.name == TALARIA.name), None)
        if talaria is not None and setting.hints:
            runs.append(Run(spec, seed, setting, talaria, RunKind.NO_HINTS))
        if references:
            runs.append(Run(spec, seed, setting, talaria or TALARIA, RunKind.REFERENCES))
    return runs


def _mean_entry(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The mean over seeds of every number of a one-run entry; SCT lists pooled."""
    out: dict[str, Any] = {}
    for key, value in entries[0].items():
        if key == "session_sct_s":
            out[key] = sorted(x for e in entries for x in e[key])
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            out[key] = value
        else:
            out[key] = sum(float(e[key]) for e in entries) / len(entries)
    return out


def _interval_json(iv: Interval) -> list[float | None]:
    return [iv.low, iv.high]


def _per_seed(seeds: Sequence[int], entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    keys = ("sct_p50_s", "sct_p95_s", "sct_mean_s", "ttft_p50_s", "ttft_p95_s")
    return [
        {"seed": seed, **{k: e[k] for k in keys}} for seed, e in zip(seeds, entries, strict=True)
    ]


def summarize(
    seeds: Sequence[int],
    outcomes: Sequence[Outcome],
    on_result: Callable[[str, SimResult], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """The ``policies`` section of a comparison from its runs' outcomes."""
    by_name: dict[str, list[Mapping[str, Any]]] = {}
    knobs: dict[str, dict[str, Any]] = {}
    for outcome in outcomes:
        for name, entry in outcome.entries.items():
            by_name.setdefault(name, []).append(entry)
            if outcome.run.kind is not RunKind.REFERENCES:
                knobs[name] = knobs_of(outcome.run.policy)
        if outcome.result is not None and on_result is not None:
            on_result(outcome.run.policy.name, outcome.result)
    out: dict[str, dict[str, Any]] = {}
    for name, entries in by_name.items():
        entry = _mean_entry(entries)
        for key in ("sct_p50_s", "sct_p95_s", "ttft_p95_s"):
            entry[f"{key}_ci95"] = _interval_json(mean_interval([e[key] for e in entries]))
        entry["per_seed"] = _per_seed(seeds, entries)
        if name in knobs:
            entry["knobs"] = knobs[name]
        out[name] = entry
    _paired_ratios(out, by_name)
    add_bound_ratios(out)
    add_ratios(out)
    return out


def _paired_ratios(
    out: dict[str, dict[str, Any]], by_name: Mapping[str, Sequence[Mapping[str, Any]]]
) -> None:
    """Each policy's paired ratio to talaria (``vs_talaria``: its SCT over talaria's, per
    seed), when talaria ran."""
    ours = by_name.get(TALARIA.name)
    if ours is None:
        return
    for name, entries in by_name.items():
        out[name]["vs_talaria"] = {
            q: ratio_interval(
                [e[f"sct_{q}_s"] for e in entries], [e[f"sct_{q}_s"] for e in ours]
            ).to_json()
            for q in ("p50", "p95")
        }


def headline(policies: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The comparison's headline: the best per-request baseline at p50 and at p95 (by mean)
    and talaria's paired ratio to it, and to ``round`` and the model-serial reference."""
    out: dict[str, Any] = {}
    if TALARIA.name not in policies:
        return out
    baselines = [n for n in PER_REQUEST if n in policies]
    for q in ("p50", "p95"):
        if baselines:
            best = min(baselines, key=lambda n: policies[n][f"sct_{q}_s"])
            out[f"best_per_request_{q}"] = {
                "policy": best,
                "ratio": policies[best]["vs_talaria"][q],
            }
        for other in ("round", *REFERENCES):
            if other in policies and "vs_talaria" in policies[other]:
                out[f"{other}_{q}"] = {"ratio": policies[other]["vs_talaria"][q]}
    return out


def comparison_document(
    substrate: str,
    hardware: str,
    spec: WorkloadSpec,
    setting: Setting,
    seeds: Sequence[int],
    policies: Mapping[str, dict[str, Any]],
    tuning: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """``results.json`` of a comparison (docs/design.md's results format, entries averaged over
    seeds, plus ``seeds``, ``tuning`` and ``comparison``)."""
    first = workload(spec, seeds[0])
    doc = results_document(
        substrate,
        hardware,
        setting.cluster.instances,
        first.replay,
        setting.gap_scale,
        setting.hints,
        policies,
    )
    doc["workload"].update({"source": first.source, "part": spec.part.value, "seeds": list(seeds)})
    doc["seeds"] = list(seeds)
    doc["tuning"] = dict(tuning) if tuning is not None else {"tuned": False}
    doc["comparison"] = headline(policies)
    return doc
