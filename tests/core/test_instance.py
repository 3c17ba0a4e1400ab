"""Instance and cluster cores on hand-sized instances, driven step by step.

Every model here has 32 bytes of KV per token (1 layer, 1 KV head of 8 dims, 2-byte KV) and
1000 bytes of weights; instances use 4-token blocks (128 bytes) and are sized so that the
KV pool holds exactly ``device_blocks`` blocks. The estimator has round numbers: prefill
1000 tok/s, restore 10000 tok/s, decode step 0.01 s, copies at 1e9 B/s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import attrs
import pytest

from talaria.config import ClusterConfig, InstanceSpec, ModelSpec, PolicyConfig
from talaria.core.cluster import ClusterCore
from talaria.core.instance import InstanceBusy, InstanceCore
from talaria.cost.pricing import plan_copy_s
from talaria.errors import ConfigError, ContextTooLong, UnknownModel, UnknownSession
from talaria.memory.kv import SessionKV
from talaria.policy.baselines import POLICIES
from talaria.schedule import Request, Schedule
from talaria.types import DEFAULT_TENANT, Call, EventKind, Link, Residency, SessionKey, TokenSeq
from tests.helpers import RoundNumberEstimator as FakeEstimator
from tests.helpers import examples, tiny_spec

WEIGHT_BYTES = 1000
BLOCK_BYTES = 128  # 4 tokens x 32 bytes
TALARIA = POLICIES["talaria"]
ROUND = POLICIES["round"]

S, S1, S2 = (SessionKey(DEFAULT_TENANT, i) for i in ("s", "s1", "s2"))


def model(name: str, max_context: int = 131072) -> ModelSpec:
    return tiny_spec(name, WEIGHT_BYTES, max_context)


def instance_spec(
    policy: PolicyConfig, n_models: int, device_blocks: int, host_blocks: int, name: str = "i0"
) -> InstanceSpec:
    """An instance whose KV pool is exactly ``device_blocks`` (and ``host_blocks``) blocks."""
    # one weight region; staging borrows free KV blocks and reserves nothing
    arena = WEIGHT_BYTES
    return InstanceSpec(
        name=name,
        hardware="fake",
        device_memory_bytes=arena + device_blocks * BLOCK_BYTES,
        host_memory_bytes=n_models * WEIGHT_BYTES + host_blocks * BLOCK_BYTES,
        block_size=4,
        memory_utilization=1.0,
    )


def core(
    policy: PolicyConfig,
    models: tuple[str, ...] = ("A",),
    device_blocks: int = 10,
    host_blocks: int = 16,
) -> InstanceCore:
    spec = instance_spec(policy, len(models), device_blocks, host_blocks)
    inst = InstanceCore(spec, [model(m) for m in models], policy, FakeEstimator())
    assert inst.kv.device_blocks == device_blocks
    assert inst.kv.host_blocks == (host_blocks if policy.host_kv else 0)
    return inst


_fresh = itertools.count(1000)


def tokens(n: int) -> tuple[int, ...]:
    """``n`` token ids never used before in this module (sessions never share blocks)."""
    return tuple(next(_fresh) for _ in range(n))


def next_prompt(req: Request, new_tokens: int) -> TokenSeq:
    """The session's next prompt: ``req``'s history plus ``new_tokens`` fresh tokens."""
    assert req.history is not None
    return req.history.extend(tokens(new_tokens))


class Driver:
    """Runs an instance core the way a substrate does, with a clock that moves 0.1 s a call.

    With several models, a session's model is the first letter of its id ("A1" uses "A").
    """

    def __init__(self, inst: InstanceCore, now: float = 0.0) -> None:
        self.inst = inst
        self.now = now

    def submit(
        self, session: str, index: int, prompt: TokenSeq, out: int, known: int = 0
    ) -> Request:
        model = next(iter(self.inst.models)) if len(self.inst.models) == 1 else session[0]
        call = Call(session, index, model, prompt, out, out, arrival_s=self.now)
        history = prompt.extend(tokens(out))
        req = Request(call, history, out, self.now, known_tokens=known)
        self.inst.submit(req)
        return req

    def step(self) -> Schedule:
        """One ``schedule``; a switch or stage completes at once, a step runs once."""
        inst = self.inst
        sched = inst.schedule(self.now)
        if sched.stage is not None:
            inst.stage_done(sched.stage.model)
        if sched.switch is not None:
            inst.switch_done(sched.switch.model, self.now)
        elif sched.step is not None:
            inst.complete_step(sched.step, self.now, 1)
        inst.check_integrity()
        self.now = round(self.now + 0.1, 6)
        return sched

    def run_until(self, done: Callable[[Schedule], bool]) -> Schedule:
        """Step until a schedule ``done`` accepts; return it."""
        for _ in range(200):
            sched = self.step()
            if done(sched):
                return sched
        raise AssertionError("no such schedule in 200 steps")

    def run(self) -> list[Schedule]:
        """Step until the instance has nothing to do now."""
        done = []
        for _ in range(200):
            sched = self.step()
            done.append(sched)
            if sched.idle:
                return done
        raise AssertionError("the instance never went idle")


# ---------------------------------------------------------------------------- KV budget


def test_a_call_that_does_not_fit_the_budget_waits_for_room() -> None:
    inst = core(PolicyConfig(name="no-reserve", soft_reservations=False), device_blocks=10)
    d = Driver(inst)
    first = d.submit("s1", 0, TokenSeq(tokens(20)), out=4)  # 24 tokens: 6 blocks
    second = d.submit("s2", 0, TokenSeq(tokens(16)), out=4)  # 20 tokens: 5 blocks
    switch = d.step().switch
    assert switch is not None and switch.model == "A"
    sched = d.step()
    assert sched.step is not None
    assert sched.step.prefill == (((S1, 0), 20, 0),)
    assert first.admitted_s == 0.1 and second.admitted_s is None
    assert inst.kv.device_free == 4 and list(inst.waiting["A"]) == [second]
    d.run()
    assert first.finished_s is not None
    assert second.admitted_s is not None and second.admitted_s > first.finished_s - 1e-9
    assert second.finished_s is not None
    assert inst.counters.calls_finished == 2


def test_a_call_larger_than_the_pool_is_refused_at_submit() -> None:
    inst = core(TALARIA, device_blocks=10)
    d = Driver(inst)
    with pytest.raises(ContextTooLong, match="11 KV blocks"):
        d.submit("s1", 0, TokenSeq(tokens(40)), out=4)  # 44 tokens: 11 blocks of 10
    assert not inst.waiting["A"]
    d.submit("s2", 0, TokenSeq(tokens(36)), out=4)  # exactly the pool fits
    d.run()
    assert inst.counters.calls_finished == 1


def test_check_fits_knows_the_model_and_its_context() -> None:
    spec = instance_spec(TALARIA, 1, 100, 0)
    inst = InstanceCore(spec, [model("A", max_context=30)], TALARIA, FakeEstimator())
    prompt = TokenSeq(tokens(28))
    with pytest.raises(ContextTooLong, match="context of 30"):
        inst.check_fits(Call("s", 0, "A", prompt, 4), 4)
    inst.check_fits(Call("s", 0, "A", prompt, 2), 2)
    with pytest.raises(UnknownModel):
        inst.check_fits(Call("s", 0, "B", prompt, 2), 2)


# ---------------------------------------------------------------------------- reservations


def finish_first_call(d: Driver, session: str, prompt_tokens: int, out: int) -> Request:
    req = d.submit(session, 0, TokenSeq(tokens(prompt_tokens)), out)
    d.run()
    assert req.finished_s is not None
    return req


def test_reservation_holds_kv_until_the_waiter_may_reclaim_then_demotes_it() -> None:
    inst = core(TALARIA, device_blocks=10, host_blocks=16)
    d = Driver(inst)
    s1 = finish_first_call(d, "s1", 16, 4)  # history 20 tokens: 5 blocks
    assert S1 in inst.admission.held and inst.kv.is_pinned(S1)
    assert inst.kv.session_kv(S1) == SessionKV(20, 0, 20)

    d.now = 10.0
    s2 = d.submit("s2", 0, TokenSeq(tokens(20)), out=4)  # 6 blocks; 5 free, 5 reserved
    for t in (10.0, 10.25, 10.499):
        d.now = t
        assert d.step().idle
        assert s2.admitted_s is None
        assert inst.kv.session_kv(S1) == SessionKV(20, 0, 20)  # honoured
    d.now = 10.5  # waited reclaim_after_wait_s
    sched = d.step()
    assert s2.admitted_s == 10.5
    assert sched.step is not None
    demoted = [m for m in sched.step.kv_moves if m.link is Link.DEVICE_TO_HOST]
    assert [len(m) for m in demoted] == [5]
    assert inst.counters.reclaims == 1 and inst.admission.reservations_reclaimed == 1
    assert not inst.kv.is_pinned(S1) and S1 not in inst.admission.held
    assert inst.kv.session_kv(S1) == SessionKV(0, 20, 20)  # demoted, nothing lost
    assert inst.kv.dropped_tokens(S1) == 0
    d.run()
    assert s2.finished_s is not None

    d.inst.end_session(S2)  # its KV becomes evictable
    again = d.submit("s1", 1, next_prompt(s1, 4), out=4, known=20)
    d.run()
    assert (again.reused_tokens, again.restored_tokens, again.recomputed_tokens) == (0, 20, 0)
    assert again.finished_s is not None
    assert inst.kv.dropped_tokens(S1) == 0


def test_reservation_expires_after_its_hold_and_then_costs_nothing() -> None:
    slow_decay = attrs.evolve(TALARIA, reservation_horizon_s=10.0, reservation_max_hold_s=120.0)
    inst = core(slow_decay, device_blocks=10, host_blocks=16)
    d = Driver(inst)
    s1 = finish_first_call(d, "s1", 16, 4)
    assert s1.finished_s is not None
    d.now = s1.finished_s + 119.9  # reservation_max_hold_s is 120 s
    d.step()
    assert inst.kv.is_pinned(S1)
    d.now = s1.finished_s + 120.0
    d.step()
    assert not inst.kv.is_pinned(S1) and inst.admission.reservations_expired == 1
    assert inst.kv.session_kv(S1) == SessionKV(20, 0, 20)  # still cached
    s2 = d.submit("s2", 0, TokenSeq(tokens(20)), out=4)
    d.step()
    assert s2.admitted_s == s2.queued_s  # no reclaim wait: the KV was no longer reserved
    assert inst.counters.reclaims == 0
    assert inst.kv.session_kv(S1).host_tokens > 0 and inst.kv.dropped_tokens(S1) == 0


def test_a_returning_session_reuses_its_reserved_kv() -> None:
    inst = core(TALARIA, device_blocks=10, host_blocks=16)
    d = Driver(inst)
    s1 = finish_first_call(d, "s1", 16, 4)
    d.now = 0.5
    again = d.submit("s1", 1, next_prompt(s1, 4), out=4, known=20)
    d.run()
    assert (again.reused_tokens, again.restored_tokens, again.recomputed_tokens) == (20, 0, 0)
    assert S1 in inst.admission.held  # a new reservation for the next gap


# ---------------------------------------------------------------------------- session-prefill


def sp_scenario(policy: PolicyConfig) -> tuple[Driver, Request, Request]:
    """Two models. A's slot opens with s1 (short answer) and s3 (long answer); B's session
    arrives and waits. s1 finishes and its continuation arrives while s3 still runs in A's
    slot. (B arrives once A's slot is chosen: with B waiting from the start, the
    session-aware order would open B's slot first, one session against two.)"""
    inst = core(policy, models=("A", "B"), device_blocks=32, host_blocks=32)
    d = Driver(inst)
    a1 = d.submit("A1", 0, TokenSeq(tokens(8)), out=2)
    d.submit("A3", 0, TokenSeq(tokens(8)), out=10)
    assert d.step().switch is not None  # A's weights from host
    b2 = d.submit("B2", 0, TokenSeq(tokens(8)), out=2)
    d.step()  # opening pass: A1 and A3 prefill
    d.step()  # one decode: A1 answered
    assert a1.finished_s is not None and b2.admitted_s is None
    cont = d.submit("A1", 1, next_prompt(a1, 2), out=2, known=10)
    d.step()
    return d, cont, b2


def test_with_sp_a_continuation_joins_its_models_open_slot() -> None:
    """The session-aware order (talaria) serves B as soon as A's batch drains: a switch away
    and back (2 us here) costs less than waiting for A's sessions' expected returns."""
    d, cont, b2 = sp_scenario(TALARIA)
    inst = d.inst
    assert cont.admitted_s == cont.queued_s and cont.sp_admitted
    assert inst.counters.sp_admissions == 1
    assert cont.reused_tokens == 8  # the two full blocks of its 10-token history
    d.run()
    assert cont.finished_s is not None and b2.finished_s is not None
    assert b2.admitted_s is not None and b2.admitted_s >= cont.finished_s
    a1, a3 = SessionKey(DEFAULT_TENANT, "A1"), SessionKey(DEFAULT_TENANT, "A3")
    assert a1 in inst.tool_gaps and a3 in inst.tool_gaps  # served while A's were away
    assert inst.counters.model_switches == 2 and inst.counters.sp_admissions == 1


def test_with_sp_and_round_robin_slots_an_idle_slot_lingers_for_returns() -> None:
    d, cont, b2 = sp_scenario(POLICIES["talaria-no-slot-order"])
    inst = d.inst
    assert cont.admitted_s == cont.queued_s and cont.sp_admitted
    assert inst.counters.sp_admissions == 1
    assert cont.reused_tokens == 8  # the two full blocks of its 10-token history
    d.run()
    assert cont.finished_s is not None and b2.admitted_s is None  # A lingers for A1, A3
    inst.end_session(SessionKey(DEFAULT_TENANT, "A1"))
    inst.end_session(SessionKey(DEFAULT_TENANT, "A3"))
    switch = d.step().switch  # nobody expected back: B's turn, from the staging area
    assert switch is not None and switch.model == "B"
    assert [s.link for s in switch.steps] == [Link.DEVICE_TO_DEVICE]
    assert inst.counters.staged_switches == 1 and inst.counters.model_switches == 2
    d.run()
    assert b2.finished_s is not None
    assert not b2.sp_admitted and inst.counters.sp_admissions == 1


def stage_scenario(ended: str | None = None) -> tuple[Driver, Schedule]:
    """Four models, host room for three weight copies (A, B and C start there). A1 and B1
    are served in turn and go into tool gaps (``ended``: that session ends instead); C's
    slot opens for a long answer, and one of A and B is staged meanwhile (it will be back).
    Then D1 arrives. Returns the schedule of the step that first sees D1 waiting."""
    spec = attrs.evolve(instance_spec(TALARIA, 3, 32, 16), name="i0")
    inst = InstanceCore(spec, [model(m) for m in "ABCD"], TALARIA, FakeEstimator())
    assert inst.arena.host_weight_bytes == 3281  # three copies of 1000 bytes, not four
    d = Driver(inst)
    for session in ("A1", "B1"):
        d.submit(session, 0, TokenSeq(tokens(8)), out=2)
        d.run()
        if session == ended:
            inst.end_session(SessionKey(DEFAULT_TENANT, session))
    d.submit("C1", 0, TokenSeq(tokens(8)), out=20)
    d.run_until(lambda sched: sched.stage is not None)
    d.submit("D1", 0, TokenSeq(tokens(8)), out=2)
    sched = d.step()
    assert sched.step is not None and inst.rounds.current == "C"  # C's slot goes on
    return d, sched


def test_a_stage_never_drops_the_host_copy_of_a_model_whose_session_is_in_a_gap() -> None:
    """Staging D (predicted next: its call waits) would read it from disk and drop the
    least recently used host copy, A's, while A1 is in a tool gap here: no stage, and A's
    copy stays."""
    d, sched = stage_scenario()
    assert d.inst.arena.staged_model == "B"
    assert sched.stage is None and d.inst.arena.on_host("A")
    assert d.inst.counters.cold_loads == 0


def test_a_stage_may_drop_the_host_copy_of_a_model_with_no_work_here() -> None:
    d, sched = stage_scenario(ended="A1")
    assert sched.stage is not None and sched.stage.model == "D"
    assert sched.stage.host_drops == ("A",)
    assert [s.link for s in sched.stage.steps] == [Link.DISK_TO_HOST, Link.HOST_TO_DEVICE]
    assert d.inst.counters.cold_loads == 1 and not d.inst.arena.on_host("A")


def test_without_sp_a_continuation_waits_for_the_next_round() -> None:
    d, cont, b2 = sp_scenario(ROUND)
    inst = d.inst
    assert cont.admitted_s is None
    d.run()
    assert b2.finished_s is not None and cont.finished_s is not None
    assert cont.admitted_s is not None and cont.admitted_s > b2.finished_s
    assert not cont.sp_admitted and inst.counters.sp_admissions == 0
    assert inst.counters.model_switches == 3  # A, B, A again
    assert inst.counters.staged_switches == 0


def test_without_sp_a_lone_model_still_serves_late_arrivals() -> None:
    inst = core(ROUND, models=("A", "B"), device_blocks=32, host_blocks=0)
    d = Driver(inst)
    a1 = d.submit("A1", 0, TokenSeq(tokens(8)), out=2)
    d.submit("A3", 0, TokenSeq(tokens(8)), out=6)
    d.step()
    d.step()
    d.step()
    assert a1.finished_s is not None
    cont = d.submit("A1", 1, next_prompt(a1, 2), out=2, known=10)
    d.run()
    assert cont.finished_s is not None  # a new round of A, though B never had work
    assert inst.counters.model_switches == 1 and inst.rounds.slots_opened == 2


# ---------------------------------------------------------------------------- cluster core


def cluster_core(policy: PolicyConfig = TALARIA, n_instances: int = 2) -> ClusterCore:
    specs = [instance_spec(policy, 2, 10, 16, name=f"i{k}") for k in range(n_instances)]
    config = ClusterConfig(models=(model("A"), model("B")), instances=specs)
    return ClusterCore(config, policy, {s.name: FakeEstimator() for s in specs})


def snapshot(cc: ClusterCore) -> tuple[object, ...]:
    sessions = {sid: attrs.asdict(info) for sid, info in cc.sessions.items()}
    queues = {
        (name, m): tuple(q) for name, inst in cc.instances.items() for m, q in inst.waiting.items()
    }
    return (sessions, cc.decisions, queues)


def test_cluster_refuses_bad_input_without_changing_state() -> None:
    cc = cluster_core()
    cc.place(Call("s", 0, "A", TokenSeq(tokens(4)), 2), 2, None, 0.0)
    before = snapshot(cc)
    with pytest.raises(UnknownModel):
        cc.place(Call("s", 1, "nope", TokenSeq(tokens(4)), 2), 2, None, 0.0)
    with pytest.raises(ContextTooLong):
        cc.place(Call("s", 1, "A", TokenSeq(tokens(40)), 8), 8, None, 0.0)  # 12 of 10 blocks
    with pytest.raises(UnknownSession):
        cc.event(SessionKey(DEFAULT_TENANT, "never-seen"), EventKind.TOOL_START, 1.0, 0.0)
    assert snapshot(cc) == before
    cc.check_integrity()


def test_cluster_routes_continuations_home_and_end_releases_the_reservation() -> None:
    cc = cluster_core()
    prompt = TokenSeq(tokens(8))
    history = prompt.extend(tokens(4))
    inst, req, decision = cc.place(Call("s", 0, "A", prompt, 4), 4, history, 0.0)
    assert decision.instance == "i0" == inst.spec.name  # identical instances: by name
    assert {e.instance for e in decision.estimates} == {"i0", "i1"}
    Driver(inst, 0.0).run()
    assert req.finished_s is not None
    cc.on_finished(req)
    assert cc.sessions[S].known_tokens == 12 and cc.sessions[S].last_output == 4
    assert S in inst.admission.held and inst.kv.is_pinned(S)

    cc.event(S, EventKind.TOOL_START, 100.0, 1.0)  # a long tool: unlikely back soon
    assert inst.admission.held[S].probability < 0.05

    prompt = history.extend(tokens(4))
    _, again, decision = cc.place(Call("s", 1, "A", prompt, 4), 4, prompt.extend(tokens(4)), 2.0)
    assert decision.instance == "i0"  # its KV is there
    assert decision.chosen.reused_tokens == 12
    assert again.known_tokens == 12
    Driver(inst, 2.0).run()
    cc.on_finished(again)
    assert S in inst.admission.held

    cc.event(S, EventKind.END, None, 3.0)
    assert inst.admission.held == {} and not inst.kv.is_pinned(S)
    assert S not in inst.kv.sessions and cc.sessions[S].ended
    with pytest.raises(UnknownSession):
        cc.event(S, EventKind.TOOL_START, 1.0, 3.0)
    cc.check_integrity()
    kv = inst.kv
    assert kv.device_free + kv.device_evictable == kv.device_blocks


def test_tool_end_makes_a_long_announced_gap_an_imminent_return() -> None:
    inst = core(TALARIA, device_blocks=10, host_blocks=16)
    d = Driver(inst)
    req = finish_first_call(d, "s1", 16, 4)
    assert req.finished_s is not None
    since = req.finished_s  # the gap starts when the answer is out
    inst.hint(S1, 600.0, since)  # a long test run announced: unlikely back soon
    far = inst.kv.sessions[S1].priority
    inst.tool_ended(S1, since + 1.0)  # the tool ended after one second
    near = inst.kv.sessions[S1].priority
    assert far < 0.05 < 0.5 < near
    expected = inst.admission.probability(since, since + 1.0, 1.0)
    assert inst.kv.sessions[S1].priority == pytest.approx(expected, rel=1e-12)
    inst.tool_ended(
        SessionKey(DEFAULT_TENANT, "nobody"), since + 1.0
    )  # unknown sessions are ignored
    inst.check_integrity()


# ---------------------------------------------------------------------------- gap learning


def learning_core() -> tuple[ClusterCore, object]:
    from talaria.session.gaps import GapModelConfig, GapPredictor
    from talaria.session.priors import load_tool_priors

    specs = [instance_spec(TALARIA, 2, 10, 16, name="i0")]
    config = ClusterConfig(models=(model("A"), model("B")), instances=specs)
    learner = GapPredictor(load_tool_priors(), GapModelConfig(alpha=0.5, clip_ratio=None))
    cc = ClusterCore(config, TALARIA, {"i0": FakeEstimator()}, learner=learner)
    return cc, learner


def one_call(cc: ClusterCore, sid: str, index: int, prompt: TokenSeq, now: float) -> Request:
    inst, req, _ = cc.place(Call(sid, index, "A", prompt, 2), 2, prompt.extend(tokens(2)), now)
    Driver(inst, now).run()
    cc.on_finished(req)
    return req


def test_the_server_learns_tool_gaps_from_tool_end_and_predicts_unhinted_ones() -> None:
    """tool_start without expected_s takes the learner's prediction for the tool; tool_end's
    measured seconds teach it; the next tool_start of that tool expects the learned value."""
    cc, learner = learning_core()
    inst = cc.instances["i0"]
    req = one_call(cc, "s", 0, TokenSeq(tokens(8)), 0.0)
    prior = learner.predict("tests")  # type: ignore[attr-defined]
    cc.event(S, EventKind.TOOL_START, None, 1.0, tool="tests")
    assert inst.tool_gaps[S].expected_s == prior
    cc.event(S, EventKind.TOOL_END, None, 2.0, measured_s=prior * 4)
    learned = learner.predict("tests")  # type: ignore[attr-defined]
    assert learned == pytest.approx(prior * 2.0)  # log-space halfway (alpha 0.5, no clip)
    assert learner.observations("tests") == 1  # type: ignore[attr-defined]
    assert req.history is not None
    one_call(cc, "s", 1, req.history.extend(tokens(2)), 3.0)
    cc.event(S, EventKind.TOOL_START, None, 4.0, tool="tests")
    assert inst.tool_gaps[S].expected_s == pytest.approx(learned)
    cc.check_integrity()


def test_without_hints_the_time_to_the_next_call_is_learned_per_session() -> None:
    cc, learner = learning_core()
    inst = cc.instances["i0"]
    first = one_call(cc, "s", 0, TokenSeq(tokens(8)), 0.0)
    assert first.finished_s is not None
    untold = learner.predict("untold")  # type: ignore[attr-defined]
    assert inst.tool_gaps[S].expected_s == untold  # the server's guess, no hint sent
    assert first.history is not None
    back = first.finished_s + 3.0  # the session came back 3 s after its answer
    second = one_call(cc, "s", 1, first.history.extend(tokens(2)), back)
    assert learner.observations("untold") == 1  # type: ignore[attr-defined]
    assert cc.sessions[S].gap_s == pytest.approx(3.0)
    assert inst.tool_gaps[S].expected_s == pytest.approx(3.0)  # its own history now
    assert second.finished_s is not None
    cc.check_integrity()


def test_an_answer_ending_in_a_tool_call_names_the_gap_no_hint_needed() -> None:
    """After an answer that called ``Bash``, the instance expects the learner's gap for
    Bash (not the untold one), and the next call's arrival teaches Bash's key, not the
    untold one; an answer calling two different tools expects the sum and is learned as
    an untold gap."""
    cc, learner = learning_core()
    inst = cc.instances["i0"]
    bash = learner.key_for("Bash")  # type: ignore[attr-defined]
    first = one_call(cc, "s", 0, TokenSeq(tokens(8)), 0.0)
    assert first.finished_s is not None and first.history is not None
    cc.tool_calls(S, ["Bash"], first.finished_s)
    assert inst.tool_gaps[S].expected_s == learner.predict(bash)  # type: ignore[attr-defined]
    back = first.finished_s + 5.0
    second = one_call(cc, "s", 1, first.history.extend(tokens(2)), back)
    assert learner.observations(bash) == 1  # type: ignore[attr-defined]
    assert learner.observations("untold") == 0  # type: ignore[attr-defined]
    assert second.finished_s is not None and second.history is not None
    read = learner.key_for("Read")  # type: ignore[attr-defined]
    cc.tool_calls(S, ["Bash", "Read", "Bash"], second.finished_s)
    both = learner.predict(bash) + learner.predict(read)  # type: ignore[attr-defined]
    assert inst.tool_gaps[S].expected_s == pytest.approx(both)
    one_call(cc, "s", 2, second.history.extend(tokens(2)), second.finished_s + 2.0)
    assert learner.observations(bash) == 1  # type: ignore[attr-defined]
    assert learner.observations("untold") == 1  # type: ignore[attr-defined]
    cc.check_integrity()


def test_a_clients_hint_takes_over_from_the_answers_tool_calls() -> None:
    cc, learner = learning_core()
    first = one_call(cc, "s", 0, TokenSeq(tokens(8)), 0.0)
    assert first.finished_s is not None and first.history is not None
    cc.tool_calls(S, ["Bash"], first.finished_s)
    cc.event(S, EventKind.TOOL_START, None, first.finished_s, tool="tests")
    cc.event(S, EventKind.TOOL_END, None, first.finished_s + 4.0)
    one_call(cc, "s", 1, first.history.extend(tokens(2)), first.finished_s + 4.5)
    assert learner.observations("tests") == 1  # type: ignore[attr-defined]
    assert learner.observations(learner.key_for("Bash")) == 0  # type: ignore[attr-defined]
    with pytest.raises(UnknownSession):
        cc.tool_calls(SessionKey(DEFAULT_TENANT, "nobody"), ["Bash"], 1.0)


# ---------------------------------------------------------------------------- Continuum


def test_program_level_fcfs_admits_the_oldest_program_first() -> None:
    """ttl-pin (Continuum): a full pool admits one call at a time; the waiting calls go by
    their session's first arrival, not their own."""
    ttl = POLICIES["ttl-pin"]
    inst = core(ttl, device_blocks=6, host_blocks=0)
    d = Driver(inst)
    reqs = {}
    for sid, started in (("young", 5.0), ("old", 1.0), ("middle", 3.0)):
        call = Call(sid, 3, "A", TokenSeq(tokens(16)), 4, 4, arrival_s=d.now)
        req = Request(call, call.prompt.extend(tokens(4)), 4, d.now, session_start_s=started)
        inst.submit(req)  # 20 tokens each: 5 of the 6 blocks, one call at a time
        reqs[sid] = req
        d.now += 0.01
    d.run()
    admitted = sorted(reqs, key=lambda s: reqs[s].admitted_s or math.inf)
    assert admitted == ["old", "middle", "young"]
    assert all(r.finished_s is not None for r in reqs.values())
    inst.check_integrity()


def test_a_tenants_backlog_does_not_starve_another_tenant() -> None:
    """Tenant a queues five calls, then tenant b one; the pool holds one call at a time. b's
    call is admitted second, not sixth; a's calls keep their order."""
    inst = core(TALARIA, device_blocks=6, host_blocks=0)
    d = Driver(inst)
    reqs = []
    for i, who in enumerate("aaaaab"):
        call = Call(f"{who}{i}", 0, "A", TokenSeq(tokens(16)), 4, 4, who, arrival_s=d.now)
        req = Request(call, call.prompt.extend(tokens(4)), 4, d.now)
        inst.submit(req)  # 20 tokens each: 5 of the 6 blocks, one call at a time
        reqs.append(req)
        d.now += 0.01
    d.run()
    admitted = [r.call.session_id for r in sorted(reqs, key=lambda r: r.admitted_s or math.inf)]
    assert admitted == ["a0", "b5", "a1", "a2", "a3", "a4"]
    inst.check_integrity()


# ---------------------------------------------------------------------------- routing bound

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from talaria.policy.router import estimate  # noqa: E402


@settings(max_examples=examples(60), deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.sampled_from("AB"), st.integers(1, 8), st.integers(1, 6), st.integers(0, 3)),
        min_size=1,
        max_size=8,
    ),
    probe=st.tuples(st.sampled_from("AB"), st.integers(1, 24), st.integers(1, 40)),
    known=st.integers(0, 30),
    reuse=st.booleans(),
    left=st.sampled_from([1.0, 11.0]) | st.floats(1.0, 1e4),
    wake=st.booleans(),
    price=st.sampled_from([0.0, 30.0]) | st.floats(0.0, 1e4),
)
def test_the_routing_bound_never_exceeds_the_exact_estimate(
    calls: list[tuple[str, int, int, int]],
    probe: tuple[str, int, int],
    known: int,
    reuse: bool,
    left: float,
    wake: bool,
    price: float,
) -> None:
    """Whatever the instances hold (queued, running, finished and cached sessions), the
    optimistic view's charge is at most the exact charge of any call (the estimate with a
    wake shared over ``left`` calls, on a pool whose instances start at zero where ``wake``,
    and ``price`` charged for a wake): the pruning search can never skip the best instance."""
    cc = wake_pool(attrs.evolve(TALARIA, keep_alive_s=0.0)) if wake else cluster_core()
    prompts = []
    for i, (m, n, out, steps) in enumerate(calls):
        prompt = TokenSeq(tokens(4 * n))  # whole blocks: a finished prompt is cached in full
        prompts.append((m, prompt))
        inst, _, _ = cc.place(Call(f"s{i}", 0, m, prompt, out), out, None, float(i))
        for _ in range(steps):
            sched = inst.schedule(float(i))
            if sched.switch is not None:
                inst.switch_done(sched.switch.model, float(i))
            elif sched.step is not None:
                inst.complete_step(sched.step, float(i), 1)
    model, n, out = probe
    prompt = TokenSeq(tokens(n))
    if reuse:  # a prompt some instance may hold in full: nothing left to prefill
        model, prompt = prompts[0]
    call = Call("probe", 0, model, prompt, out)
    for inst in cc.instances.values():
        view = inst.estimates.view(call, 9.0, False)
        exact = estimate(view, known, out).charge_s(left, price)
        bound = inst.estimates.prefill_bound_s(call, out, left, price)
        assert inst.estimates.bound_s(model, out, left, price) <= bound <= exact
        if not inst.kv.holds_prefix(model, call.tenant, prompt):  # the bound counts the prefill
            assert view.match.device_tokens == view.match.host_tokens == 0
            at_zero = attrs.evolve(  # the bound leaves out the hold of another model's slot
                view,
                decode_step_s=inst.estimates.optimistic_view(model).decode_step_s,
                slot_wait_s=inst.estimates.slot_wait_s(model),
            )
            assert bound >= estimate(at_zero, known, out).charge_s(left, price) * (1 - 1e-9)
    cc.check_integrity()


