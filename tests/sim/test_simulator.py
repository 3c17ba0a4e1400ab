"""The simulator on small workloads: deterministic, conservative, and every policy finishes.

Two workloads: six 5-call sessions on two tiny models sharing one small instance (the
models must take turns, and the KV pool holds about two sessions' histories), with
round-number costs; and the paper's testbed (three >100B models on one 8 x H200 server,
priced by the roofline cost model) with a few short sessions.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence

import attrs
import pytest

from talaria.config import ClusterConfig, InstanceSpec, ModelSpec, PolicyConfig
from talaria.core.cluster import ClusterCore
from talaria.core.instance import InstanceCore
from talaria.cost import cluster_estimators, pricing
from talaria.cost.estimator import Estimator
from talaria.cost.pricing import Price
from talaria.policy.baselines import POLICIES
from talaria.schedule import Schedule
from talaria.session.gaps import GapPredictor
from talaria.sim import simulator
from talaria.sim.catalog import paper_cluster
from talaria.sim.pool_catalog import pool_catalog
from talaria.sim.simulator import SimResult, Simulator, _Run
from talaria.swebench_replay.load_sweep import LoadSetting, open_load
from talaria.swebench_replay.split import Part
from talaria.types import Call, ScriptedCall, SessionScript, TokenSeq
from tests.helpers import RoundNumberEstimator as FakeEstimator
from tests.helpers import tiny_spec

WEIGHT_BYTES = 1000
BLOCK_BYTES = 128  # 4 tokens of 32 bytes


def tiny_model(name: str) -> ModelSpec:
    """1000 bytes of weights, 32 bytes of KV per token."""
    return tiny_spec(name, WEIGHT_BYTES)


def tiny_cluster(kv_blocks: int = 96, host_kv_blocks: int = 128) -> ClusterConfig:
    """Two tiny models on one instance with room for one model's weights and the KV pool."""
    spec = InstanceSpec(
        name="tiny",
        hardware="fake",
        device_memory_bytes=WEIGHT_BYTES + kv_blocks * BLOCK_BYTES,
        host_memory_bytes=2 * WEIGHT_BYTES + host_kv_blocks * BLOCK_BYTES,
        block_size=4,
        memory_utilization=1.0,
    )
    return ClusterConfig(models=(tiny_model("A"), tiny_model("B")), instances=(spec,))


def script(
    session: str,
    model: str,
    start_s: float,
    n_calls: int,
    *,
    first: int,
    growth: int,
    out: int,
    tool_s: float,
    hint_s: float | None = None,
) -> SessionScript:
    """A session whose prompts grow: each prompt is the previous history plus ``growth``
    new tokens. Token ids are unique per session, so sessions share no KV blocks."""
    fresh = itertools.count(1_000_000 * (1 + sum(map(ord, session))))
    prompt = TokenSeq(next(fresh) for _ in range(first))
    calls = []
    for i in range(n_calls):
        history = prompt.extend(next(fresh) for _ in range(out))
        tool = tool_s if i < n_calls - 1 else 0.0
        calls.append(ScriptedCall(prompt, history, out, 2 * out, tool, "bash", hint_s))
        prompt = history.extend(next(fresh) for _ in range(growth))
    return SessionScript(session, model, start_s, tuple(calls))


def tiny_workload() -> list[SessionScript]:
    """Six sessions of five calls, three per model, arriving 0.1 s apart; tools 0.3 s."""
    return [
        script(f"s{k}", "AB"[k % 2], 0.1 * k, 5, first=64, growth=16, out=8, tool_s=0.3)
        for k in range(6)
    ]


TINY = tiny_cluster()
TINY_ESTIMATORS: Mapping[str, Estimator] = {"tiny": FakeEstimator()}


def simulate(
    cluster: ClusterConfig,
    policy: PolicyConfig,
    estimators: Mapping[str, Estimator],
    scripts: Sequence[SessionScript],
) -> tuple[SimResult, ClusterCore]:
    """``Simulator.run``, keeping the cluster core so the test can inspect it afterwards."""
    core = ClusterCore(cluster, policy, estimators)
    return _Run(core).execute(scripts, policy.name, None), core


@functools.cache
def tiny_run(name: str) -> tuple[SimResult, ClusterCore]:
    return simulate(TINY, POLICIES[name], TINY_ESTIMATORS, tiny_workload())


