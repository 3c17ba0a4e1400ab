"""The instance core: one instance's policy and memory, driven by any driver.

``InstanceCore`` owns the instance's KV manager, weight arena, round scheduler and
reservations, and composes the roles that act on them, one file each:

* :mod:`talaria.core.calls`: the calls it holds (waiting per model, running, finished);
* :mod:`talaria.core.tool_gaps`: the sessions it served last that are in a tool gap;
* :mod:`talaria.core.estimates`: what it expects (the router's views and bound, each
  model's slot demand), derived from those tables and never cleared by hand;
* :mod:`talaria.core.slots`: slot control (model switches, weight staging);
* :mod:`talaria.core.admitter`: admission and reservations.

It never touches tensors and never reads a clock: a driver (the simulator, pricing with the
cost model; the live loop or a :class:`~talaria.runtime.local.LocalInstance`, over an
executor of :mod:`talaria.executor`) asks ``schedule(now)`` for the next thing to do, has it
executed, and reports back with ``commit``. The same object runs live and in simulation;
only the executor and the clock differ.

Step protocol (vLLM v1 style: prefill and decode are one idea, computed tokens catching up
with known tokens):

* ``submit(req)`` queues a call for its model.
* ``schedule(now) -> Schedule``: reservations expire; the open slot is kept or closed; a
  model switch is returned if the next slot needs other weights; waiting calls of the open
  slot's model are admitted (session-prefill admits continuations any time the slot is
  open); a ``StepPlan`` lists prefill chunks and decodes; a stage of the next model's weights
  may be started. KV block moves planned by admission ride with the step.
* ``complete_step(plan, now, repeat)`` advances tokens, finishes calls, offers reservations.
* Keep-alive: a driver that gives idle instances' devices back asks ``release_at`` when an
  instance idle since some time scales to zero, and at that time, if ``can_scale_to_zero``,
  calls ``scale_to_zero`` and runs the KV demotions it returns (``talaria.policy.keep_alive``).

Not thread-safe: one task drives it.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Collection, Mapping, Sequence

import attrs

from talaria.config import InstanceSpec, ModelSpec, PolicyConfig
from talaria.core.admitter import Admitter
from talaria.core.calls import CallTable
from talaria.core.counters import InstanceCounters
from talaria.core.estimates import InstanceEstimates
from talaria.core.slots import SlotControl
from talaria.core.tool_gaps import GapTable, ToolGap
from talaria.cost.estimator import Estimator
from talaria.cost.pricing import plan_copy_s
from talaria.errors import ConfigError, ContextTooLong, TalariaError, UnknownModel
from talaria.executor import Layout
from talaria.memory.kv import CallKey, KVManager, MovePlan
from talaria.memory.weights import WeightArena
from talaria.policy import keep_alive
from talaria.policy.admission import Admission
from talaria.policy.gaps import GapModel
from talaria.policy.remaining import COST_WINDOW, PRIOR_OUTPUT_TOKENS, CallCost, SessionLengths
from talaria.policy.rounds import RoundScheduler
from talaria.schedule import Executed, Request, Schedule, StepPlan
from talaria.types import Call, SessionKey

__all__ = ["InstanceBusy", "InstanceCore", "KvDrift"]

log = logging.getLogger(__name__)

KV_DRIFT_KEPT = 65_536  # the most recent engine-reported cache hits kept beside the estimates


class InstanceBusy(TalariaError, RuntimeError):
    """A scale to zero while a call or a reservation holds the instance (a caller skipped
    ``can_scale_to_zero``)."""

    code = "instance_busy"


@attrs.frozen
class KvDrift:
    """One call's cached prompt tokens: its engine's count against the core's account."""

    key: CallKey
    engine_cached: int
    core_cached: int

    @property
    def drift(self) -> int:
        return self.core_cached - self.engine_cached