def test_check_integrity_recomputes_the_cores_own_counters() -> None:
    inst = core(TALARIA, device_blocks=10, host_blocks=16)
    d = Driver(inst)
    finish_first_call(d, "s1", 16, 4)
    d.submit("s2", 0, TokenSeq(tokens(8)), out=2)
    inst.check_integrity()
    calls = inst.calls
    for corrupt, message in (
        (lambda: calls._queued_tokens.__setitem__("A", 99), "queued tokens"),
        (lambda: calls._running_of.__setitem__("A", 3), "running counted"),
        (lambda: setattr(calls, "_load_tokens", 1), "load"),
        (lambda: inst.kv.unpin(S1), "reserved but not pinned"),
    ):
        saved = (dict(calls._queued_tokens), dict(calls._running_of), calls._load_tokens)
        corrupt()
        with pytest.raises(RuntimeError, match=message):
            inst.check_integrity()
        calls._queued_tokens, calls._running_of, calls._load_tokens = saved[0], saved[1], saved[2]


def test_memoized_estimates_follow_the_tables_without_being_cleared() -> None:
    """The router's bound and the switch time are memoized on the tables' change counts:
    a queued call changes the bound at once, and a corrupted memo is caught by
    ``check_integrity``."""
    inst = core(TALARIA, models=("A", "B"), device_blocks=10, host_blocks=16)
    est = inst.estimates
    idle = est.bound_s("B", 5)
    assert est.bound_s("B", 5) == idle  # memoized: same tables, same value
    d = Driver(inst)
    d.submit("A1", 0, TokenSeq(tokens(8)), out=2)  # queued, not yet scheduled
    fresh = InstanceCore(inst.spec, list(inst.models.values()), TALARIA, FakeEstimator())
    fresh.submit(Request(inst.waiting["A"][0].call, None, 2, d.now))
    assert est.bound_s("B", 5) == fresh.estimates.bound_s("B", 5) != idle
    inst.check_integrity()
    est._switch_memo[1]["B"] = 123.0
    with pytest.raises(RuntimeError, match=r"B: switch memo 123\.0 s"):
        inst.check_integrity()