def check_conservation(
    result: SimResult, core: ClusterCore, scripts: Sequence[SessionScript]
) -> None:
    """Every call answered once, in order, with its own output; sessions add up; no KV held."""
    sent = {(s.session_id, i): c for s in scripts for i, c in enumerate(s.calls)}
    answered = [(r.session_id, r.index) for r in result.calls]
    assert len(answered) == len(set(answered)) == len(sent)
    assert set(answered) == set(sent)
    for r in result.calls:
        sc = sent[(r.session_id, r.index)]
        assert r.output_tokens == sc.output_tokens and r.prompt_tokens == len(sc.prompt)
        assert r.arrival_s <= r.admitted_s <= r.first_token_s <= r.finish_s
        assert r.instance in core.instances
    by_session = {s.session_id: s for s in scripts}
    for rec in result.sessions:
        s = by_session[rec.session_id]
        tool = sum(c.tool_seconds for c in s.calls)
        assert rec.tool_s == pytest.approx(tool)
        assert rec.sct_s >= tool
        # calls are sequential: the SCT is exactly the calls' latencies plus the tool gaps
        latencies = sum(r.latency_s for r in result.calls if r.session_id == rec.session_id)
        assert rec.sct_s == pytest.approx(latencies + tool)
    for inst in core.instances.values():
        kv = inst.kv
        assert kv.device_free + kv.device_evictable == kv.device_blocks
        assert not any(kv.is_pinned(sid) for sid in kv.sessions)
        assert inst.admission.held == {}
        assert not inst.running and not any(inst.waiting.values())
    core.check_integrity()


@pytest.fixture(autouse=True)
def _fail_fast_on_a_livelock(monkeypatch: pytest.MonkeyPatch) -> None:
    """These runs take a few hundred events: a scheduling livelock fails in a second."""
    monkeypatch.setattr(simulator, "MAX_EVENTS", 20_000)


# ---------------------------------------------------------------------------- tiny workload


def test_simulation_is_deterministic() -> None:
    for name in ("talaria", "round"):
        runs = [
            Simulator(TINY, POLICIES[name], TINY_ESTIMATORS).run(tiny_workload()) for _ in (1, 2)
        ]
        assert attrs.asdict(runs[0]) == attrs.asdict(runs[1])
        assert repr(runs[0]) == repr(runs[1])
        assert attrs.asdict(runs[0]) == attrs.asdict(tiny_run(name)[0])


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_completes_the_tiny_workload(name: str) -> None:
    result, core = tiny_run(name)
    check_conservation(result, core, tiny_workload())
    assert result.policy == name
    assert result.counters["calls_finished"] == 30
    assert result.counters["model_switches"] >= 2  # both models ran on the one region
    assert result.end_s == max(r.finish_s for r in result.calls)
    # every switch but the instance's first ends a slot that started closing, for a reason
    closes = sum(v for k, v in result.counters.items() if k.startswith("slot_closes_"))
    assert (
        result.counters["model_switches"] - 1
        <= closes
        == core.instances["tiny"].rounds.closes.total()
    )


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_completes_when_only_one_model_has_work(name: str) -> None:
    # continuations arrive after their slot's opening pass and no other model ever waits
    scripts = [
        script(f"a{k}", "A", 0.05 * k, 3, first=32, growth=8, out=6, tool_s=0.2) for k in range(3)
    ]
    result, core = simulate(TINY, POLICIES[name], TINY_ESTIMATORS, scripts)
    check_conservation(result, core, scripts)
    assert result.counters["model_switches"] == 1


def test_talaria_admits_continuations_into_open_slots_and_round_does_not() -> None:
    talaria, _ = tiny_run("talaria")
    round_, _ = tiny_run("round")
    assert talaria.counters["sp_admissions"] > 0
    assert talaria.counters["sp_admissions"] == sum(r.sp_admitted for r in talaria.calls)
    assert round_.counters["sp_admissions"] == 0
    assert not any(r.sp_admitted for r in round_.calls)
    assert round_.counters["staged_switches"] == 0


def test_staging_borrows_free_kv_and_yields_it_under_pressure() -> None:
    # round-robin slots (many switches, so many stages) isolate the staging mechanics from
    # the session-aware slot order, which switches a handful of times on this workload
    policy = POLICIES["talaria-no-slot-order"]
    roomy = tiny_cluster(kv_blocks=400)
    staged, core = simulate(roomy, policy, TINY_ESTIMATORS, tiny_workload())
    assert staged.counters["staged_switches"] > 0
    assert core.instances["tiny"].kv.lent_blocks == 0  # every loan came back
    # 64 KV blocks: waiting calls take lent blocks back, so stages are abandoned and redone
    tight, core = simulate(tiny_cluster(kv_blocks=64), policy, TINY_ESTIMATORS, tiny_workload())
    assert tight.counters["weight_bytes_moved"] > staged.counters["weight_bytes_moved"]
    assert core.instances["tiny"].kv.lent_blocks == 0