class InstanceCore:
    """Policy + memory of one instance. See the module docstring for the protocol."""

    def __init__(
        self,
        spec: InstanceSpec,
        models: Sequence[ModelSpec],
        policy: PolicyConfig,
        estimator: Estimator,
        gaps: GapModel | None = None,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.estimator = estimator
        self.models = {m.name: m for m in models}
        self.arena = WeightArena(
            models,
            n_regions=spec.weight_regions,
            staging=policy.weight_staging and len(models) > 1,
            host_weight_bytes=self._host_weight_bytes(spec, models),
            initially_on_host=self._preloaded(spec, models),
        )
        self.kv = self._make_kv(models)
        self.rounds = RoundScheduler([m.name for m in models], policy)
        self.admission = Admission(policy, gaps)
        self.counters = InstanceCounters()
        self.calls = CallTable(self.models)
        self.tool_gaps = GapTable(self.models)
        self.kv_drift: collections.deque[KvDrift] = collections.deque(maxlen=KV_DRIFT_KEPT)
        self._max_tokens = {m.name: self._limit(m) for m in models}
        self._faults_logged: set[str] = set()  # exception types logged with a traceback
        # the session-aware slot order's estimate of each model's remaining work
        self.lengths = SessionLengths()
        # a call's service time, recent (how long the open batch takes to drain) and over
        # many calls (what the calls of a model's sessions still to come will take)
        prior = {
            m.name: PRIOR_OUTPUT_TOKENS * estimator.decode_step_s(m.name, 1, 0) for m in models
        }
        self.call_cost = CallCost(prior)
        self.call_work = CallCost(dict(prior), window=COST_WINDOW)
        self._calls_done: dict[SessionKey, int] = {}  # calls of each session answered here
        self._wire_roles()

    def _wire_roles(self) -> None:
        """Build the three roles over the state above: the estimates (what a call, a switch
        or a session's next call would cost here), slot control (which model holds the
        slot, switches and stages) and the admitter (which calls join the step)."""
        self.estimates = InstanceEstimates(
            spec=self.spec,
            models=self.models,
            policy=self.policy,
            estimator=self.estimator,
            arena=self.arena,
            kv=self.kv,
            rounds=self.rounds,
            calls=self.calls,
            gaps=self.tool_gaps,
            admission=self.admission,
            lengths=self.lengths,
            call_cost=self.call_cost,
            call_work=self.call_work,
            calls_done=self._calls_done,
            on_fault=self._session_fault,
            released=lambda: self.slots.released,
            waking_until=lambda: self.slots.waking_until_s,
        )
        self.slots = SlotControl(
            policy=self.policy,
            models=self.models,
            arena=self.arena,
            kv=self.kv,
            rounds=self.rounds,
            calls=self.calls,
            counters=self.counters,
            release_reservations=self._release_reservations,
            provision_s=self.estimator.provision_s(),
            price_s=lambda plan: plan_copy_s(self.estimator, plan),
        )
        self.admitter = Admitter(
            policy=self.policy,
            admission=self.admission,
            kv=self.kv,
            rounds=self.rounds,
            calls=self.calls,
            gaps=self.tool_gaps,
            slots=self.slots,
            estimates=self.estimates,
            counters=self.counters,
            on_fault=self._session_fault,
        )

    def _release_reservations(self, model: str | None) -> None:
        """A switch ends ``model``'s slot: the admitter ends its reservations."""
        self.admitter.release_model(model)

    @staticmethod
    def _host_weight_bytes(spec: InstanceSpec, models: Sequence[ModelSpec]) -> int:
        """Host memory kept for weight copies: all models if they fit in
        ``spec.host_weight_share`` of host memory, else that share (the rest is the host KV
        tier)."""
        largest = max(m.weight_bytes for m in models)
        budget = max(largest, int(spec.host_memory_bytes * spec.host_weight_share))
        return min(sum(m.weight_bytes for m in models), budget)

    @classmethod
    def _preloaded(cls, spec: InstanceSpec, models: Sequence[ModelSpec]) -> list[str]:
        """Models whose weights start in host memory (in catalog order, while they fit)."""
        room = cls._host_weight_bytes(spec, models)
        out = []
        for m in models:
            if m.weight_bytes <= room:
                out.append(m.name)
                room -= m.weight_bytes
        return out

    def _make_kv(self, models: Sequence[ModelSpec]) -> KVManager:
        spec = self.spec
        n = spec.n_devices
        widest = max(m.kv_bytes_per_token_on(n) for m in models)
        block_bytes = widest * spec.block_size
        kv_device = spec.usable_device_bytes - self.arena.arena_bytes
        kv_host = spec.host_memory_bytes - self.arena.host_weight_bytes
        if kv_host < 0:
            raise ConfigError(
                f"instance {spec.name}: host memory ({spec.host_memory_bytes / 1e9:.2f} GB) "
                f"cannot hold the weights it keeps on host "
                f"({self.arena.host_weight_bytes / 1e9:.2f} GB); give it more host memory"
            )
        kv_host = kv_host if self.policy.host_kv else 0
        device_blocks = int(kv_device * self.policy.admission_budget_fraction) // block_bytes
        if device_blocks <= 0:
            raise ContextTooLong(
                f"instance {spec.name}: weights leave no device memory for KV "
                f"({kv_device / 1e9:.1f} GB)"
            )
        tpb = {m.name: block_bytes // m.kv_bytes_per_token_on(n) for m in models}
        return KVManager(
            device_blocks, kv_host // block_bytes, block_bytes, tpb, self.policy.eviction
        )

    # ------------------------------------------------------------------ tables
    @property
    def waiting(self) -> dict[str, collections.deque[Request]]:
        """Waiting calls per model, in queue order (read-only: see ``CallTable``)."""
        return self.calls.waiting

    @property
    def running(self) -> dict[CallKey, Request]:
        """The running batch (read-only: see ``CallTable``)."""
        return self.calls.running

    @property
    def finished(self) -> collections.deque[Request]:
        """Recently finished calls, for inspection (bounded)."""
        return self.calls.finished

    @property
    def stage_blocks(self) -> tuple[int, ...]:
        """Device KV blocks lent to the weight stage in progress."""
        return self.slots.stage_blocks

    @property
    def layout(self) -> Layout:
        """The fixed memory layout an executor of this instance is sized by."""
        arena, kv, n = self.arena, self.kv, self.spec.n_devices
        specs = list(self.models.values())
        return Layout(
            arena.arena_bytes,
            arena.region_bytes,
            tuple(arena.region_offset(r) for r in range(arena.n_regions)),
            kv.device_blocks,
            kv.host_blocks,
            kv.block_bytes,
            tuple(m.name for m in specs),
            tuple(m.weight_bytes for m in specs),
            tuple(m.kv_bytes_per_token_on(n) for m in specs),
            tuple(kv.tpb(m.name) for m in specs),
            tuple(self._preloaded(self.spec, specs)),
        )

    @property
    def idle(self) -> bool:
        """Whether the instance holds no call."""
        return not self.calls.running and not self.calls.any_waiting()

    # ------------------------------------------------------------------ intake
    def _limit(self, model: ModelSpec) -> int:
        return min(model.max_context, self.kv.device_blocks * self.kv.tpb(model.name))

    def token_limit(self, model: str) -> int:
        """Prompt plus answer tokens a call of ``model`` may have here."""
        return self._max_tokens[model]

    def fits(self, call: Call, extra_tokens: int) -> bool:
        """Whether the call could ever fit here (the fast form of ``check_fits``)."""
        limit = self._max_tokens.get(call.model)
        return limit is not None and call.prompt_tokens + extra_tokens <= limit

    def check_fits(self, call: Call, extra_tokens: int) -> None:
        """Raise ``ContextTooLong`` if the call could never fit this instance's KV pool."""
        model = self.models.get(call.model)
        if model is None:
            raise UnknownModel(f"instance {self.spec.name} does not serve {call.model!r}")
        tokens = call.prompt_tokens + extra_tokens
        if tokens > model.max_context:
            raise ContextTooLong(
                f"{tokens} tokens exceed {call.model}'s context of {model.max_context}; "
                "shorten the prompt or lower max_tokens"
            )
        blocks = math.ceil(tokens / self.kv.tpb(call.model))
        if blocks > self.kv.device_blocks:
            raise ContextTooLong(
                f"{tokens} tokens need {blocks} KV blocks; instance {self.spec.name} has "
                f"{self.kv.device_blocks}"
            )

    def submit(self, req: Request) -> None:
        """Queue a call (after ``check_fits``). Its session's reservation is kept until
        admission, where its blocks are reused."""
        self.check_fits(req.call, req.target_output)
        gap = self.tool_gaps.get(req.call.session)
        if gap is not None and self.admission.continuum is not None:
            self.admission.continuum.observe_tool(gap.tool, req.queued_s - gap.since_s)
        self.tool_gaps.end(req.call.session)
        self.calls.enqueue(req)

    def forget_session(self, session: SessionKey, ended: bool) -> None:
        """The session went elsewhere (or ended): release what this instance holds for it."""
        done = self._calls_done.pop(session, 0)
        if ended:
            self.lengths.observe(done)
            if self.admission.continuum is not None:
                self.admission.continuum.observe_program(done)
        self.tool_gaps.end(session)
        self.admitter.drop_reservation(session)
        if ended:
            self.kv.end_session(session)

    def end_session(self, session: SessionKey) -> None:
        self.forget_session(session, ended=True)

    def hint(
        self, session: SessionKey, expected_s: float | None, now: float, tool: str | None = None
    ) -> None:
        """A client's tool-start hint for a session this instance served last (``tool``: the
        tool it named; Continuum's TTL is sized for it)."""
        self.admitter.hint(session, expected_s, now, tool)

    def tool_ended(self, session: SessionKey, now: float) -> None:
        """A client's tool-end hint: the session's gap is over, its next call is imminent
        (the hint becomes "the tool took exactly as long as it has been running")."""
        gap = self.tool_gaps.get(session)
        if gap is not None:
            self.admitter.hint(session, now - gap.since_s, now)

    # ------------------------------------------------------------------ scheduling
    def schedule(self, now: float) -> Schedule:
        """Decide the next action (see module docstring). Mutates slot, admission, KV."""
        self.admitter.expire(now)
        slot = self.rounds.slot
        calls = self.calls
        idle = (
            slot is not None and not calls.running_of(slot.model) and not calls.waiting[slot.model]
        )
        # expected returns matter only to an idle slot deciding whether to linger, and only
        # while another model waits (both slot orders keep a slot nobody else needs)
        linger = slot is not None and idle and calls.any_waiting(but=slot.model)
        demand = self.estimates.demand(now, returns_for=[slot.model] if slot and linger else ())
        if slot is not None:
            self.rounds.close_if_due(now, demand)
        slot_running = slot is not None and calls.running_of(slot.model) > 0
        if slot is None or (slot.closing and not slot_running):
            nxt = self.rounds.next_model(demand)
            if nxt is None:
                return Schedule(stage=self.slots.maybe_stage(demand))
            if nxt != self.arena.active_model:
                return self.slots.switch_to(nxt, now)
            self.rounds.open(nxt, now)
        moves = self.admitter.admit(now)
        # admission moved only the open slot's calls from waiting to running: the other
        # models' demand, all the staging guess reads, is what it was
        stage = self.slots.maybe_stage(demand)
        step = self._build_step(moves)
        if step is None:
            return Schedule(stage=stage, kv_moves=moves)
        keys = [key for key, _, _ in step.prefill] + list(step.decode)
        return Schedule(step=step, stage=stage, requests={k: calls.running[k] for k in keys})

    def commit(
        self,
        sched: Schedule,
        done: Executed,
        now: float,
        *,
        repeat: int = 1,
        outputs: Mapping[CallKey, Sequence[int]] | None = None,
        stopped: Collection[CallKey] = (),
    ) -> list[Request]:
        """The one way a driver reports an executed ``sched`` (live loop, simulator,
        benchmarks, scripts); returns the calls it finished. Mutates the slot state, the
        calls and KV.

        Its switch is done (the slot opens); its stage is done unless the executor copies it
        in the background (``done.stage_pending``; then ``done.stage_landed`` of a later step
        reports it, if the core still waits for that copy); the calls whose sampling failed
        (``done.failed``) are released; a call in ``stopped`` ended with its last token
        (end-of-sequence or a stop string), one in ``done.silent`` ended without a token
        this step (its engine finished it); a call that ended or reached its answer length
        gets its history, its prompt plus ``outputs`` but the last token, whose KV was never
        computed (drivers that make no tokens pass no ``outputs``); then the step's tokens
        count (``repeat`` decode-only steps)."""
        if sched.switch is not None:
            self.switch_done(sched.switch.model, now)
        if sched.stage is not None and not done.stage_pending:
            self.stage_done(sched.stage.model)
        if done.stage_landed is not None:
            model, blocks = done.stage_landed
            if self.arena.staging_in_progress == model and self.stage_blocks == blocks:
                self.stage_done(model)
        for req, why in done.failed:
            self.abort(req.key, why)
        step = sched.step
        if step is None:
            return []
        for key, cached in done.cached:
            self._engine_cached(sched.requests[key], cached)
        silent = done.silent
        ended = [req for req, _ in done.sampled if req.key in stopped]
        ended += [self.calls.running[k] for k in silent if k in self.calls.running]
        for req in ended:
            self.stop(req.key)
        if outputs is not None:
            for req in [r for r, _ in done.sampled] + ended:
                out = outputs.get(req.key, ())
                if req.stopped or len(out) >= req.target_output:
                    req.history = req.call.prompt.extend(out[:-1])
        if silent:  # no token came for them this step: the core must not count one
            step = attrs.evolve(step, decode=tuple(k for k in step.decode if k not in silent))
        return self.complete_step(step, now, repeat)

    def _engine_cached(self, req: Request, cached: int) -> None:
        """An engine that keeps its own prefix cache (vLLM) found ``cached`` prompt tokens
        of ``req``: they are the call's cached tokens (the core's estimate is kept in
        ``kv_drift``)."""
        estimate = min(req.prompt_len, req.reused_tokens + req.restored_tokens)
        self.kv_drift.append(KvDrift(req.key, cached, estimate))
        req.reused_tokens = min(cached, req.prompt_len)
        req.restored_tokens = 0

    def release(self, sched: Schedule, now: float) -> None:
        """``sched`` will never complete (its step raised, or its instance was lost): its
        switch and stage are over, so that its calls can be released (``abort``)."""
        if sched.switch is not None:
            self.switch_done(sched.switch.model, now)
        if sched.stage is not None:
            self.stage_done(sched.stage.model)

    def switch_done(self, model: str, now: float) -> None:
        """The executor finished copying ``model``'s weights: its slot opens."""
        self.slots.switch_done(model, now)

    def stage_done(self, model: str) -> None:
        """The executor finished staging ``model``'s weights."""
        self.slots.stage_done(model)

    # ------------------------------------------------------------------ keep-alive
    @property
    def released(self) -> bool:
        """Whether the instance holds no devices and no call has woken it since: it scaled
        to zero, or its pool scales to zero (a finite keep-alive) and it was never used."""
        return self.slots.released

    def release_at(self, idle_since_s: float, now: float) -> float:
        """When this instance, idle since ``idle_since_s``, scales to zero (the keep-alive
        policy, :mod:`talaria.policy.keep_alive`); infinity: not while things stand. Ends
        the reservations due by ``now`` first (mutates them, as ``schedule`` does)."""
        if self.policy.keep_alive_s == math.inf:
            return math.inf  # never: nothing to look at
        self.admitter.expire(now)
        return keep_alive.release_at(self.policy, idle_since_s, self.admission.held.values())

    def can_scale_to_zero(self) -> bool:
        """Not at zero already, no call waits or runs here, no reservation holds it, no pin
        holds a block."""
        return (
            not self.released
            and self.idle
            and not self.admission.held
            and self.slots.can_scale_to_zero()
        )

    def scale_to_zero(self) -> MovePlan:
        """Give the devices back (``SlotControl.scale_to_zero``): returns the KV demotions
        to run first. Raises ``InstanceBusy`` (nothing changed) where ``can_scale_to_zero``
        is False. The next call placed here switches its model in from host or disk."""
        if not self.can_scale_to_zero():
            raise InstanceBusy(
                f"instance {self.spec.name} cannot scale to zero: "
                f"{len(self.calls.running)} calls running, "
                f"{sum(map(len, self.calls.waiting.values()))} waiting, "
                f"{len(self.admission.held)} reservations held"
            )
        return self.slots.scale_to_zero().demoted

    def _build_step(self, moves: tuple[MovePlan, ...]) -> StepPlan | None:
        model = self.rounds.current
        running = self.calls.running
        if model is None or not running:
            return None
        budget = self.policy.max_batch_tokens
        prefill: list[tuple[CallKey, int, int]] = []
        decode: list[CallKey] = []
        ctx = 0
        for key, req in running.items():
            if req.prefilling:
                if budget <= 0:
                    continue
                n = min(budget, req.prompt_len - req.computed)
                prefill.append((key, n, req.computed))
                budget -= n
            else:
                decode.append(key)
                ctx += req.prompt_len + req.generated
        repeat = 1
        if not prefill and decode and not self._admissible_waiting(model):
            repeat = min(running[k].target_output - running[k].generated for k in decode)
        return StepPlan(model, tuple(prefill), tuple(decode), ctx, moves, max(1, repeat))

    def _admissible_waiting(self, model: str) -> bool:
        return bool(self.calls.waiting[model]) and self.rounds.may_admit(model)

    # ------------------------------------------------------------------ completion
    def complete_step(self, plan: StepPlan, now: float, repeat: int = 1) -> list[Request]:
        """The executor ran ``plan`` (``repeat`` decode-only times). Returns finished calls.
        A call of the plan that was released meanwhile (``abort``: its sampling failed, or
        its client went away) is skipped: the rest of the step commits."""
        running = self.calls.running
        for key, n, _ in plan.prefill:
            req = running.get(key)
            if req is None:
                continue
            req.computed += n
            if not req.prefilling:
                self.kv.mark_computed(key)
                req.generated = 1
                req.first_token_s = now
        for key in plan.decode:
            if key in running:
                running[key].generated += repeat
        done = [r for r in running.values() if r.done]
        for req in done:
            self._finish(req, now)
        return done

    def stop(self, key: CallKey) -> None:
        """The running call ``key`` ended early (end-of-sequence): the next
        ``complete_step`` finishes it with the tokens generated so far. Set ``history``
        first if the executor builds it."""
        self.calls.running[key].stopped = True

    def abort(self, key: CallKey, reason: str) -> Request | None:
        """Drop a waiting or running call without keeping what it computed (a client went
        away, or the executor failed while running it). Its KV blocks go back to the pool;
        the session keeps what earlier calls cached. Returns the request, or None if the
        instance does not hold ``key``."""
        removed = self.calls.remove(key)
        if removed is None:
            return None
        req, was_running = removed
        if was_running:
            self.kv.abort(key)
        req.error = reason
        self.counters.calls_failed += 1
        return req

    def _finish(self, req: Request, now: float) -> None:
        call = req.call
        self.calls.finish(req)
        history = req.history if req.history is not None else call.prompt
        self.kv.finish(req.key, history, now)
        req.finished_s = now
        self.counters.calls_finished += 1
        self._calls_done[call.session] = self._calls_done.get(call.session, 0) + 1
        if req.admitted_s is not None:
            self.call_cost.observe(call.model, now - req.admitted_s)
            self.call_work.observe(call.model, now - req.admitted_s)
        done = self._calls_done[call.session]
        self.tool_gaps.start(call.session, ToolGap(call.model, now, None, calls_done=done))
        self.admitter.offer(req, history, now)

    def _session_fault(self, session: SessionKey, exc: Exception) -> None:
        """Policy code raised while reasoning about ``session``'s tool gap. Isolate it: the
        session is an unlikely return from now on (its gap and reservation are dropped, its
        KV stays cached at the lowest value, so nothing is lost), and the instance goes on
        serving every session, this one included. Logged with a traceback once per
        exception type, then one line each; counted in ``counters.policy_faults``."""
        self.counters.policy_faults += 1
        kind = type(exc).__name__
        if kind in self._faults_logged:
            log.warning(
                "instance %s: gap policy failed for session %r again (%s: %s)",
                self.spec.name,
                session,
                kind,
                exc,
            )
        else:
            self._faults_logged.add(kind)
            log.error(
                "instance %s: gap policy failed for session %r; it is treated as an "
                "unlikely return",
                self.spec.name,
                session,
                exc_info=exc,
            )
        self.tool_gaps.end(session)
        self.admitter.drop_reservation(session)
        self.kv.set_priority(session, 0.0)

    def check_integrity(self) -> None:
        """The memory managers' invariants, and this core's own derived state recomputed
        from its tables: per-model running counts and queued prompt tokens, the load, the gap
        index, the memoized estimates, and reservations against KV pins (a held reservation
        pins its session; a pinned session holds a reservation), and an instance scaled to
        zero holding nothing on the device. Raises RuntimeError naming what disagrees."""
        self.kv.check_integrity()
        self.arena.check_integrity()
        problems = self.calls.problems() + self.tool_gaps.problems()
        problems += self.estimates.problems()
        pinned = {s for s in self.kv.sessions if self.kv.is_pinned(s)}
        held = set(self.admission.held)
        if pinned != held:
            problems.append(
                f"pinned without a reservation: {sorted(pinned - held)}; "
                f"reserved but not pinned: {sorted(held - pinned)}"
            )
        if self.released and (
            self.kv.device_free != self.kv.device_blocks
            or any(self.arena.region_of(m) is not None for m in self.models)
            or self.rounds.slot is not None
        ):
            problems.append("scaled to zero, yet a model, a slot or a KV block is on the device")
        if problems:
            raise RuntimeError(f"instance {self.spec.name}: " + "; ".join(problems))