# ---------------------------------------------------------------------------- weight regions


def test_with_a_region_per_model_a_switched_away_model_stays_resident() -> None:
    """Two regions, two models taking turns (round-robin): each model's weights are copied
    once, every later switch copies nothing and is priced at nothing."""
    spec = attrs.evolve(
        instance_spec(ROUND, 2, 10, 16),
        device_memory_bytes=2 * WEIGHT_BYTES + 10 * BLOCK_BYTES,
        weight_regions=2,
    )
    inst = InstanceCore(spec, [model("A"), model("B")], ROUND, FakeEstimator())
    assert inst.kv.device_blocks == 10 and inst.arena.arena_bytes == 2 * WEIGHT_BYTES
    d = Driver(inst)
    for turn in range(3):
        a = d.submit(f"A{turn}", 0, TokenSeq(tokens(4)), 1)
        b = d.submit(f"B{turn}", 0, TokenSeq(tokens(4)), 1)
        d.run()
        assert a.finished_s is not None and b.finished_s is not None
        resident = {m: inst.arena.residency(m).value for m in ("A", "B")}
        assert sorted(resident.values()) == ["active", "resident"]
        idle = next(m for m in ("A", "B") if resident[m] == "resident")
        assert inst.estimates.switch_s(idle) == 0.0
    assert inst.counters.model_switches == 6
    assert inst.counters.weight_bytes_moved == 2 * WEIGHT_BYTES  # one copy per model, ever