def test_host_kv_is_used_by_talaria_and_never_without_it() -> None:
    talaria, _ = tiny_run("talaria")
    assert talaria.counters["kv_restored_blocks"] > 0  # the workload does exercise the tier
    for name in ("talaria-no-hostkv", "round"):
        result, _ = tiny_run(name)
        assert result.counters["kv_restored_blocks"] == 0
        assert result.counters["kv_demoted_blocks"] == 0
        assert all(r.restored_tokens == 0 for r in result.calls)


def test_counters_are_consistent_with_the_records() -> None:
    for name in ("talaria", "round", "ttl-pin"):
        result, _ = tiny_run(name)
        c = result.counters
        assert c["kv_bytes_moved"] == BLOCK_BYTES * (
            c["kv_demoted_blocks"] + c["kv_restored_blocks"]
        )
        restored = sum(r.restored_tokens for r in result.calls)
        assert restored <= 4 * c["kv_restored_blocks"]  # a restore always brings whole blocks


# ---------------------------------------------------------------------------- paper testbed


def paper_estimators(cluster: ClusterConfig) -> dict[str, Estimator]:
    return cluster_estimators(cluster)


def paper_workload(cluster: ClusterConfig) -> list[SessionScript]:
    """Two sessions per model, three calls each, 4K-token prompts growing by 300."""
    models = [m.name for m in cluster.models]
    return [
        script(
            f"p{k}",
            models[k % 3],
            0.5 * k,
            3,
            first=4096,
            growth=300,
            out=64,
            tool_s=0.5,
            hint_s=0.5 if k % 2 else None,
        )
        for k in range(6)
    ]


PAPER = paper_cluster()


@functools.cache
def paper_run(name: str) -> tuple[SimResult, ClusterCore]:
    return simulate(PAPER, POLICIES[name], paper_estimators(PAPER), paper_workload(PAPER))


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_completes_on_the_paper_testbed(name: str) -> None:
    result, core = paper_run(name)
    check_conservation(result, core, paper_workload(PAPER))
    assert result.counters["model_switches"] >= 3  # three models take turns on one server
    again = Simulator(PAPER, POLICIES[name], paper_estimators(PAPER)).run(paper_workload(PAPER))
    assert attrs.asdict(again) == attrs.asdict(result)


def test_paper_testbed_sp_and_staging_only_where_enabled() -> None:
    talaria, _ = paper_run("talaria")
    round_, _ = paper_run("round")
    assert talaria.counters["sp_admissions"] > 0 and talaria.counters["staged_switches"] > 0
    assert round_.counters["sp_admissions"] == 0 and round_.counters["staged_switches"] == 0


class CoRunEstimator(FakeEstimator):
    """Round-number costs on hardware whose instances slow each other twofold."""

    def co_run_slowdown(self) -> float:  # type: ignore[override]
        return 2.0


def two_instances() -> ClusterConfig:
    base = TINY.instances[0]
    specs = tuple(attrs.evolve(base, name=f"tiny-{i}") for i in range(2))
    return ClusterConfig(models=TINY.models, instances=specs)


def test_a_peer_at_work_slows_an_instance_by_the_co_run_factor() -> None:
    cluster = two_instances()
    run = _Run(
        ClusterCore(
            cluster, POLICIES["talaria"], {n: CoRunEstimator() for n in ("tiny-0", "tiny-1")}
        )
    )
    inst = run.core.instances["tiny-0"]
    assert run._co_run("tiny-0", inst) == 1.0  # nobody else at work
    run.busy["tiny-1"] = simulator._Busy()
    assert run._co_run("tiny-0", inst) == 2.0
    run.busy["tiny-0"], run.busy["tiny-1"] = simulator._Busy(), None
    assert run._co_run("tiny-0", inst) == 1.0  # its own work is no peer's
    plain = _Run(
        ClusterCore(
            cluster, POLICIES["talaria"], {n: FakeEstimator() for n in ("tiny-0", "tiny-1")}
        )
    )
    plain.busy["tiny-1"] = simulator._Busy()
    assert plain._co_run("tiny-0", plain.core.instances["tiny-0"]) == 1.0  # no factor: none


