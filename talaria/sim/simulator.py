"""Discrete-event simulator: an event heap, a virtual clock, and the real policy and memory.

Sessions (``SessionScript``) are just another request source: each sends its calls in
order, waits for the answer, runs its tool gap, sends hints as a client would, and ends.
Calls go through the real ``ClusterCore`` (router, admission, rounds, KV and weight
managers); the only simulated part is time: the ``Estimator`` (the roofline cost model)
prices each engine step, block move and weight copy.

Decode-only stretches are fast-forwarded: when a step has no prefill, nothing could join
the batch and no other model's call waits on the instance, up to ``StepPlan.repeat``
identical steps run as one event. An event that changes the instance's tables (a call placed
there, a tool gap started or ended, KV blocks freed or made evictable, weights moved) cuts
the stretch at the end of the step in progress, so the instance decides again within one
step of the change, as it would stepping one step per event; events elsewhere in the pool do
not cut it. A stretch also ends with the step in progress when a reservation may expire, and
after ``STRETCH_S`` (1 s) in any case. Every other step (beside a weight stage, behind KV
moves, or while another model waits: the slot order then decides at every step) is one event.
With a run of steps priced as the sum of its steps, the result is the same as stepping one
step per event (tests/sim/test_simulator.py checks it on a small pool); the simulator prices
a stretch at its mean context, which differs from that sum in the last bits.

A weight stage copies alongside steps. Where the instance's estimator measures the
contention (``Estimator.stage_contention``), it is priced: a step beside the stage takes
``step_slowdown`` times longer for as long as they overlap, the stage copies at ``share`` of
its idle rate while steps run (at its idle rate otherwise), and host-to-device KV moves
share the host link with it half and half (both slowed while both copy). Without a
measurement a stage delays nothing.

Deterministic: same scripts and config, byte-identical results.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Mapping, Sequence

import attrs

from talaria.config import ClusterConfig, PolicyConfig
from talaria.core.cluster import ClusterCore, GapLearner
from talaria.core.counters import cluster_counters
from talaria.core.instance import InstanceCore
from talaria.cost.estimator import Estimator
from talaria.cost.pricing import moves_s, price, step_s
from talaria.errors import TalariaError
from talaria.memory.kv import MovePlan
from talaria.policy.gaps import GapModel
from talaria.schedule import Executed, Request, Schedule, StepPlan
from talaria.types import EventKind, Link, SessionScript

# the simulator makes no tokens (it counts them) and lands a stage with its own event
NOTHING_SAMPLED = Executed(stage_pending=True)
# a decode stretch decides again after at most this long even if nothing cut it (time alone
# moves reservation expiries, the starvation bound and the recent-gap horizon)
STRETCH_S = 1.0
IDLE_POLL_S = 0.05  # re-check an idle instance whose decision may change with time
MAX_EVENTS = 50_000_000


class SimulationError(TalariaError, RuntimeError):
    """The simulation broke a conservation law (a bug, not bad input)."""


class _Ev(enum.IntEnum):
    # Order matters for simultaneous events: completions before arrivals before polls.
    READY = 0
    STAGE_DONE = 1
    ARRIVE = 2
    WAKE = 3
    RELEASE = 4  # an idle instance's keep-alive may have run out


@attrs.frozen
class CallRecord:
    session_id: str
    index: int
    model: str
    instance: str
    arrival_s: float
    admitted_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    reused_tokens: int
    restored_tokens: int
    recomputed_tokens: int
    sp_admitted: bool

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


@attrs.frozen
class SessionRecord:
    session_id: str
    model: str
    start_s: float
    end_s: float
    calls: int
    tool_s: float  # sum of the tool gaps it ran

    @property
    def sct_s(self) -> float:
        return self.end_s - self.start_s


@attrs.frozen
class SlotRecord:
    """One model's stretch on an instance: the switch to ``model`` began at ``switch_s``,
    its weights were in place and its slot open at ``open_s``, and it stayed the active
    model until ``until_s``, when the next switch on the instance began or the run ended
    (seconds, on the result's clock). Slots of one instance never overlap."""

    instance: str
    model: str
    switch_s: float
    open_s: float
    until_s: float


class SlotLog:
    """Collects :class:`SlotRecord` s as an instance's driver switches models: ``switch``
    when a switch is handed to the executor, ``opened`` when its copy is done, ``records``
    at the end of the run (every stretch still open closes then). Mutates only itself."""

    def __init__(self) -> None:
        self._done: list[SlotRecord] = []
        self._open: dict[str, SlotRecord] = {}  # per instance: the latest stretch

    def switch(self, instance: str, model: str, now: float) -> None:
        prev = self._open.pop(instance, None)
        if prev is not None:
            self._done.append(attrs.evolve(prev, until_s=now))
        self._open[instance] = SlotRecord(instance, model, now, now, now)

    def released(self, instance: str, now: float) -> None:
        """The instance scaled to zero: its stretch ends now."""
        prev = self._open.pop(instance, None)
        if prev is not None:
            self._done.append(attrs.evolve(prev, until_s=max(now, prev.open_s)))

    def opened(self, instance: str, model: str, now: float) -> None:
        cur = self._open.get(instance)
        if cur is not None and cur.model == model:
            self._open[instance] = attrs.evolve(cur, open_s=now, until_s=now)

    def records(self, end_s: float) -> tuple[SlotRecord, ...]:
        """Every stretch in the order the switches began, the open ones closed at
        ``end_s``, none past it (a scale to zero after the run's last work), none before
        its slot opened."""
        done = [attrs.evolve(r, until_s=max(min(r.until_s, end_s), r.open_s)) for r in self._done]
        tail = [attrs.evolve(r, until_s=max(end_s, r.open_s)) for r in self._open.values()]
        return tuple(sorted(done + tail, key=lambda r: (r.switch_s, r.instance)))


@attrs.frozen
class SimResult:
    """One policy's run: every call answered, every session, the instances' counters, the
    time the run ended and, where the executor recorded them, the model slots of every
    instance (``slots``, empty for a result that was merged from parts)."""

    policy: str
    calls: tuple[CallRecord, ...]
    sessions: tuple[SessionRecord, ...]
    counters: Mapping[str, int]
    end_s: float
    slots: tuple[SlotRecord, ...] = ()


@attrs.define
class _SessionRun:
    script: SessionScript
    next_call: int = 0
    tool_s: float = 0.0
    end_s: float | None = None


@attrs.define
class _StageCopy:
    """A weight stage in progress on an instance: ``left_s`` seconds of copying at its idle
    rate remain as of ``since_s``, from when it copies at ``rate`` of that rate. ``version``
    invalidates STAGE_DONE events scheduled before a change."""

    model: str
    left_s: float
    since_s: float
    rate: float = 1.0
    version: int = 0

    def advance(self, now: float) -> None:
        if now > self.since_s:
            self.left_s = max(0.0, self.left_s - (now - self.since_s) * self.rate)
            self.since_s = now

    @property
    def done_s(self) -> float:
        return self.since_s + self.left_s / self.rate


@attrs.define
class _Stretch:
    """A decode-only stretch that a change on its instance may cut: it started at
    ``start_s`` and holds the instance ``serial_s`` (co-run factor ``co_run`` included)."""

    start_s: float
    co_run: float
    serial_s: float
    devices: int
    signature: tuple[int, ...]  # the instance's tables as the stretch started


@attrs.define
class _Busy:
    sched: Schedule | None = None  # None: KV moves only, nothing to report
    repeat: int = 1
    version: int = 0  # its READY event's; an earlier READY of the instance is stale
    stretch: _Stretch | None = None
    releasing: bool = False  # the KV demotions of a scale to zero (not work of the run)


@attrs.frozen
class Simulator:
    """Runs scripted sessions through a ``ClusterCore`` under one policy. ``learner`` makes
    each run's cluster core learn tool gaps (a fresh learner per run, so every policy starts
    from the same priors). ``history`` is the calls of sessions the pool served before the
    run (what its cluster core has learned of session lengths when the run starts)."""

    cluster: ClusterConfig
    policy: PolicyConfig
    estimators: Mapping[str, Estimator]
    gaps: GapModel | None = None
    learner: Callable[[], GapLearner] | None = None
    history: Sequence[int] = ()

    def run(
        self,
        scripts: Sequence[SessionScript],
        on_call_done: Callable[[int], None] | None = None,
    ) -> SimResult:
        """Simulate ``scripts`` to completion. ``on_call_done(n)`` reports progress."""
        learner = self.learner() if self.learner is not None else None
        core = ClusterCore(self.cluster, self.policy, self.estimators, self.gaps, learner)
        for calls in self.history:
            core.lengths.observe(calls)
        run = _Run(core)
        return run.execute(scripts, self.policy.name, on_call_done)


class _Run:
    """One simulation: the heap, the clock, and the per-instance busy state."""

    def __init__(self, core: ClusterCore) -> None:
        self.core = core
        self.heap: list[tuple[float, int, int, str, int]] = []
        self.seq = 0
        self.now = 0.0
        self.busy: dict[str, _Busy | None] = {name: None for name in core.instances}
        self.polling: set[str] = set()
        self.sessions: list[_SessionRun] = []
        self.session_index: dict[str, int] = {}
        self.records: list[CallRecord] = []
        self.slot_log = SlotLog()
        self.kv_moved = 0
        self.stages: dict[str, _StageCopy] = {}
        self.stage_versions = 0
        self.device_busy_s = 0.0  # device-seconds instances were held (serial time x devices)
        # provisioned stretches of each instance (keep-alive): since its first work or the
        # work that woke it, until it scaled to zero; clipped to the run at the end
        self.held_since: dict[str, float | None] = {name: None for name in core.instances}
        self.held: list[tuple[float, float, int]] = []  # (start, stop, devices)
        self.demoting: list[tuple[float, float, int]] = []  # scale-to-zero KV demotions
        self.idle_since: dict[str, float | None] = {name: None for name in core.instances}
        # per idle provisioned instance: when its RELEASE is due and that event's version
        self.release_due: dict[str, tuple[float, int]] = {}
        self.release_versions = 0
        self.released_stages: set[tuple[str, int]] = set()  # (instance, STAGE_DONE version)
        self.end_s = 0.0  # the last event of the run's work (keep-alive's tail excluded)
        self.stretched: dict[str, None] = {}  # instances in a cuttable stretch, in start order
        self.versions = 0

    def push(self, t: float, kind: _Ev, name: str = "", idx: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, int(kind), self.seq, name, idx))

    def execute(
        self,
        scripts: Sequence[SessionScript],
        policy: str,
        on_call_done: Callable[[int], None] | None,
    ) -> SimResult:
        for i, script in enumerate(scripts):
            if script.session_id in self.session_index:
                raise SimulationError(f"session id {script.session_id!r} appears twice")
            self.session_index[script.session_id] = i
            self.sessions.append(_SessionRun(script))
            if script.calls:
                self.push(script.start_s, _Ev.ARRIVE, "", i)
        events = 0
        while self.heap:
            t, kind, _, name, idx = heapq.heappop(self.heap)
            self.now = t
            events += 1
            if events > MAX_EVENTS:
                raise SimulationError(f"more than {MAX_EVENTS} events: a scheduling livelock")
            if self._dispatch(_Ev(kind), name, idx, on_call_done):
                self.end_s = t
            if self.stretched and (kind == _Ev.ARRIVE or kind == _Ev.READY):
                self._cut_changed()
        return self._result(scripts, policy)

    def _dispatch(
        self, kind: _Ev, name: str, idx: int, on_call_done: Callable[[int], None] | None
    ) -> bool:
        """Handle one event; whether it is part of the run's work (a keep-alive's release
        after the last session is not)."""
        if kind is _Ev.ARRIVE:
            self._arrive(idx)
        elif kind is _Ev.READY:
            busy = self.busy[name]
            if busy is not None and busy.version == idx:
                self._ready(name, on_call_done)
                return not busy.releasing
        elif kind is _Ev.STAGE_DONE:
            stage = self.stages.get(name)
            if (name, idx) in self.released_stages:
                self.released_stages.discard((name, idx))
                return False  # abandoned by a scale to zero: not work of the run
            if stage is None or stage.version != idx:
                return True  # superseded: the stage was re-timed, replaced or abandoned
            del self.stages[name]
            if self.core.instances[name].arena.staging_in_progress == stage.model:
                self.core.instances[name].stage_done(stage.model)
            self._kick(name)
        elif kind is _Ev.RELEASE:
            due = self.release_due.get(name)
            if due is not None and due[1] == idx:
                del self.release_due[name]
                self._release(name)
            return False
        else:
            self.polling.discard(name)
            self._kick(name)
        return True

    # ------------------------------------------------------------------ sessions
    def _arrive(self, sidx: int) -> None:
        srun = self.sessions[sidx]
        sc = srun.script.calls[srun.next_call]
        call = srun.script.call(srun.next_call, self.now)
        inst, _req, _ = self.core.place(call, sc.output_tokens, sc.history, self.now)
        self._kick(inst.spec.name)
        if self.release_due:
            self._recheck_releases()

    def _call_done(self, req: Request) -> None:
        sidx = self._session_index(req.call.session_id)
        srun = self.sessions[sidx]
        self.core.on_finished(req)
        self.records.append(record_of(req, self._instance_of(req)))
        tool = srun.script.after(srun.next_call)
        srun.next_call += 1
        if tool is not None:
            if tool.hint_s is not None:
                key = srun.script.key
                self.core.event(key, EventKind.TOOL_START, tool.hint_s, self.now, tool=tool.tool)
            srun.tool_s += tool.seconds
            self.push(self.now + tool.seconds, _Ev.ARRIVE, "", sidx)
        else:
            srun.end_s = self.now
            self.core.event(srun.script.key, EventKind.END, None, self.now)
            if self.release_due:
                self._recheck_releases()

    def _session_index(self, session_id: str) -> int:
        return self.session_index[session_id]

    def _instance_of(self, req: Request) -> str:
        info = self.core.sessions[req.call.session]
        return info.last_instance or ""

    # ------------------------------------------------------------------ instances
    def _kick(self, name: str) -> None:
        if self.busy[name] is not None:
            return
        inst = self.core.instances[name]
        est = inst.estimator
        sched = inst.schedule(self.now)
        step = sched.step
        stretch = step is not None and self._may_stretch(name, inst, sched, step)
        repeat = self._repeat(inst, step, stretch) if step is not None else 1
        cost = price(est, sched, repeat)
        moves = list(sched.kv_moves)
        if step is not None:
            moves += step.kv_moves
        self.kv_moved += sum(m.nbytes for m in moves)
        if sched.stage is not None:
            self._start_stage(name, sched.stage.model, cost.background_s)
        serial = cost.serial_s
        if sched.switch is None and (step is not None or cost.kv_s > 0):
            serial = self._beside_stage(name, inst, cost.kv_s, cost.step_s, moves)
        co_run = self._co_run(name, inst)
        # a switch that wakes the instance from zero waits for its devices first: held
        # (from now), not busy, and not slowed by another instance's work
        wait = sched.switch.provision_s if sched.switch is not None else 0.0
        serial = (serial - wait) * co_run + wait
        if sched.switch is not None or step is not None or cost.kv_s > 0:
            self.device_busy_s += (serial - wait) * inst.spec.n_devices
            self.idle_since[name] = None
            if self.held_since[name] is None:
                self.held_since[name] = self.now
        if sched.switch is not None:
            self.slot_log.switch(name, sched.switch.model, self.now)
            self._hold(name, _Busy(sched), serial)
        elif step is not None:
            busy = _Busy(sched, repeat)
            if stretch:
                signature = self._signature(inst)
                busy.stretch = _Stretch(self.now, co_run, serial, inst.spec.n_devices, signature)
                self.stretched[name] = None
            self._hold(name, busy, serial)
        elif cost.kv_s > 0:
            self._hold(name, _Busy(), serial)
        elif self._has_work(inst):
            if name not in self.polling and not sched.waiting_for_stage:
                self.polling.add(name)
                self.push(self.now + IDLE_POLL_S, _Ev.WAKE, name)
        elif self.held_since[name] is not None:
            self._keep_alive(name, inst)

    # ------------------------------------------------------------------ keep-alive
    def _keep_alive(self, name: str, inst: InstanceCore) -> None:
        """The provisioned instance has nothing to serve: arm its release for when its
        policy says, or bring an armed one forward (a reservation here ended early)."""
        if inst.policy.keep_alive_s == math.inf:
            return  # never scales to zero
        since = self.idle_since[name]
        if since is None:
            since = self.idle_since[name] = self.now
        at = max(inst.release_at(since, self.now), self.now)
        due = self.release_due.get(name)
        if at < math.inf and (due is None or at < due[0]):
            self.release_versions += 1
            self.release_due[name] = (at, self.release_versions)
            self.push(at, _Ev.RELEASE, name, self.release_versions)

    def _recheck_releases(self) -> None:
        """A call was placed or a session ended: reservations elsewhere may have ended with
        it (the session moved on or left), so an idle instance may be released sooner."""
        for name in list(self.release_due):
            if self.busy[name] is None and self.idle_since[name] is not None:
                self._keep_alive(name, self.core.instances[name])

    def _release(self, name: str) -> None:
        """A keep-alive may have run out: scale the instance to zero if it still has nothing
        to serve and its policy says so now (else re-arm for the time it says)."""
        inst = self.core.instances[name]
        since, start = self.idle_since[name], self.held_since[name]
        if self.busy[name] is not None or since is None or start is None or not inst.idle:
            return  # it found work: the next time it runs out of work re-arms the release
        at = inst.release_at(since, self.now)
        if at > self.now:
            self._keep_alive(name, inst)
            return
        if not inst.can_scale_to_zero():
            raise SimulationError(f"instance {name} is idle and unreserved, yet holds KV blocks")
        plan = inst.scale_to_zero()
        stage = self.stages.pop(name, None)  # abandoned with the device
        if stage is not None:
            self.released_stages.add((name, stage.version))
        self.slot_log.released(name, self.now)
        serial = moves_s(inst.estimator, [plan])
        self.kv_moved += plan.nbytes
        devices = inst.spec.n_devices
        self.demoting.append((self.now, self.now + serial, devices))
        self.held.append((start, self.now + serial, devices))
        self.held_since[name] = self.idle_since[name] = None
        if serial > 0:
            self._hold(name, _Busy(releasing=True), serial)

    def _hold(self, name: str, busy: _Busy, serial_s: float) -> None:
        """The instance is busy with ``busy`` for ``serial_s`` seconds from now."""
        self.versions += 1
        busy.version = self.versions
        self.busy[name] = busy
        self.push(self.now + serial_s, _Ev.READY, name, busy.version)

    # ------------------------------------------------------------------ stretches
    def _may_stretch(self, name: str, inst: InstanceCore, sched: Schedule, step: StepPlan) -> bool:
        """Whether the step may run its whole ``repeat`` unless a change on the instance
        cuts it: no switch, stage or KV move beside it (those are priced per event), and no
        other model's call waiting (the slot order then decides again at every step: its
        close sticks once made, and the starvation bound and the staging guess move with
        time and with what the pool learns)."""
        return (
            step.repeat > 1
            and sched.switch is None
            and sched.stage is None
            and not sched.kv_moves
            and not step.kv_moves
            and name not in self.stages
            and inst.arena.staging_in_progress is None
            and not inst.calls.any_waiting(but=step.model)
        )

    @staticmethod
    def _signature(inst: InstanceCore) -> tuple[int, ...]:
        """What the instance's next decisions read that an event elsewhere can change:
        its calls, tool gaps, weights and free or evictable KV."""
        kv = inst.kv
        return (
            inst.calls.changes,
            inst.tool_gaps.changes,
            inst.arena.changes,
            kv.device_free,
            kv.device_evictable,
        )

    def _cut_changed(self) -> None:
        """Cut every stretch whose instance changed since it started (see the module
        docstring)."""
        for name in list(self.stretched):
            busy = self.busy[name]
            if busy is None or busy.stretch is None:
                del self.stretched[name]
            elif self._signature(self.core.instances[name]) != busy.stretch.signature:
                del self.stretched[name]
                self._cut(name, busy, busy.stretch)

    def _cut(self, name: str, busy: _Busy, stretch: _Stretch) -> None:
        """End the stretch with the step in progress now: the fewest steps whose end is not
        before now; its READY moves there."""
        if busy.sched is None or busy.repeat <= 1:
            return
        est = self.core.instances[name].estimator
        sched = busy.sched

        def end_s(k: int) -> float:
            return stretch.start_s + price(est, sched, k).serial_s * stretch.co_run

        lo, hi = 1, busy.repeat
        while lo < hi:
            mid = (lo + hi) // 2
            if end_s(mid) >= self.now:
                hi = mid
            else:
                lo = mid + 1
        if lo == busy.repeat:
            return
        serial = end_s(lo) - stretch.start_s
        self.device_busy_s -= (stretch.serial_s - serial) * stretch.devices
        busy.repeat = lo
        busy.stretch = None
        self.versions += 1
        busy.version = self.versions
        self.push(stretch.start_s + serial, _Ev.READY, name, busy.version)

    # ------------------------------------------------------------------ stages
    def _start_stage(self, name: str, model: str, copy_s: float) -> None:
        self.stages[name] = _StageCopy(model, copy_s, self.now)
        self._retime(name)

    def _retime(self, name: str) -> None:
        """Schedule the stage's end as things stand (earlier events become stale)."""
        stage = self.stages[name]
        self.stage_versions += 1
        stage.version = self.stage_versions
        self.push(stage.done_s, _Ev.STAGE_DONE, name, stage.version)

    def _beside_stage(
        self, name: str, inst: InstanceCore, kv_s: float, step_s: float, moves: list[MovePlan]
    ) -> float:
        """Seconds the instance is held by ``kv_s`` of KV moves then ``step_s`` of step
        beside the stage in progress (module docstring); the stage is re-timed."""
        stage = self.stages.get(name)
        contention = inst.estimator.stage_contention()
        if stage is not None and inst.arena.staging_in_progress != stage.model:
            del self.stages[name]  # abandoned by the core
            stage = None
        if stage is None or contention is None:
            return kv_s + step_s
        stage.advance(self.now)
        h2d = moves_s(inst.estimator, [m for m in moves if m.link is Link.HOST_TO_DEVICE])
        shared = min(h2d, stage.left_s)  # both copy at half rate for twice this long
        stage.left_s -= shared
        kv_s += shared
        if step_s > 0:
            beside = stage.left_s / contention.share  # wall seconds the stage still copies
            slow = contention.step_slowdown
            overlap = min(step_s * slow, beside)
            step_s += overlap * (1.0 - 1.0 / slow)
            stage.rate = contention.share
        stage.since_s = self.now + kv_s
        self._retime(name)
        return kv_s + step_s

    def _co_run(self, name: str, inst: InstanceCore) -> float:
        """The profile's co-run slowdown when another instance of the same hardware is busy
        as this one starts its work, else 1 (an approximation: the factor holds for the
        whole of the work, decided when it starts)."""
        slow = inst.estimator.co_run_slowdown()
        if slow is None:
            return 1.0
        hardware = inst.spec.hardware
        instances = self.core.instances
        peers_at_work = any(
            other != name and busy is not None and instances[other].spec.hardware == hardware
            for other, busy in self.busy.items()
        )
        return slow if peers_at_work else 1.0

    def _idle_stage(self, name: str) -> None:
        """The instance stopped stepping: a stage in progress copies at its idle rate."""
        stage = self.stages.get(name)
        if stage is not None and stage.rate != 1.0:
            stage.advance(self.now)
            stage.rate = 1.0
            self._retime(name)

    @staticmethod
    def _has_work(inst: InstanceCore) -> bool:
        return not inst.idle

    def _repeat(self, inst: InstanceCore, step: StepPlan, stretch: bool) -> int:
        """Steps to run as one event: a stretch's (a change cuts it), else one."""
        if step.repeat <= 1 or not stretch:
            return 1
        deadline = inst.admission.next_deadline_s()  # a reservation may expire
        return self._steps_within(inst, step, min(STRETCH_S, deadline - self.now))

    @staticmethod
    def _steps_within(inst: InstanceCore, step: StepPlan, seconds: float) -> int:
        """The fewest of ``step.repeat`` steps that reach ``seconds`` (all if they do not):
        the instance decides again with the step in progress then."""
        lo, hi = 1, step.repeat
        while lo < hi:
            mid = (lo + hi) // 2
            if step_s(inst.estimator, step, mid) >= seconds:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _ready(self, name: str, on_call_done: Callable[[int], None] | None) -> None:
        busy = self.busy[name]
        self.busy[name] = None
        self._idle_stage(name)
        inst = self.core.instances[name]
        if busy is not None and busy.sched is not None:
            # a stage copies in the background: STAGE_DONE reports it, not the commit
            finished = inst.commit(busy.sched, NOTHING_SAMPLED, self.now, repeat=busy.repeat)
            if busy.sched.switch is not None:
                self.slot_log.opened(name, busy.sched.switch.model, self.now)
            for req in finished:
                self._call_done(req)
                if on_call_done is not None:
                    on_call_done(len(self.records))
        self._kick(name)

    # ------------------------------------------------------------------ results
    def _result(self, scripts: Sequence[SessionScript], policy: str) -> SimResult:
        expected = sum(len(s.calls) for s in scripts)
        if len(self.records) != expected:
            raise SimulationError(f"{len(self.records)} calls answered, {expected} sent")
        keys = {(r.session_id, r.index) for r in self.records}
        if len(keys) != expected:
            raise SimulationError("a call was answered twice")
        self.core.check_integrity()
        for name, inst in self.core.instances.items():
            if not inst.idle:
                raise SimulationError(f"instance {name} ended with calls in flight")
            # blocks lent to a weight stage (the next model's copy) are not KV: an instance
            # may end the run staging a model no call came back for
            kv = inst.kv
            if kv.device_blocks != kv.device_free + kv.device_evictable + kv.lent_blocks:
                raise SimulationError(f"instance {name} leaked KV blocks (held after the end)")
        sessions = tuple(
            SessionRecord(
                s.script.session_id,
                s.script.model,
                s.script.start_s,
                s.end_s if s.end_s is not None else s.script.start_s,
                len(s.script.calls),
                s.tool_s,
            )
            for s in self.sessions
        )
        return SimResult(
            policy,
            tuple(self.records),
            sessions,
            self._counters(),
            self.end_s,
            self.slot_log.records(self.end_s),
        )

    def _counters(self) -> dict[str, int]:
        out = cluster_counters(self.core.instances.values(), self.kv_moved)
        busy = self.device_busy_s + self._within_run(self.demoting)
        out["device_busy_ms"] = round(busy * 1000)
        out["device_held_ms"] = round(self._device_held_s() * 1000)
        return out

    def _device_held_s(self) -> float:
        """Device-seconds the instances were provisioned within the run (until its last
        work): from each one's first work, or the work that woke it, to its scale to zero."""
        still = [
            (start, self.end_s, self.core.instances[name].spec.n_devices)
            for name, start in self.held_since.items()
            if start is not None
        ]
        return self._within_run(self.held + still)

    def _within_run(self, spans: Sequence[tuple[float, float, int]]) -> float:
        """Device-seconds of ``(start, stop, devices)`` spans up to the run's last work (a
        scale to zero after it is outside the run, for every policy alike)."""
        end = self.end_s
        return sum(max(0.0, min(stop, end) - start) * devices for start, stop, devices in spans)


def record_of(req: Request, instance: str) -> CallRecord:
    call = req.call
    return CallRecord(
        call.session_id,
        call.index,
        call.model,
        instance,
        call.arrival_s,
        req.admitted_s if req.admitted_s is not None else call.arrival_s,
        req.first_token_s if req.first_token_s is not None else call.arrival_s,
        req.finished_s if req.finished_s is not None else call.arrival_s,
        req.prompt_len,
        req.generated,
        req.reused_tokens,
        req.restored_tokens,
        req.recomputed_tokens,
        req.sp_admitted,
    )