def test_the_session_aware_order_expects_no_reload_when_every_model_keeps_a_region() -> None:
    one = core(TALARIA, ("A", "B"))
    spec = attrs.evolve(
        one.spec, device_memory_bytes=2 * WEIGHT_BYTES + 10 * BLOCK_BYTES, weight_regions=2
    )
    two = InstanceCore(spec, [model("A"), model("B")], TALARIA, FakeEstimator())
    for inst, reload_s in ((one, WEIGHT_BYTES / 1e9), (two, 0.0)):
        d = Driver(inst)
        d.submit("A1", 0, TokenSeq(tokens(4)), 1)
        assert inst.estimates.remaining("A", d.now)[3] == reload_s


def test_more_weight_regions_than_device_memory_holds_is_a_config_error() -> None:
    spec = attrs.evolve(instance_spec(ROUND, 2, 10, 16), weight_regions=3)
    with pytest.raises(ConfigError, match=r"3 weight regions .* use fewer weight_regions"):
        ClusterConfig([model("A"), model("B")], [spec])
    with pytest.raises(ConfigError, match="weight_regions"):
        attrs.evolve(spec, weight_regions=0)


# ---------------------------------------------------------------------------- keep-alive


def test_keep_alive_outlasts_reservations_then_the_instance_gives_its_device_back() -> None:
    policy = attrs.evolve(
        TALARIA, keep_alive_s=5.0, reservation_horizon_s=10.0, reservation_max_hold_s=120.0
    )
    inst = core(policy, device_blocks=10, host_blocks=16)
    d = Driver(inst)
    s1 = finish_first_call(d, "s1", 16, 4)  # 20 tokens of KV: 5 blocks, reserved
    assert s1.finished_s is not None
    idle_since = s1.finished_s
    deadline = inst.admission.held[S1].deadline_s
    assert deadline == idle_since + 120.0  # the hold, longer than the keep-alive
    assert inst.release_at(idle_since, idle_since) == deadline
    d.now = deadline - 0.1
    assert inst.release_at(idle_since, d.now) == deadline
    assert not inst.can_scale_to_zero()
    before = (inst.arena.residency("A"), inst.kv.session_kv(S1), dict(inst.admission.held))
    with pytest.raises(InstanceBusy):
        inst.scale_to_zero()
    assert (inst.arena.residency("A"), inst.kv.session_kv(S1), dict(inst.admission.held)) == (
        before
    )

    d.now = deadline  # the reservation ends: the keep-alive (5 s) ran out long ago
    assert inst.release_at(idle_since, d.now) == idle_since + 5.0
    assert inst.can_scale_to_zero()
    plan = inst.scale_to_zero()
    assert plan.link is Link.DEVICE_TO_HOST and len(plan) == 5
    assert inst.released and inst.counters.scale_to_zero == 1
    assert inst.arena.residency("A") is Residency.HOST and inst.rounds.slot is None
    assert inst.kv.session_kv(S1) == SessionKV(0, 20, 20)  # on host, restorable
    assert inst.kv.device_free == inst.kv.device_blocks
    sched = d.step()
    assert sched.idle and sched.stage is None  # nothing is staged into a device it gave back
    inst.check_integrity()

    again = d.submit("s1", 1, next_prompt(s1, 4), out=4, known=20)
    sched = d.step()
    assert sched.switch is not None and sched.switch.bytes_by_link == {Link.HOST_TO_DEVICE: 1000}
    assert not inst.released
    d.run()
    assert (again.reused_tokens, again.restored_tokens, again.recomputed_tokens) == (0, 20, 0)


