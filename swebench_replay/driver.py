"""The replay driver: turn a replay set into session scripts and run them on a substrate.

Each session sends its calls in order, waits for the answer, runs its tool gap (the trace's
``tool_seconds``, times ``gap_scale``), tells the server what a client would know about the
gap (``tool_start`` with the tool kind's typical duration: a client predicts, it does not
know the future), and ends with an ``end`` event. The simulator executes the scripts in
virtual time against the real policy and memory code.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from talaria.config import ClusterConfig, PolicyConfig
from talaria.cost import cluster_estimators
from talaria.cost.estimator import Estimator
from talaria.errors import ConfigError
from talaria.policy.baselines import TALARIA
from talaria.session.gaps import GapPredictor
from talaria.sim.catalog import paper_cluster
from talaria.sim.simulator import SimResult, Simulator
from talaria.swebench_replay.metrics import (
    add_ratios,
    check_conservation,
    policy_summary,
    results_document,
)
from talaria.swebench_replay.references import add_bound_ratios, reference_entries
from talaria.swebench_replay.traces import ToolTimeTable
from talaria.swebench_replay.workload import ReplaySet
from talaria.types import ScriptedCall, SessionScript


class Substrate(enum.Enum):
    SIM = "sim"


@attrs.frozen
class ReplayOptions:
    """How to replay: where, on how many instances, which policies, gap scaling."""

    policies: tuple[PolicyConfig, ...]
    hardware: str = "h200-tp8"
    n_instances: int = 1
    gap_scale: float = 1.0
    hints: bool = True
    substrate: Substrate = Substrate.SIM
    references: bool = True  # compute the isolated and model-serial references too
    no_hints_run: bool = True  # with hints on, also replay talaria without them

    def __attrs_post_init__(self) -> None:
        if not self.policies:
            raise ConfigError("name at least one policy to replay")
        if not self.gap_scale > 0:
            raise ConfigError(f"gap_scale must be positive, got {self.gap_scale}")


def to_scripts(
    replay: ReplaySet, tool_table: ToolTimeTable, gap_scale: float = 1.0, hints: bool = True
) -> list[SessionScript]:
    """The replay set as session scripts: tool gaps scaled by ``gap_scale``, and the hints
    clients send (each tool kind's median time) scaled alike."""
    scripts = []
    for s in replay.sessions:
        calls = tuple(
            ScriptedCall(
                prompt=c.prompt,
                history=c.history,
                output_tokens=c.output_tokens,
                max_new_tokens=c.output_tokens,
                tool_seconds=c.tool_seconds * gap_scale,
                tool_kind=c.tool_kind.value,
                # a client hints its tool's typical time in the world it runs in: scaled too
                hint_s=tool_table.dist(c.tool_kind).median * gap_scale if hints else None,
            )
            for c in s.calls
        )
        scripts.append(SessionScript(s.session_id, s.model, s.start_s, calls))
    return scripts


def cluster_for(hardware: str, n_instances: int) -> ClusterConfig:
    """The cluster a replay runs on: the paper-scale catalog on ``h200-tp8``."""
    if hardware != "h200-tp8":
        raise ConfigError(
            f"the simulated replay runs on hardware 'h200-tp8' (the paper-scale catalog); "
            f"got {hardware!r}"
        )
    return paper_cluster(n_instances)


def estimators_for(cluster: ClusterConfig) -> dict[str, Estimator]:
    return cluster_estimators(cluster)


def simulate(
    replay: ReplaySet,
    scripts: Sequence[SessionScript],
    policy: PolicyConfig,
    cluster: ClusterConfig,
    estimators: Mapping[str, Estimator] | None = None,
    on_call_done: Callable[[int], None] | None = None,
) -> SimResult:
    """One policy through the simulator (priced by ``estimators``, default the shipped
    profiles'), with the conservation checks of the replay."""
    prices = estimators if estimators is not None else estimators_for(cluster)
    sim = Simulator(cluster, policy, prices, learner=GapPredictor.default)
    result = sim.run(scripts, on_call_done)
    tool_s = {s.session_id: sum(c.tool_seconds for c in s.calls) for s in scripts}
    check_conservation(result, replay.n_calls, tool_s)
    return result


def run_replay(
    replay: ReplaySet,
    options: ReplayOptions,
    tool_table: ToolTimeTable,
    on_progress: Callable[[str, int], None] | None = None,
    on_result: Callable[[str, SimResult], None] | None = None,
) -> dict[str, Any]:
    """Every policy of ``options`` on ``replay``: the ``results.json`` document.
    ``on_result(name, result)`` is handed each policy's full result, the references' not:
    every call's timings and every slot, which the timeline plot draws and which are too
    large for the document."""
    cluster = cluster_for(options.hardware, options.n_instances)
    scripts = to_scripts(replay, tool_table, options.gap_scale, options.hints)
    policies: dict[str, dict[str, Any]] = {}
    for policy in options.policies:

        def tick(n: int, name: str = policy.name) -> None:
            if on_progress is not None:
                on_progress(name, n)

        result = simulate(replay, scripts, policy, cluster, on_call_done=tick)
        policies[policy.name] = policy_summary(result)
        if on_result is not None:
            on_result(policy.name, result)
    talaria = next((p for p in options.policies if p.name == TALARIA.name), None)
    if options.hints and options.no_hints_run and talaria is not None:
        # the same sessions with clients that send no hints: the server's own gap learning
        untold = to_scripts(replay, tool_table, options.gap_scale, hints=False)
        untold_result = simulate(replay, untold, talaria, cluster)
        entry = policy_summary(untold_result)
        entry["hints"] = False
        policies[f"{talaria.name}-no-hints"] = entry
        if on_result is not None:
            on_result(f"{talaria.name}-no-hints", untold_result)
    if options.references:
        alone = Simulator(cluster, TALARIA, estimators_for(cluster), learner=GapPredictor.default)
        policies.update(reference_entries(scripts, alone.run, TALARIA.name))
        add_bound_ratios(policies)
    add_ratios(policies)
    return results_document(
        options.substrate.value,
        options.hardware,
        cluster.instances,
        replay,
        options.gap_scale,
        options.hints,
        policies,
    )
