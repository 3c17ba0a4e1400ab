"""Real-engine replay on vLLM: the embedded replay's sessions, with vLLM engines executing.

The same session scripts (``driver.to_scripts``) play in real wall time against a
:class:`~talaria.runtime.live.LiveCluster` whose one instance is a
:class:`~talaria.backends.vllm.executor.VllmExecutor` (``talaria replay --substrate
vllm``). Answers are teacher-forced inside vLLM (the forcing logits processor), so each
next prompt finds its prefix in vLLM's cache as a real agent's would. The engines start once
(minutes on a CPU); every policy runs on a fresh cluster core over them, with vLLM's prefix
caches emptied in between, after one warm-up call per model. The simulator's prediction of
each run sits beside it (``fidelity``), priced by the shipped ``cpu`` profile (vLLM is not
calibrated here: the prediction prices Talaria's embedded engine on this machine class).
The document also records the backend's mechanisms, vLLM's switch timings and the drift
between vLLM's cached tokens and the core's account of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import attrs

from talaria.backends.vllm.catalog import VllmModel
from talaria.backends.vllm.cluster import VllmCluster, cluster_over
from talaria.backends.vllm.engines import EngineSet
from talaria.calibration.cache import shipped_calibration
from talaria.config import PolicyConfig
from talaria.errors import ConfigError
from talaria.sim.simulator import SimResult
from talaria.swebench_replay.driver import to_scripts
from talaria.swebench_replay.live_replay import (
    NO_HOOKS,
    ReplayHooks,
    _fidelity,
    _play,
    _simulate,
    require_models,
    step_breakdown,
)
from talaria.swebench_replay.metrics import (
    add_ratios,
    check_conservation,
    policy_summary,
    results_document,
)
from talaria.swebench_replay.traces import ToolTimeTable
from talaria.swebench_replay.workload import ReplaySet
from talaria.types import SessionScript, TokenSeq


@attrs.frozen
class VllmReplayOptions:
    """The policies to compare and the vLLM models (``model_dirs.catalog_for`` writes the
    embedded replay's three) on one instance."""

    policies: tuple[PolicyConfig, ...]
    models: tuple[VllmModel, ...]
    gap_scale: float = 1.0
    hints: bool = True
    simulate: bool = True
    hardware: str = "cpu"
    host_memory_bytes: int = 6 * 10**9
    block_size: int = 16

    def __attrs_post_init__(self) -> None:
        if not self.policies:
            raise ConfigError("name at least one policy to replay")
        if not self.models:
            raise ConfigError("name at least one vLLM model")


def run_vllm_replay(
    replay: ReplaySet,
    options: VllmReplayOptions,
    tool_table: ToolTimeTable,
    hooks: ReplayHooks = NO_HOOKS,
) -> dict[str, Any]:
    """Every policy of ``options`` on ``replay`` in real time on vLLM engines: the
    ``results.json`` document (substrate ``vllm``)."""
    names = {m.name for m in options.models}
    require_models(replay, names, "the engines do not load")
    say = hooks.say
    for m in options.models:
        m.arch()  # a bad directory fails before vLLM starts
    engines = EngineSet(options.models, block_size=options.block_size)
    say(f"starting vLLM engines for {', '.join(sorted(names))} (minutes on a CPU)")
    engines.start(lambda name: say(f"  starting {name}"))
    try:
        return _replay_on(engines, replay, options, tool_table, hooks)
    finally:
        engines.close()


def _replay_on(
    engines: EngineSet,
    replay: ReplaySet,
    options: VllmReplayOptions,
    tool_table: ToolTimeTable,
    hooks: ReplayHooks,
) -> dict[str, Any]:
    say = hooks.say
    scripts = to_scripts(replay, tool_table, options.gap_scale, options.hints)
    tool_s = {s.session_id: sum(c.tool_seconds for c in s.calls) for s in scripts}
    say("warming up every model once")
    _warm_up(engines, options)
    policies: dict[str, dict[str, Any]] = {}
    fidelity: dict[str, dict[str, float]] = {}
    step_costs: dict[str, dict[str, dict[str, float]]] = {}
    drift: dict[str, dict[str, float]] = {}
    switches: dict[str, dict[str, float]] = {}
    cluster: VllmCluster | None = None
    for policy in options.policies:
        say(f"replaying under {policy.name} in real time")
        engines.reset_prefix_cache()
        engines.switches.clear()
        cluster = _cluster(engines, policy, options)
        result, steps = anyio.run(_play, cluster, scripts, policy.name, hooks.tick(policy.name))
        check_conservation(result, replay.n_calls, tool_s)
        result = _moved_by_vllm(result, cluster, engines)
        policies[policy.name] = policy_summary(result)
        hooks.done(policy.name, result)
        step_costs[policy.name] = step_breakdown(steps)
        drift[policy.name] = _drift(cluster)
        switches[policy.name] = _switches(engines)
        if options.simulate:
            predicted = _simulate(cluster, policy, scripts)
            fidelity[policy.name] = _fidelity(policies[policy.name], policy_summary(predicted))
    add_ratios(policies)
    return _document(
        engines, replay, options, cluster, policies,
        fidelity=fidelity, step_costs=step_costs, drift=drift, switches=switches,
    )  # fmt: skip


def _document(
    engines: EngineSet,
    replay: ReplaySet,
    options: VllmReplayOptions,
    cluster: VllmCluster | None,
    policies: dict[str, dict[str, Any]],
    *,
    fidelity: dict[str, dict[str, float]],
    step_costs: dict[str, dict[str, dict[str, float]]],
    drift: dict[str, dict[str, float]],
    switches: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """The vLLM replay's ``results.json``: every policy's summary, the engines, the
    simulator's fidelity, step costs, KV drift and model switches."""
    specs = [cluster.core.instances[n].spec for n in cluster.core.instances] if cluster else []
    doc = results_document(
        "vllm", options.hardware, specs, replay, options.gap_scale, options.hints, policies
    )
    doc["engine"] = {
        "backend": "vllm",
        "models": {m.name: str(m.path) for m in options.models},
        "block_size": engines.block_size,
        "sleep_mode": engines.sleep_mode,
        "mechanisms": cluster.mechanisms() if cluster is not None else [],
    }
    doc["fidelity"] = fidelity
    doc["calibration"] = shipped_calibration().describe()
    doc["step_costs"] = step_costs
    doc["kv_drift"] = drift
    doc["switches"] = switches
    doc["tuning"] = {
        "tuned": False,
        "why": "the vLLM replay checks the backend and the simulator's fidelity, not the "
        "policies: it runs them at their default knobs",
    }
    return doc


def _cluster(engines: EngineSet, policy: PolicyConfig, options: VllmReplayOptions) -> VllmCluster:
    return cluster_over(
        engines,
        policy,
        hardware=options.hardware,
        host_memory_bytes=options.host_memory_bytes,
    )


def _warm_up(engines: EngineSet, options: VllmReplayOptions) -> None:
    """One short forced call per model through a throwaway cluster: vLLM compiles the
    shapes it meets first here, not inside a timed policy."""
    cluster = _cluster(engines, options.policies[0], options)
    scripts = [
        SessionScript(
            f"warm-{m.name}",
            m.name,
            0.0,
            (_warm_call(),),
        )
        for m in options.models
    ]
    anyio.run(_play, cluster, scripts, "warm-up", NO_HOOKS.tick("warm-up"))


def _warm_call() -> Any:
    from talaria.types import ScriptedCall

    prompt = TokenSeq(range(1, 200))
    return ScriptedCall(prompt, prompt.extend(range(200, 204)), 4, 4)


def _moved_by_vllm(result: SimResult, cluster: VllmCluster, engines: EngineSet) -> SimResult:
    """The run's counters with the bytes vLLM really moved: the core plans KV moves and
    weight copies, but vLLM manages its own cache (no Talaria move runs) and a switch moves
    the woken model's weights only with sleep mode. The planned bytes stay beside them."""
    config = cluster.core.cluster
    woke = sum(config.model(s.woke).weight_bytes for s in engines.switches if s.wake_s > 0)
    counters = dict(result.counters)
    counters["planned_kv_bytes_moved"] = counters.get("kv_bytes_moved", 0)
    counters["planned_weight_bytes_moved"] = counters.get("weight_bytes_moved", 0)
    counters["kv_bytes_moved"] = 0
    counters["weight_bytes_moved"] = woke
    return attrs.evolve(result, counters=counters)


def _drift(cluster: VllmCluster) -> dict[str, float]:
    """vLLM's cached prompt tokens against the core's account, summed over the run's calls
    (``drift`` = core - vLLM; positive: the core believed more was cached)."""
    rows = [d for inst in cluster.core.instances.values() for d in inst.kv_drift]
    vllm = sum(d.engine_cached for d in rows)
    ours = sum(d.core_cached for d in rows)
    exact = sum(1 for d in rows if d.drift == 0)
    return {
        "calls": len(rows),
        "vllm_cached_tokens": vllm,
        "talaria_cached_tokens": ours,
        "drift_tokens": ours - vllm,
        "calls_exact": exact,
        "mean_abs_drift_tokens": (sum(abs(d.drift) for d in rows) / len(rows)) if rows else 0.0,
    }


def _switches(engines: EngineSet) -> dict[str, float]:
    s: Sequence[Any] = engines.switches
    return {
        "count": len(s),
        "sleep_s": sum(x.sleep_s for x in s),
        "wake_s": sum(x.wake_s for x in s),
        "max_s": max((x.sleep_s + x.wake_s for x in s), default=0.0),
    }