@pytest.mark.parametrize(
    ("keep_alive_s", "expected"), [(0.0, 3.0), (7.5, 10.5), (math.inf, math.inf)]
)
def test_a_per_request_policy_keeps_an_idle_instance_for_its_timer_alone(
    keep_alive_s: float, expected: float
) -> None:
    inst = core(attrs.evolve(POLICIES["serverless"], keep_alive_s=keep_alive_s))
    d = Driver(inst)
    finish_first_call(d, "s1", 16, 4)
    assert not inst.admission.held
    assert inst.release_at(3.0, 3.0) == expected
    assert inst.can_scale_to_zero()


class SlowWake(FakeEstimator):
    """``FakeEstimator`` on a platform that takes 2 s to give an instance its devices back."""

    def provision_s(self) -> float:
        return 2.0


def test_the_switch_that_wakes_an_instance_waits_for_its_devices_and_the_router_knows() -> None:
    policy = attrs.evolve(TALARIA, keep_alive_s=0.0, soft_reservations=False)
    inst = InstanceCore(
        instance_spec(policy, 2, 32, 16), [model(m) for m in "AB"], policy, SlowWake()
    )
    d = Driver(inst)
    assert inst.released  # a pool that scales to zero starts there: no devices held yet
    assert inst.estimates.switch_s("A") == pytest.approx(2.0 + 1000 / 1e9)
    d.submit("A1", 0, TokenSeq(tokens(8)), out=2)
    first = d.step()
    assert first.switch is not None and first.switch.provision_s == 2.0
    d.run()
    load_s = inst.estimates.switch_s("B")  # from host: no wait while provisioned
    inst.scale_to_zero()
    assert inst.estimates.switch_s("A") == pytest.approx(2.0 + load_s)
    assert inst.estimates.switch_s("B") == pytest.approx(2.0 + load_s)
    d.submit("B1", 0, TokenSeq(tokens(8)), out=2)
    woken = d.step()
    assert woken.switch is not None and woken.switch.provision_s == 2.0
    d.run()
    assert inst.estimates.switch_s("A") == pytest.approx(load_s)  # provisioned again
    d.submit("A1", 1, TokenSeq(tokens(8)), out=2)
    again = d.step()
    assert again.switch is not None and again.switch.provision_s == 0.0
    never = InstanceCore(
        instance_spec(TALARIA, 2, 32, 16), [model(m) for m in "AB"], TALARIA, SlowWake()
    )
    assert not never.released  # a pool that never scales to zero starts provisioned
    assert never.estimates.switch_s("A") == pytest.approx(1000 / 1e9)