def test_a_lone_session_runs_as_fast_and_concurrent_ones_slower() -> None:
    cluster = two_instances()
    policy = POLICIES["talaria"]
    names = ("tiny-0", "tiny-1")

    def end(estimator: type[FakeEstimator], scripts: list[SessionScript]) -> float:
        return simulate(cluster, policy, {n: estimator() for n in names}, scripts)[0].end_s

    lone = [script("s0", "A", 0.0, 3, first=64, growth=16, out=8, tool_s=0.3)]
    assert end(CoRunEstimator, lone) == end(FakeEstimator, lone)
    pair = [*lone, script("s1", "B", 0.0, 3, first=64, growth=16, out=8, tool_s=0.3)]
    assert end(CoRunEstimator, pair) > end(FakeEstimator, pair)


def stretchy_workload() -> list[SessionScript]:
    """Eight sessions of long answers on two models, arriving while others decode: decode
    stretches that arrivals, gap starts and ends on the same instance must cut. Start and
    tool times are off the estimator's round numbers: a wait that reaches a threshold (the
    reclaim wait) exactly in one run and a rounding error short of it in the other would
    make the runs differ by float rounding alone."""
    return [
        script(
            f"d{k}", "AB"[k % 2], 0.3711 * k, 4, first=32, growth=8, out=60, tool_s=0.2 + 0.0537 * k
        )
        for k in range(8)
    ]


