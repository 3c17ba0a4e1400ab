"""Real-engine replay: scripted sessions against the live runtime on the embedded engine.

The same session scripts the simulator plays (``driver.to_scripts``) are played in real wall
time against a :class:`~talaria.runtime.live.LiveCluster` whose instance runs the embedded
PyTorch engine: each session waits for its start, sends its calls one after another (the
prompt token ids of the replay set), sleeps its tool gaps, sends the hints a client would
(``tool_start`` with the tool kind's typical duration) and ends with ``end``. Answers are
teacher-forced to the trace's answer ids (``LiveCluster.submit(forced=...)``): the engine
still runs every prefill chunk and decode step, and the next prompt, which the replay set
built from this answer, finds its prefix cached exactly as a real agent's would.

Every policy runs on a fresh cluster built from the same loaded weights (one warm-up pass
first, so no policy pays for first-touch allocation). For simulator fidelity the same scripts
also run through the simulator on the same cluster configuration, priced by the same
estimators as the live routers: the ``cpu`` profile of the calibration
(:func:`talaria.calibration.calibrate.calibrate`) that ``EmbeddedOptions.calibration`` asks
for. By default (``auto``) that is this machine's cached calibration when its key (machine
and code) matches, else one measured here first, on the weights already loaded, before any
policy runs; ``shipped`` takes the shipped profile, ``fresh`` measures again. A calibration
comes from engine microbenchmarks and raw machine rates only, never from replay results;
the results document's ``calibration`` entry says which one priced the prediction.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio
import attrs
import torch

from talaria.backends.embedded import cluster_from_loaded, load_catalog_model
from talaria.calibration.cache import Calibration, CalibrationMode
from talaria.calibration.calibrate import calibrate
from talaria.calibration.plan import CalibrationPlan
from talaria.clock import Clock, WallClock
from talaria.config import ClusterConfig, InstanceSpec, PolicyConfig
from talaria.core.cluster import ClusterCore
from talaria.core.counters import cluster_counters
from talaria.cost import cluster_estimators
from talaria.cost.estimator import Estimator
from talaria.cost.hardware import HardwareProfile
from talaria.engine.catalog import DEFAULT_MODELS
from talaria.engine.loader import LoadedModel
from talaria.engine.runner import flatten_weights
from talaria.engine.threads import in_own_thread
from talaria.engine.weight_files import WeightFiles
from talaria.errors import ConfigError, TalariaError
from talaria.executor import Executor, Layout, Work
from talaria.generation import SamplingParams, StopChecker
from talaria.policy.baselines import TALARIA
from talaria.policy.knobs import knobs_of
from talaria.runtime.live import LiveCluster
from talaria.runtime.local import LocalInstance
from talaria.runtime.step_log import StepTiming
from talaria.runtime.streams import Failed, Finished
from talaria.schedule import Executed, Request
from talaria.session.gaps import GapPredictor
from talaria.sim.simulator import SessionRecord, SimResult, Simulator, SlotLog, record_of
from talaria.swebench_replay.driver import to_scripts
from talaria.swebench_replay.metrics import (
    add_ratios,
    check_conservation,
    policy_summary,
    results_document,
)
from talaria.swebench_replay.references import add_bound_ratios, reference_entries
from talaria.swebench_replay.runs import Setting
from talaria.swebench_replay.traces import ToolTimeTable
from talaria.swebench_replay.tuning import from_document, tuned_policies
from talaria.swebench_replay.workload import ReplaySet
from talaria.types import Call, EventKind, SessionScript, TokenSeq

GB = 10**9
MAX_INSTANCES = 8


@attrs.frozen
class EmbeddedOptions:
    """One CPU instance whose device budget cannot hold the three models' weights at once
    (3.73 GB in bfloat16 against 3 GB x 0.9 usable; the 2.47 GB weight region leaves 0.23 GB
    of KV), so switches, KV demotion to the host tier and weight staging are real. The 6 GB
    host budget keeps every model's weights on host (as the runner does) plus 2.27 GB of
    host KV. ``calibration`` picks the ``cpu`` profile that prices the routers and the
    prediction (``calibration_plan``: its sizes, default the library's; ``cache_dir``: where
    it is cached, default :func:`talaria.calibration.cache.cache_dir`).

    ``instances`` such instances (``cpu-0``, ``cpu-1``, ...) serve the replay side by side,
    each with its own device and host budgets and its own engine, sharing only the host
    copy of the weights; they run concurrently, and the replay splits the process's torch
    threads evenly among them for its duration (each instance gets its share of the
    cores, as it would get its own device), so the calibration that prices the routers and
    the prediction is measured at that per-instance thread count.

    ``device``, ``hardware``, ``host_weight_share`` and ``loader`` let the same replay run
    elsewhere (``benchmarks/gpu_replay.py``: ``cuda``, the ``h200-tp8`` profile, published
    7-14B configurations with random weights made by its loader). On a device other than
    the CPU nothing is calibrated: the routers and the prediction price with the shipped
    ``hardware`` profile, and host weights are pinned."""

    policies: tuple[PolicyConfig, ...]
    instances: int = 1
    models: tuple[str, ...] = DEFAULT_MODELS
    device_memory_bytes: int = 3 * GB
    host_memory_bytes: int = 6 * GB
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    gap_scale: float = 1.0
    hints: bool = True
    simulate: bool = True
    calibration: CalibrationMode = CalibrationMode.AUTO
    calibration_plan: CalibrationPlan | None = None
    cache_dir: Path | None = None
    device: str = "cpu"
    hardware: str = "cpu"
    host_weight_share: float = 0.65
    loader: Callable[[str, torch.dtype], LoadedModel] = load_catalog_model
    # Tunes the policies before they run: handed the simulated setting of this replay (its
    # cluster, priced by the calibration), returns a tuning document (tuning.to_document)
    tune: Callable[[Setting], Mapping[str, Any]] | None = None

    @property
    def on_cpu(self) -> bool:
        return torch.device(self.device).type == "cpu"

    def __attrs_post_init__(self) -> None:
        if not self.policies:
            raise ConfigError("name at least one policy to replay")
        if not 1 <= self.instances <= MAX_INSTANCES:
            raise ConfigError(
                f"--instances must be between 1 and {MAX_INSTANCES} on the embedded engine "
                f"(got {self.instances}): each instance holds its own "
                f"{self.device_memory_bytes / GB:g} GB device region"
            )

    def instance_specs(self) -> tuple[InstanceSpec, ...]:
        """The replay's instances, ``cpu-0`` to ``cpu-{instances - 1}`` (``cuda-0``... on CUDA)."""
        return tuple(
            InstanceSpec(
                name=f"{torch.device(self.device).type}-{i}",
                hardware=self.hardware,
                device_memory_bytes=self.device_memory_bytes,
                host_memory_bytes=self.host_memory_bytes,
                block_size=self.block_size,
                memory_utilization=0.9,
                host_weight_share=self.host_weight_share,
            )
            for i in range(self.instances)
        )

    def threads_per_instance(self, threads: int) -> int:
        """The torch threads each instance gets out of the process's ``threads``."""
        return max(1, threads // self.instances)


Progress = Callable[[str, int], None]


@attrs.frozen
class ReplayHooks:
    """What a real-time replay reports as it goes, each optional: ``progress(policy, calls
    done)``, ``status(line)``, and ``result(policy, run)`` with each policy's measured run
    (every call's timings and every slot, in seconds from the replay's start: what the
    timeline plot draws)."""

    progress: Progress | None = None
    status: Callable[[str], None] | None = None
    result: Callable[[str, SimResult], None] | None = None

    def say(self, line: str) -> None:
        if self.status is not None:
            self.status(line)

    def tick(self, name: str) -> Callable[[int], None]:
        """``progress`` for policy ``name``: calls done so far."""

        def tick(n: int) -> None:
            if self.progress is not None:
                self.progress(name, n)

        return tick

    def done(self, name: str, run: SimResult) -> None:
        if self.result is not None:
            self.result(name, run)


NO_HOOKS = ReplayHooks()  # a replay that reports nothing as it goes


class PlayedCluster(Protocol):
    """What a real-time replay plays against: a cluster core and one substrate per instance
    (the embedded engine's cluster, or the vLLM backend's)."""

    @property
    def core(self) -> ClusterCore: ...

    @property
    def runners(self) -> Mapping[str, Executor]: ...


def require_models(replay: ReplaySet, served: Iterable[str], missing: str) -> None:
    """``ConfigError`` when the replay set uses a model not in ``served`` (``missing`` says
    where it is missing, e.g. "the engine does not load")."""
    unknown = set(replay.models) - set(served)
    if unknown:
        raise ConfigError(f"the replay set uses models {sorted(unknown)} {missing}")


def run_embedded_replay(
    replay: ReplaySet,
    options: EmbeddedOptions,
    tool_table: ToolTimeTable,
    hooks: ReplayHooks = NO_HOOKS,
) -> dict[str, Any]:
    """Every policy of ``options`` on ``replay`` in real time: the ``results.json`` document
    (with a ``fidelity`` entry per policy when ``options.simulate``), reporting through
    ``hooks`` as it goes."""
    require_models(replay, options.models, "the engine does not load")
    say = hooks.say
    threads = torch.get_num_threads()
    share = options.threads_per_instance(threads)
    if options.instances > 1:
        say(f"{options.instances} instances side by side, {share} torch thread(s) each")
    torch.set_num_threads(share)
    try:
        return _run(replay, options, tool_table, hooks)
    finally:
        torch.set_num_threads(threads)


def _run(
    replay: ReplaySet,
    options: EmbeddedOptions,
    tool_table: ToolTimeTable,
    hooks: ReplayHooks,
) -> dict[str, Any]:
    say = hooks.say
    say(f"loading {', '.join(options.models)} ({options.dtype})")
    # torch runs on threads that exit, the steps on a worker (talaria.engine.threads)
    bare, host = in_own_thread(lambda: _load(options))
    calibration = None
    hardware: dict[str, HardwareProfile] = {}
    if options.on_cpu:  # models only: before any policy runs
        calibration = _calibration(options, bare, host, say)
        hardware = {"cpu": calibration.profile}
    tuning_doc, policies_run = _tuned(options, bare, hardware, say)
    scripts = to_scripts(replay, tool_table, options.gap_scale, options.hints)
    tool_s = {s.session_id: sum(c.tool_seconds for c in s.calls) for s in scripts}
    say("warming up every model once")
    in_own_thread(lambda: _warm_up(bare, host, options))
    policies: dict[str, dict[str, Any]] = {}
    fidelity: dict[str, dict[str, float]] = {}
    schedules: dict[str, dict[str, Any]] = {}
    step_costs: dict[str, dict[str, dict[str, float]]] = {}
    step_log: dict[str, list[dict[str, Any]]] = {}
    references: dict[str, dict[str, Any]] = {}
    for policy in policies_run:
        say(f"replaying under {policy.name} in real time")
        cluster = _cluster(options, bare, host, policy, hardware)
        result, steps = anyio.run(_play, cluster, scripts, policy.name, hooks.tick(policy.name))
        check_conservation(result, replay.n_calls, tool_s)
        policies[policy.name] = policy_summary(result)
        hooks.done(policy.name, result)
        step_costs[policy.name] = step_breakdown(steps)
        step_log[policy.name] = [attrs.asdict(st) for st in steps]
        if options.simulate:
            measured = policies[policy.name]
            fidelity[policy.name], predicted = _predicted(
                cluster, policy, scripts, hardware, measured
            )
            schedules[policy.name] = {
                "measured": schedule_doc(result),
                "predicted": schedule_doc(predicted),
            }
            if not references:
                references = _references(cluster, scripts)
        del cluster
        gc.collect()
    policies.update(references)
    return _document(
        replay, options, policies, policies_run, calibration,
        fidelity=fidelity, step_costs=step_costs, tuning=tuning_doc, step_log=step_log,
        schedules=schedules,
    )  # fmt: skip


def _document(
    replay: ReplaySet,
    options: EmbeddedOptions,
    policies: dict[str, dict[str, Any]],
    policies_run: Sequence[PolicyConfig],
    calibration: Calibration | None,
    *,
    fidelity: dict[str, dict[str, float]],
    step_costs: dict[str, dict[str, dict[str, float]]],
    tuning: dict[str, Any],
    step_log: dict[str, list[dict[str, Any]]],
    schedules: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The embedded replay's ``results.json``: every policy's summary with its ratios and
    knobs, the engine, the simulator's fidelity (and each policy's measured and predicted
    schedules), the calibration, step costs and tuning."""
    add_bound_ratios(policies)
    add_ratios(policies)
    doc = results_document(
        "embedded",
        options.hardware,
        options.instance_specs(),
        replay,
        options.gap_scale,
        options.hints,
        policies,
    )
    doc["engine"] = {
        "models": list(options.models),
        "dtype": str(options.dtype),
        "torch_threads_per_instance": torch.get_num_threads(),
    }
    doc["fidelity"] = fidelity
    doc["schedules"] = schedules
    doc["engine"]["device"] = options.device
    doc["calibration"] = (
        calibration.describe()
        if calibration is not None
        else {"mode": "none", "profile": f"shipped {options.hardware} (not calibrated off CPU)"}
    )
    doc["step_costs"] = step_costs
    doc["step_log"] = step_log  # every executed schedule (the CLI writes it to steps.json)
    doc["tuning"] = tuning
    for policy in policies_run:
        doc["policies"][policy.name]["knobs"] = knobs_of(policy)
    return doc


def _tuned(
    options: EmbeddedOptions,
    bare: Mapping[str, LoadedModel],
    hardware: Mapping[str, HardwareProfile],
    say: Callable[[str], None],
) -> tuple[dict[str, Any], tuple[PolicyConfig, ...]]:
    """(the tuning document, the policies at their tuned knobs); untuned without
    ``options.tune``. The tuning runs in the simulator on this replay's cluster, priced by
    the calibration that prices the prediction, on the tune part of the sessions."""
    if options.tune is None:
        return {"tuned": False}, options.policies
    specs = [m.arch.to_spec(name, options.dtype, source=m.source) for name, m in bare.items()]
    cluster = ClusterConfig(specs, options.instance_specs())
    setting = Setting(cluster, tuple(hardware.values()), options.gap_scale, options.hints)
    say("tuning the policies' knobs in the simulator (tune part, this machine's profile)")
    doc = dict(options.tune(setting))
    return doc, tuned_policies(options.policies, from_document(doc))


def _calibration(
    options: EmbeddedOptions,
    bare: Mapping[str, LoadedModel],
    host: Mapping[str, torch.Tensor],
    say: Callable[[str], None],
) -> Calibration:
    """The calibration ``options.calibration`` asks for, measured (when it must be) on the
    replay's loaded weights; it sees the models and nothing of the replay."""
    return calibrate(
        options.calibration,
        bare,
        options.dtype,
        host_weights=host,
        plan=options.calibration_plan,
        directory=options.cache_dir,
        on_status=say,
    )


def _cluster(
    options: EmbeddedOptions,
    bare: Mapping[str, LoadedModel],
    host: Mapping[str, torch.Tensor],
    policy: PolicyConfig,
    hardware: Mapping[str, HardwareProfile],
    weight_files: WeightFiles | None = None,
) -> PlayedCluster:
    """A fresh cluster for one policy, built on a thread that exits (its weights past the
    host budgets on disk in ``weight_files``, if given)."""
    return in_own_thread(
        lambda: cluster_from_loaded(
            options.instance_specs(),
            bare,
            policy,
            options.dtype,
            options.device,
            host_weights=host,
            hardware=hardware,
            weight_files=weight_files,
        )
    )


def _load(options: EmbeddedOptions) -> tuple[dict[str, LoadedModel], dict[str, torch.Tensor]]:
    """Each model's description (without tensors) and its flat host weights, loaded one at
    a time so that peak memory is the flat copies plus one model's tensors."""
    bare: dict[str, LoadedModel] = {}
    host: dict[str, torch.Tensor] = {}
    for name in options.models:
        m = options.loader(name, options.dtype)
        host[name] = flatten_weights(name, m.arch, m.tensors, options.dtype, not options.on_cpu)
        bare[name] = attrs.evolve(m, tensors={})
        del m
        gc.collect()
    return bare, host


def _warm_up(
    bare: Mapping[str, LoadedModel], host: Mapping[str, torch.Tensor], options: EmbeddedOptions
) -> None:
    """One short call per model on each instance of a throwaway cluster: first-touch
    allocations and kernel selection happen here, not inside a timed policy."""
    policy = options.policies[0]
    cluster = cluster_from_loaded(
        options.instance_specs(), bare, policy, options.dtype, options.device, host_weights=host
    )
    prompt = TokenSeq(range(1, 200))
    for name, runner in cluster.runners.items():
        local = LocalInstance(cluster.core.instances[name], runner)
        for m in bare:  # one at a time: every model gets switched in
            local.generate([Call(f"warm-{m}", 0, m, prompt, 4)])
    del cluster
    gc.collect()


async def _play(
    cluster: PlayedCluster,
    scripts: Sequence[SessionScript],
    policy: str,
    tick: Callable[[int], None],
) -> tuple[SimResult, list[StepTiming]]:
    """Play ``scripts`` against a live cluster; the records the simulator would produce."""
    done: list[tuple[Request, str]] = []
    sessions: list[SessionRecord] = []
    slots = SlotLog()
    clock = WallClock()
    runners = {name: _SlotRecorder(name, r, slots, clock) for name, r in cluster.runners.items()}
    async with LiveCluster(cluster.core, runners, clock=clock, session_idle_s=3600) as live:
        await live.until_idle()  # the simulated run starts with idle instances too
        t0 = live.clock.now()

        async def session(script: SessionScript) -> None:
            await anyio.sleep(max(0.0, t0 + script.start_s - live.clock.now()))
            start = live.clock.now()
            tool = 0.0
            for i in range(len(script.calls)):
                req, inst = await _one_call(live, script, i)
                done.append((req, inst))
                tick(len(done))
                run = script.after(i)
                if run is not None:
                    if run.hint_s is not None:
                        key = script.key
                        live.event(key, EventKind.TOOL_START, expected_s=run.hint_s, tool=run.tool)
                    await anyio.sleep(run.seconds)
                    tool += run.seconds
            live.event(script.key, EventKind.END)
            n = len(script.calls)
            sessions.append(
                SessionRecord(
                    script.session_id, script.model, start - t0, live.clock.now() - t0, n, tool
                )
            )

        async with anyio.create_task_group() as tg:
            for script in scripts:
                tg.start_soon(session, script)
        live.check_integrity()
        end = live.clock.now() - t0
        steps = list(live.steps)
        counters = cluster_counters(cluster.core.instances.values(), live.kv_bytes_moved)
    records = tuple(_shifted(record_of(req, inst), t0) for req, inst in done)
    slot_records = tuple(
        attrs.evolve(r, switch_s=r.switch_s - t0, open_s=r.open_s - t0, until_s=r.until_s - t0)
        for r in slots.records(end + t0)
    )
    return SimResult(policy, records, tuple(sessions), counters, end, slot_records), steps


class _SlotRecorder:
    """An executor that notes in a :class:`SlotLog` every switch it is asked to make (when
    its copy starts, and when it is done) and otherwise defers to ``inner``."""

    def __init__(self, name: str, inner: Executor, log: SlotLog, clock: Clock) -> None:
        self.name, self.inner, self.log, self.clock = name, inner, log, clock

    @property
    def executes_kv_moves(self) -> bool:
        return self.inner.executes_kv_moves

    def vocab_size(self, model: str) -> int | None:
        return self.inner.vocab_size(model)

    def execute(self, work: Work) -> Executed:
        switch = work.schedule.switch
        if switch is not None:
            self.log.switch(self.name, switch.model, self.clock.now())
        done = self.inner.execute(work)
        if switch is not None:
            self.log.opened(self.name, switch.model, self.clock.now())
        return done

    def restart(self, layout: Layout) -> None:
        self.inner.restart(layout)


async def _one_call(live: LiveCluster, script: SessionScript, index: int) -> tuple[Request, str]:
    sc = script.calls[index]
    answer = sc.history.tokens()[len(sc.prompt) :][: sc.output_tokens]
    params = SamplingParams(temperature=0.0, max_tokens=sc.output_tokens, ignore_eos=True)
    async with live.session(script.key).lock:
        lc, receive = await live.submit(
            script.key, script.model, sc.prompt, params, StopChecker(params), forced=answer
        )
        async with receive:
            async for ev in receive:
                if isinstance(ev, Failed):
                    raise ev.error
                if isinstance(ev, Finished):
                    return lc.req, ev.instance
    raise TalariaError(f"call {index} of {script.session_id} ended without an answer")


def _shifted(rec: Any, t0: float) -> Any:
    return attrs.evolve(
        rec,
        arrival_s=rec.arrival_s - t0,
        admitted_s=rec.admitted_s - t0,
        first_token_s=rec.first_token_s - t0,
        finish_s=rec.finish_s - t0,
    )


def _simulate(
    cluster: PlayedCluster,
    policy: PolicyConfig,
    scripts: Sequence[SessionScript],
    estimators: Mapping[str, Estimator] | None = None,
) -> SimResult:
    """The same scripts through the simulator, on the same cluster configuration, priced by
    the estimators the live cluster's routers use (the calibration's ``cpu`` profile) unless
    ``estimators`` are given."""
    config = cluster.core.cluster
    if estimators is None:
        estimators = {name: inst.estimator for name, inst in cluster.core.instances.items()}
    sim = Simulator(config, policy, dict(estimators), learner=GapPredictor.default)
    return sim.run(scripts)


def _predicted(
    cluster: PlayedCluster,
    policy: PolicyConfig,
    scripts: Sequence[SessionScript],
    hardware: Mapping[str, HardwareProfile],
    measured: Mapping[str, Any],
) -> tuple[dict[str, float], SimResult]:
    """The simulator's fidelity on this measured run (:func:`_fidelity`), and where the
    profile prices steps with a step grid, the roofline's on the same run (``roofline_``
    keys): the model the grid replaced, from the same calibration's rates; and the
    simulated run itself."""
    predicted = _simulate(cluster, policy, scripts)
    out = _fidelity(measured, policy_summary(predicted))
    roofline = _roofline(hardware)
    if roofline is not None:
        estimators = cluster_estimators(cluster.core.cluster, roofline)
        old = _fidelity(measured, policy_summary(_simulate(cluster, policy, scripts, estimators)))
        out |= {f"roofline_{k}": v for k, v in old.items() if not k.startswith("measured_")}
    return out, predicted


def schedule_doc(result: SimResult) -> dict[str, Any]:
    """What a run did, to set a measured run beside its prediction: each session's model,
    start and end, and each model slot (instance, model, switch began, slot open, until),
    seconds on the run's clock."""
    return {
        "sessions": {s.session_id: [s.model, s.start_s, s.end_s] for s in result.sessions},
        "slots": [[r.instance, r.model, r.switch_s, r.open_s, r.until_s] for r in result.slots],
    }


def _roofline(hardware: Mapping[str, HardwareProfile]) -> dict[str, HardwareProfile] | None:
    """The calibration's profiles with their step grid's prices dropped (the roofline of
    the same measured rates prices the steps), or None when none of them has prices: the
    fidelity of the model the step grid replaced, on the same measured run."""
    if all(p.step_prices is None for p in hardware.values()):
        return None
    return {name: attrs.evolve(p, step_prices=None) for name, p in hardware.items()}


def _references(
    cluster: PlayedCluster, scripts: Sequence[SessionScript]
) -> dict[str, dict[str, Any]]:
    """The schedule references (isolated, model-serial: ``references.py``) of these scripts
    on this cluster, simulated with the prediction's estimators, since they are schedules no
    policy runs live; their entries say ``"simulated": true``, and a policy's ratio to them
    is its measured SCT over the simulated reference's (the fidelity table says how far the
    simulator is from the measured runs)."""
    config = cluster.core.cluster
    estimators: dict[str, Estimator] = {
        name: inst.estimator for name, inst in cluster.core.instances.items()
    }
    alone = Simulator(config, TALARIA, estimators, learner=GapPredictor.default)
    entries = reference_entries(scripts, alone.run, TALARIA.name)
    for entry in entries.values():
        entry["simulated"] = True
    return entries


def step_breakdown(steps: Sequence[StepTiming]) -> dict[str, dict[str, float]]:
    """Measured and predicted seconds summed per kind of executed schedule: prefill steps
    (any prefill chunk), decode-only steps, switches, stage copies and KV moves alone; with
    the CPU time the event loop's thread used while they ran (``loop_cpu_s``)."""
    out: dict[str, dict[str, float]] = {}
    for st in steps:
        if st.switch_bytes:
            kind = "switch"
        elif st.prefill_tokens:
            kind = "prefill"
        elif st.decodes:
            kind = "decode"
        elif st.stage_bytes:
            kind = "stage"
        else:
            kind = "kv_moves"
        row = out.setdefault(
            kind, {"count": 0, "measured_s": 0.0, "predicted_s": 0.0, "loop_cpu_s": 0.0}
        )
        row["count"] += 1
        row["measured_s"] += st.seconds
        row["predicted_s"] += st.predicted_s
        row["loop_cpu_s"] += st.loop_cpu_s
    return out


def _fidelity(measured: Mapping[str, Any], predicted: Mapping[str, Any]) -> dict[str, float]:
    """Predicted vs measured SCT percentiles; ``error`` is (predicted - measured) / measured."""
    out: dict[str, float] = {}
    for key in ("sct_p50_s", "sct_p95_s", "sct_mean_s", "ttft_p50_s", "ttft_p95_s"):
        m, p = float(measured[key]), float(predicted[key])
        out[f"measured_{key}"] = m
        out[f"predicted_{key}"] = p
        out[f"error_{key}"] = (p - m) / m if m else 0.0
    return out