def test_a_call_routed_to_an_instance_still_waking_waits_for_what_is_left_of_the_wake() -> None:
    """The switch that wakes an instance commits its model at once, so without the wake's
    end the router would see the model active and nothing to wait for."""
    policy = attrs.evolve(TALARIA, keep_alive_s=0.0, soft_reservations=False)
    inst = InstanceCore(
        instance_spec(policy, 2, 32, 16), [model(m) for m in "AB"], policy, SlowWake()
    )
    inst.submit(Request(Call("A1", 0, "A", TokenSeq(tokens(8)), 2), None, 2, 0.0))
    wake = inst.schedule(0.0).switch
    assert wake is not None and inst.arena.active_model == "A"
    until = inst.slots.waking_until_s
    assert until == pytest.approx(plan_copy_s(inst.estimator, wake)) and 2.0 < until < 2.01
    call = Call("A2", 0, "A", TokenSeq(tokens(8)), 2)
    assert inst.estimates.switch_s("A") == 0.0
    assert inst.estimates.view(call, 0.5, False).slot_wait_s == pytest.approx(until - 0.5)
    assert inst.estimates.held_wait_s("B", 0.5) >= until - 0.5
    assert inst.estimates.bound_s("A", 2) <= inst.estimates.held_wait_s("A", 0.5)
    inst.switch_done("A", until)
    assert inst.slots.waking_until_s is None
    assert inst.estimates.held_wait_s("A", until) == 0.0
    plain = InstanceCore(  # a switch that wakes nothing sets no end
        instance_spec(TALARIA, 2, 32, 16), [model(m) for m in "AB"], TALARIA, SlowWake()
    )
    plain.submit(Request(Call("A1", 0, "A", TokenSeq(tokens(8)), 2), None, 2, 0.0))
    assert plain.schedule(0.0).switch is not None and plain.slots.waking_until_s is None