@pytest.mark.parametrize("name", ["talaria", "round", "least-loaded", "talaria-no-sp"])
def test_decode_stretches_decide_as_stepping_one_step_at_a_time(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fast-forwarding decode-only steps (cut by changes on their own instance, and after
    ``STRETCH_S``) answers every call when stepping one step per event would, in far fewer
    events."""
    cluster, policy = two_instances(), POLICIES[name]
    estimators = {n: FakeEstimator() for n in ("tiny-0", "tiny-1")}
    events: list[int] = []
    ready = _Run._ready

    def counting(self: _Run, *args: object) -> None:
        events.append(1)
        ready(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_Run, "_ready", counting)
    fast, _ = simulate(cluster, policy, estimators, stretchy_workload())
    fast_events = len(events)
    events.clear()
    monkeypatch.setattr(_Run, "_may_stretch", lambda self, *a: False)
    monkeypatch.setattr(_Run, "_repeat", lambda self, inst, step, stretch: 1)
    exact, _ = simulate(cluster, policy, estimators, stretchy_workload())
    assert len(fast.calls) == len(exact.calls) == 32
    key = lambda r: (r.session_id, r.index)  # noqa: E731
    for a, b in zip(sorted(fast.calls, key=key), sorted(exact.calls, key=key), strict=True):
        assert (a.instance, a.admitted_s) == (b.instance, pytest.approx(b.admitted_s, abs=1e-9))
        assert a.finish_s == pytest.approx(b.finish_s, abs=1e-9)
    assert fast_events < len(events)  # fewer where a weight stage keeps steps one by one


def additive_price(monkeypatch: pytest.MonkeyPatch) -> None:
    """Price a run of decode steps as the sum of its steps (the simulator prices it at the
    run's mean context, which differs in the last bits): one long event then costs exactly
    what its steps cost one by one."""
    plain = simulator.price

    def summed(est: Estimator, sched: Schedule, repeat: int = 1) -> Price:
        step = sched.step
        if repeat == 1 or step is None:
            return plain(est, sched, repeat)
        grow = len(step.decode)
        steps = (
            attrs.evolve(step, decode_context_tokens=step.decode_context_tokens + grow * i)
            for i in range(repeat)
        )
        total = sum(pricing.step_s(est, one, 1) for one in steps)
        return attrs.evolve(plain(est, sched, 1), step_s=total)

    monkeypatch.setattr(simulator, "price", summed)


def test_a_pool_decides_in_stretches_as_stepping_one_step_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a pool of two TP4 instances serving four catalog models under open-loop load
    (stages, switches, several models waiting), stretches change no decision: every call
    is answered where and when stepping one step per event answers it."""
    setting = LoadSetting(pool_catalog(4), 2, 8)
    load = open_load(setting, Part.TEST, 0.5, 0)
    cluster = setting.cluster()
    additive_price(monkeypatch)
    monkeypatch.setattr(simulator, "MAX_EVENTS", 1_000_000)  # one step per event: many

    def answers() -> dict[tuple[str, int], tuple[str, float, float]]:
        result = Simulator(
            cluster, POLICIES["talaria"], cluster_estimators(cluster), learner=GapPredictor.default
        ).run(load.scripts)
        return {
            (c.session_id, c.index): (c.instance, c.admitted_s, c.finish_s) for c in result.calls
        }

    fast = answers()
    monkeypatch.setattr(_Run, "_may_stretch", lambda self, *a: False)
    exact = answers()
    assert fast.keys() == exact.keys() and len(fast) == load.n_calls
    for key, (instance, admitted, finished) in exact.items():
        assert fast[key][0] == instance
        assert fast[key][1:] == (
            pytest.approx(admitted, abs=1e-9),
            pytest.approx(finished, abs=1e-9),
        )


# ---------------------------------------------------------------------------- keep-alive


def one_session(hint_s: float | None = None) -> list[SessionScript]:
    """Three calls of one session with 5 s tools between them."""
    return [script("s0", "A", 0.0, 3, first=64, growth=16, out=8, tool_s=5.0, hint_s=hint_s)]


def test_a_keep_alive_timer_gives_the_device_back_between_calls_and_pays_reloads() -> None:
    timer = attrs.evolve(POLICIES["serverless"], keep_alive_s=1.0)
    result, core = simulate(TINY, timer, TINY_ESTIMATORS, one_session())
    check_conservation(result, core, one_session())
    kept, _ = simulate(TINY, POLICIES["serverless"], TINY_ESTIMATORS, one_session())
    c = result.counters
    # each 5 s tool outlasts the 1 s timer: the instance scales to zero after every call,
    # and every call after the first switches its weights in again and restores its KV
    assert (c["scale_to_zero"], c["model_switches"]) == (3, 3)
    assert [r.reused_tokens for r in result.calls] == [0, 0, 0]
    assert [r.restored_tokens for r in result.calls] == [0, 72, 96]
    assert [r.reused_tokens for r in kept.calls] == [0, 72, 96]
    # held: each call's time plus the timer after the first two (the third's release comes
    # after the run's last work); demotions of a few blocks take under a microsecond here
    latencies = sum(r.latency_s for r in result.calls)
    assert c["device_held_ms"] == round(1000 * (latencies + 2 * 1.0))
    assert kept.counters["device_held_ms"] == round(1000 * kept.end_s)  # never released
    assert kept.counters["scale_to_zero"] == 0
    assert [s.until_s for s in result.slots] == pytest.approx(
        [result.calls[0].finish_s + 1.0, result.calls[1].finish_s + 1.0, result.end_s], abs=1e-6
    )
    assert result.end_s == result.calls[-1].finish_s


class SlowWake(FakeEstimator):
    """Round-number costs on a platform that takes 2 s to give an instance its devices back."""

    def provision_s(self) -> float:
        return 2.0


def test_a_woken_instance_waits_for_its_devices_held_not_busy() -> None:
    timer = attrs.evolve(POLICIES["serverless"], keep_alive_s=1.0)
    fast, _ = simulate(TINY, timer, TINY_ESTIMATORS, one_session())
    slow, core = simulate(TINY, timer, {"tiny": SlowWake()}, one_session())
    check_conservation(slow, core, one_session())
    # the pool scales to zero, so it starts there: every call wakes the instance, 2 s more
    assert [r.latency_s for r in slow.calls] == pytest.approx(
        [r.latency_s + 2.0 for r in fast.calls]
    )
    assert [r.ttft_s for r in slow.calls] == pytest.approx([r.ttft_s + 2.0 for r in fast.calls])
    assert slow.counters["scale_to_zero"] == fast.counters["scale_to_zero"] == 3
    assert slow.counters["device_held_ms"] == fast.counters["device_held_ms"] + 6000
    assert slow.counters["device_busy_ms"] == fast.counters["device_busy_ms"]


def test_a_reservation_keeps_the_instance_through_the_gap_its_session_comes_back_from() -> None:
    """Talaria with no timer at all (0 s) holds the instance while the hinted session is
    expected back, so its KV stays on device; it gives the device back once the session
    ended and nothing else is reserved."""
    policy = attrs.evolve(POLICIES["talaria"], keep_alive_s=0.0)
    result, core = simulate(TINY, policy, TINY_ESTIMATORS, one_session(hint_s=5.0))
    check_conservation(result, core, one_session(hint_s=5.0))
    c = result.counters
    assert (c["scale_to_zero"], c["model_switches"], c["reservations_made"]) == (1, 1, 3)
    assert [r.reused_tokens for r in result.calls] == [0, 72, 96]
    assert c["device_held_ms"] == round(1000 * result.end_s)


def test_a_reservation_that_ends_early_brings_the_release_forward() -> None:
    """The session's reservation after its first call holds the instance; its second call
    ends the session, so nothing is reserved any more: with no timer the instance is given
    back then, not when that first reservation would have run out (its 60 s hold)."""
    policy = attrs.evolve(POLICIES["talaria"], keep_alive_s=0.0, reservation_horizon_s=10.0)
    scripts = [
        script("s0", "A", 0.0, 2, first=64, growth=16, out=8, tool_s=5.0, hint_s=5.0),
        script("s1", "A", 200.0, 1, first=64, growth=16, out=8, tool_s=5.0),
    ]
    result, core = simulate(TINY, policy, TINY_ESTIMATORS, scripts)
    check_conservation(result, core, scripts)
    first = next(r for r in result.sessions if r.session_id == "s0")
    late = next(r for r in result.calls if r.session_id == "s1")
    # held through s0 (its gap reserved), given back as it ends, woken by s1 at 200 s
    assert result.counters["scale_to_zero"] == 2
    assert result.counters["device_held_ms"] == round(1000 * (first.end_s + late.latency_s))


def test_a_session_that_moves_away_ends_its_reservation_and_brings_the_release_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """s0's first call runs on ``tiny``, which then holds its reservation (a 60 s hold);
    its second call is routed to ``tiny2`` (the router is offered nothing else). With no
    timer, ``tiny`` is given back as the call moves, not when the hold would run out."""
    twin = attrs.evolve(TINY.instances[0], name="tiny2")
    two = attrs.evolve(TINY, instances=(*TINY.instances, twin))
    estimators = {"tiny": FakeEstimator(), "tiny2": FakeEstimator()}
    policy = attrs.evolve(POLICIES["talaria"], keep_alive_s=0.0, reservation_horizon_s=10.0)
    scripts = [script("s0", "A", 0.0, 2, first=64, growth=16, out=8, tool_s=5.0, hint_s=5.0)]
    offered = ClusterCore._candidates

    def away(self: ClusterCore, call: Call, target_output: int) -> list[InstanceCore]:
        home = "tiny" if call.index == 0 else "tiny2"
        return [i for i in offered(self, call, target_output) if i.spec.name == home]

    monkeypatch.setattr(ClusterCore, "_candidates", away)
    result, core = simulate(two, policy, estimators, scripts)
    check_conservation(result, core, scripts)
    first, second = result.calls
    assert (first.instance, second.instance) == ("tiny", "tiny2")
    assert result.counters["reservations_made"] >= 1
    assert result.counters["scale_to_zero"] == 2
    # tiny is held from its first work until the call moves (its first call's end plus the
    # 5 s tool), tiny2 from then to the end of the run: no instance idles between them
    assert result.counters["device_held_ms"] == round(1000 * result.end_s)


# ---------------------------------------------------------------------------- autoscaler


@pytest.mark.parametrize(("target", "spread"), [(1, True), (2, False)])
def test_the_autoscaler_scales_a_model_out_at_its_concurrency_target(
    target: int, spread: bool
) -> None:
    """Two sessions of one model at once on two instances: with a target of one call in
    flight per instance the second call scales the model out to the other instance, and
    each session stays where its first call went (it is that instance's only call); a
    target of two keeps both on the first."""
    cluster = two_instances()
    policy = attrs.evolve(POLICIES["autoscale"], concurrency_target=target)
    scripts = [
        script(f"s{k}", "A", 0.0, 3, first=64, growth=16, out=8, tool_s=0.3) for k in range(2)
    ]
    estimators = {n: FakeEstimator() for n in ("tiny-0", "tiny-1")}
    result, core = simulate(cluster, policy, estimators, scripts)
    check_conservation(result, core, scripts)
    where = {s: {r.instance for r in result.calls if r.session_id == s} for s in ("s0", "s1")}
    if spread:
        assert where == {"s0": {"tiny-0"}, "s1": {"tiny-1"}}
    else:
        assert where == {"s0": {"tiny-0"}, "s1": {"tiny-0"}}