def test_an_instance_that_gave_its_device_back_stages_nothing_until_a_call_wakes_it() -> None:
    policy = attrs.evolve(TALARIA, keep_alive_s=0.0, soft_reservations=False)
    inst = InstanceCore(
        instance_spec(policy, 2, 32, 16), [model(m) for m in "AB"], policy, FakeEstimator()
    )
    d = Driver(inst)
    for session in ("A1", "B1"):
        d.submit(session, 0, TokenSeq(tokens(8)), out=2)
        d.run()
    assert inst.arena.staged_model == "A"  # staged while B's slot ran: A1 is in a tool gap
    inst.scale_to_zero()
    assert inst.arena.staged_model is None and inst.arena.active_model is None
    for _ in range(3):
        assert d.step().stage is None
    assert inst.arena.staging_in_progress is None and inst.kv.lent_blocks == 0
    inst.arena.switch("A")  # weights on a device given back: the integrity check names it
    with pytest.raises(RuntimeError, match="scaled to zero"):
        inst.check_integrity()
    inst.arena.vacate()
    d.submit("B1", 1, TokenSeq(tokens(8)), out=2)
    d.run()
    assert not inst.released and inst.arena.residency("B") is Residency.ACTIVE


class WakeIn5(FakeEstimator):
    """``FakeEstimator`` on a platform that takes 5 s to give an instance its devices."""

    def provision_s(self) -> float:
        return 5.0


def wake_pool(policy: PolicyConfig) -> ClusterCore:
    """Two instances that scale to zero (both start there), models A and B, 5 s to wake."""
    specs = [instance_spec(policy, 2, 32, 16, name=f"i{k}") for k in range(2)]
    config = ClusterConfig(models=(model("A"), model("B")), instances=specs)
    return ClusterCore(config, policy, {s.name: WakeIn5() for s in specs})


def run_a_on_i0(cc: ClusterCore) -> None:
    """Wake i0 for a call of A and admit it: A's slot is open there, its call running."""
    inst, _, _ = cc.place(Call("a", 0, "A", TokenSeq(tokens(8)), 50), 50, None, 0.0)
    assert inst.spec.name == "i0"
    sched = inst.schedule(0.0)
    assert sched.switch is not None and sched.switch.provision_s == 5.0
    inst.switch_done("A", 5.0)
    assert inst.schedule(5.0).step is not None


def test_the_cluster_learns_calls_per_session_from_the_sessions_that_end() -> None:
    cc = wake_pool(attrs.evolve(TALARIA, keep_alive_s=0.0))
    for i in range(3):
        cc.place(Call("s", i, "A", TokenSeq(tokens(4 + i)), 2), 2, None, float(i))
    cc.event(SessionKey(DEFAULT_TENANT, "s"), EventKind.END, None, 3.0)
    assert cc.lengths.n_ended == 1
    assert cc.lengths.expected_left(0) == 1.0  # too few ended sessions to trust: the prior


@pytest.mark.parametrize(("shared", "chosen"), [(True, "i1"), (False, "i0")])
def test_a_session_expected_back_many_times_wakes_an_instance_rather_than_wait(
    shared: bool, chosen: str
) -> None:
    """A's slot is open on i0; a new session of B either waits there for A's hold and
    switches (its call done sooner) or wakes i1 (5 s). Sessions here make 11 calls, so the
    new one is charged an eleventh of the wake and wakes i1; a router that charges the whole wake
    to one call keeps it on i0. The estimates are the calls' own either way."""
    policy = attrs.evolve(TALARIA, keep_alive_s=0.0, wake_shared=shared)
    cc = wake_pool(policy)
    run_a_on_i0(cc)
    for _ in range(5):
        cc.lengths.observe(11)
    assert cc.lengths.expected_left(0) == 11.0
    call = Call("b", 0, "B", TokenSeq(tokens(8)), 50)
    by = {n: estimate(i.estimates.view(call, 5.0, False), 0, 50) for n, i in cc.instances.items()}
    _, _, d = cc.place(call, 50, None, 5.0)
    assert d.instance == chosen
    assert by["i1"].wake_s == 5.0 and by["i1"].switch_s == pytest.approx(5.0, abs=1e-3)
    i1_service = by["i1"].total_s - by["i1"].switch_s
    assert by["i1"].charge_s(11.0) == pytest.approx(5.0 / 11 + i1_service, abs=1e-3)
    assert by["i0"].wake_s == 0.0
    waits = by["i0"].slot_wait_s + by["i0"].switch_s
    assert 5.0 / 11 < waits < 5.0  # the hold of A's slot: between the shared and the whole wake
    assert by["i0"].total_s < by["i1"].total_s
