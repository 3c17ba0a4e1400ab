"""The instance core: one instance's policy and memory, driven by any substrate.

``InstanceCore`` owns the instance's KV manager, weight arena, round scheduler and admission.
It never touches tensors and never reads a clock: a substrate (the simulator's cost model or
a real engine) asks ``schedule(now)`` for the next thing to do, executes it, and reports back
with ``complete_step`` / ``switch_done`` / ``stage_done``. The same object runs live and in
simulation; only the substrate and the clock differ.

Step protocol (vLLM v1 style: prefill and decode are one idea, computed tokens catching up
with known tokens):

* ``submit(req, now)`` queues a call for its model.
* ``schedule(now) -> Schedule``: reservations expire; the open slot is kept or closed; a
  model switch is returned if the next slot needs other weights; waiting calls of the open
  slot's model are admitted (session-prefill admits continuations any time the slot is
  open); a ``StepPlan`` lists prefill chunks and decodes; a stage of the next model's weights
  may be started. KV block moves planned by admission ride with the step.
* ``complete_step(plan, now, repeat)`` advances tokens, finishes calls, offers reservations.

Not thread-safe: one task drives it.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from talaria.config import InstanceSpec, ModelSpec, PolicyConfig, QueueOrder, SlotOrder
from talaria.cost.estimator import Estimator
from talaria.cost.pricing import plan_copy_s
from talaria.errors import ConfigError, ContextTooLong, UnknownModel
from talaria.memory.kv import Allocation, CallKey, KVManager, MovePlan, PrefixMatch
from talaria.memory.weights import SwitchPlan, WeightArena
from talaria.policy.admission import Admission, Reservation
from talaria.policy.gaps import GapModel
from talaria.policy.remaining import PRIOR_OUTPUT_TOKENS, CallCost, SessionLengths
from talaria.policy.rounds import RoundScheduler, SlotDemand
from talaria.policy.router import InstanceView, estimate
from talaria.schedule import Request, Schedule, StepPlan
from talaria.types import Call, Link, Residency, SessionId

# the plan types live in talaria.schedule (below the substrates); re-exported here
__all__ = ["InstanceCore", "InstanceCounters", "Request", "Schedule", "StepPlan"]

log = logging.getLogger(__name__)

STAGE_HEADROOM = 0.05  # of the KV pool kept free when lending blocks to weight staging
MIN_STAGE_SHARE = 0.1  # of a model's weights: a smaller partial stage is not started
RECENT_FINISHED = 4096  # finished calls an instance core remembers
HOST_WEIGHT_SHARE = 0.65  # of host memory, at most, for weight copies when not all fit


@attrs.define
class InstanceCounters:
    model_switches: int = 0
    staged_switches: int = 0
    weight_bytes_moved: int = 0
    kv_bytes_moved: int = 0
    sp_admissions: int = 0
    reclaims: int = 0
    calls_finished: int = 0
    calls_failed: int = 0
    policy_faults: int = 0  # sessions whose gap reasoning raised (see ``_session_fault``)


@attrs.define
class _Gap:
    model: str
    since_s: float
    expected_s: float | None
    tool: str | None = None  # the tool a hint named


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
            staging=policy.weight_staging and len(models) > 1,
            host_weight_bytes=self._host_weight_bytes(spec, models),
            initially_on_host=self._preloaded(spec, models),
        )
        self.kv = self._make_kv(models)
        self.rounds = RoundScheduler([m.name for m in models], policy)
        self.admission = Admission(policy, gaps)
        self.gaps = self.admission.gaps
        self.waiting: dict[str, collections.deque[Request]] = {
            m: collections.deque() for m in self.models
        }
        self.running: dict[CallKey, Request] = {}
        # recently finished calls, for inspection; bounded so a long-running server keeps none
        self.finished: collections.deque[Request] = collections.deque(maxlen=RECENT_FINISHED)
        self.counters = InstanceCounters()
        self._in_gap: dict[SessionId, _Gap] = {}
        self._gaps_of: dict[str, dict[SessionId, _Gap]] = {m: {} for m in self.models}
        self._running_of: dict[str, int] = dict.fromkeys(self.models, 0)
        self._queued_tokens: dict[str, int] = dict.fromkeys(self.models, 0)
        self._load_tokens = 0  # prompt + answer tokens of calls queued or running
        self._switch_memo: dict[str, float] = {}
        self._bounds: dict[str, tuple[float, float]] = {}  # bound terms; cleared on any change
        self._max_tokens = {m.name: self._limit(m) for m in models}
        self._opening_pass = False
        self.stage_blocks: tuple[int, ...] = ()  # device blocks lent to the current stage
        self._faults_logged: set[str] = set()  # exception types logged with a traceback
        # the session-aware slot order's estimate of each model's remaining work
        self.lengths = SessionLengths()
        self.call_cost = CallCost(
            {m.name: PRIOR_OUTPUT_TOKENS * estimator.decode_step_s(m.name, 1, 0) for m in models}
        )
        self._calls_done: dict[SessionId, int] = {}  # calls of each session answered here

    @staticmethod
    def _host_weight_bytes(spec: InstanceSpec, models: Sequence[ModelSpec]) -> int:
        """Host memory kept for weight copies: all models if they fit in
        ``HOST_WEIGHT_SHARE`` of host memory, else that share (the rest is the host KV tier)."""
        largest = max(m.weight_bytes for m in models)
        budget = max(largest, int(spec.host_memory_bytes * HOST_WEIGHT_SHARE))
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

    def bound_s(self, model: str, expected_output: int) -> float:
        """A lower bound of the router's estimate for any call of ``model`` here: the
        estimate of the optimistic view (``optimistic_view``), so it cannot exceed the exact
        one. Memoized until this instance's state changes."""
        cached = self._bounds.get(model)
        if cached is None:  # the estimate is affine in the answer length: keep its two terms
            view = self.optimistic_view(model)
            cached = self._bounds[model] = (estimate(view, 0, 0).total_s, view.decode_step_s)
        return cached[0] + expected_output * cached[1]

    def optimistic_view(self, model: str) -> InstanceView:
        """The view of a call of ``model`` that no real call can beat here: nothing to
        compute for its prompt (every token cached on device, so no KV preparation and no
        prefill) and decode steps at zero context; slot wait, switch and queue as they are."""
        batch = self._running_of[model] + 1
        match = PrefixMatch(0, 0, 0, self.kv.tpb(model))
        return self._view(model, match, self.estimator.decode_step_s(model, batch, 0), False)

    def _view(
        self, model: str, match: PrefixMatch, decode_step_s: float, served_last: bool
    ) -> InstanceView:
        est = self.estimator
        return InstanceView(
            name=self.spec.name,
            residency=self.arena.residency(model),
            slot_wait_s=self._slot_wait_s(model),
            switch_s=self.switch_s(model),
            queue_s=self._queued_tokens[model] / est.prefill_tok_s(model),
            match=match,
            prefill_tok_s=est.prefill_tok_s(model),
            restore_tok_s=est.restore_tok_s(model),
            decode_step_s=decode_step_s,
            load_tokens=self._load_tokens,
            served_last=served_last,
        )

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
        self._bounds.clear()
        self.check_fits(req.call, req.target_output)
        gap = self._in_gap.get(req.call.session_id)
        if gap is not None and self.admission.continuum is not None:
            self.admission.continuum.observe_tool(gap.tool, req.queued_s - gap.since_s)
        self._gap_pop(req.call.session_id)
        self.waiting[req.call.model].append(req)
        self._queued_tokens[req.call.model] += req.prompt_len
        self._load_tokens += req.prompt_len + req.target_output

    def forget_session(self, session: SessionId, ended: bool) -> None:
        """The session went elsewhere (or ended): release what this instance holds for it."""
        done = self._calls_done.pop(session, 0)
        if ended:
            self.lengths.observe(done)
            if self.admission.continuum is not None:
                self.admission.continuum.observe_program(done)
        self._gap_pop(session)
        self._drop_reservation(session)
        if ended:
            self.kv.end_session(session)

    def _drop_reservation(self, session: SessionId) -> Reservation | None:
        """Release ``session``'s reservation (if any) and unpin its KV: the one way a
        reservation ends here. Its KV stays cached, evictable by value."""
        res = self.admission.release(session)
        if res is not None:
            self.kv.unpin(session)
        return res

    def hint(
        self, session: SessionId, expected_s: float | None, now: float, tool: str | None = None
    ) -> None:
        """A client's tool-start hint for a session this instance served last (``tool``: the
        tool it named; Continuum's TTL is sized for it)."""
        gap = self._in_gap.get(session)
        if gap is None:
            return
        gap.expected_s = expected_s
        if tool is not None:
            gap.tool = tool
            if self.admission.retime(session, tool, now) is not None:
                self.kv.unpin(session)  # retime already released it
        try:
            self.admission.update_hint(session, expected_s, now)
            p = self.admission.probability(gap.since_s, now, expected_s)
        except Exception as exc:
            self._session_fault(session, exc)
            return
        self.kv.set_priority(session, p)

    def tool_ended(self, session: SessionId, now: float) -> None:
        """A client's tool-end hint: the session's gap is over, its next call is imminent
        (the hint becomes "the tool took exactly as long as it has been running")."""
        gap = self._in_gap.get(session)
        if gap is not None:
            self.hint(session, now - gap.since_s, now)

    # ------------------------------------------------------------------ views
    def _gap_add(self, session: SessionId, gap: _Gap) -> None:
        """Record a gap that starts now: each model's gaps stay in order of their start
        (``_remaining`` reads the newest first)."""
        self._gap_pop(session)
        self._in_gap[session] = gap
        self._gaps_of[gap.model][session] = gap

    def _gap_pop(self, session: SessionId) -> None:
        gap = self._in_gap.pop(session, None)
        if gap is not None:
            del self._gaps_of[gap.model][session]

    def demand(self, now: float, returns_for: Iterable[str] = ()) -> dict[str, SlotDemand]:
        """Per-model work. Expected returns (a scan of the model's sessions in tool gaps) are
        computed only for the models in ``returns_for``; the rest report None."""
        want = set(returns_for)
        linger = self.policy.slot_linger_s
        out = {}
        for m, queue in self.waiting.items():
            soonest: float | None = None
            returning = 0
            faulty: list[tuple[SessionId, Exception]] = []
            if m in want:
                for sid, gap in self._gaps_of[m].items():
                    try:
                        left = self.gaps.expected_remaining_s(now - gap.since_s, gap.expected_s)
                    except Exception as error:
                        faulty.append((sid, error))
                        continue
                    soonest = left if soonest is None else min(soonest, left)
                    returning += left <= linger
            for sid, fault in faulty:
                self._session_fault(sid, fault)
            oldest = now - queue[0].queued_s if queue else 0.0
            out[m] = SlotDemand(
                len(queue),
                oldest,
                self._running_of[m],
                soonest,
                returning,
                len(self._gaps_of[m]),
                *self._remaining(m, now),
            )
        return out

    def _remaining(self, model: str, now: float) -> tuple[float, float, float]:
        """(expected device seconds ``model``'s sessions still need here, seconds to switch
        to it, seconds to load it back from host) for the session-aware slot order; zeros for
        the other orders. A session in a tool gap longer than ``slot_starvation_s`` no longer
        counts: it is not coming back soon enough to hold a slot."""
        if self.policy.slot_order is not SlotOrder.SHORTEST_REMAINING:
            return 0.0, 0.0, 0.0
        left = self.lengths.expected_left
        done = self._calls_done
        calls = sum(left(done.get(r.call.session_id, 0)) for r in self.waiting[model])
        calls += sum(
            left(done.get(r.call.session_id, 0))
            for r in self.running.values()
            if r.call.model == model
        )
        oldest = now - self.policy.slot_starvation_s
        for sid in reversed(self._gaps_of[model]):  # newest gap first (insertion order)
            if self._gaps_of[model][sid].since_s < oldest:
                break
            calls += left(done.get(sid, 0))
        reload_s = self.estimator.copy_s(self.models[model].weight_bytes, Link.HOST_TO_DEVICE)
        return calls * self.call_cost.of(model), self.switch_s(model), reload_s

    def switch_s(self, model: str) -> float:
        """Seconds to make ``model`` active from its residency (memoized until the arena
        changes: every arena mutation goes through this class and clears the memo)."""
        cached = self._switch_memo.get(model)
        if cached is not None:
            return cached
        if self.arena.active_model == model:
            value = 0.0
        elif self.arena.staging_in_progress == model:
            value = self.estimator.copy_s(self.models[model].weight_bytes, Link.DEVICE_TO_DEVICE)
        elif self.arena.can_switch(model):
            value = plan_copy_s(self.estimator, self.arena.plan_switch(model))
        else:  # a stage in progress pins host memory; switching would cancel it and load
            nbytes = self.models[model].weight_bytes
            value = self.estimator.copy_s(nbytes, Link.HOST_TO_DEVICE)
            if not self.arena.on_host(model):
                value += self.estimator.copy_s(nbytes, Link.DISK_TO_HOST)
        self._switch_memo[model] = value
        return value

    def view(self, call: Call, now: float, served_last: bool) -> InstanceView:
        """What the router needs to rank this instance for ``call`` (no mutation)."""
        model = call.model
        batch = self._running_of[model] + 1
        match = self.kv.match(model, call.tenant, call.prompt)
        step = self.estimator.decode_step_s(model, batch, batch * call.prompt_tokens)
        return self._view(model, match, step, served_last)

    def _slot_wait_s(self, model: str) -> float:
        """Expected seconds until ``model``'s slot admits: the rest of the current slot,
        then each model ahead in the round for its work (capped by the quantum)."""
        if self.rounds.may_admit(model):
            return 0.0
        wait = 0.0
        current = self.rounds.current
        if current is not None and current != model:
            wait += self._work_s(current)
        for other in self.rounds.models_ahead(model):
            if other != current and self.waiting[other]:
                wait += self._work_s(other) + self.switch_s(other)
        return wait

    def _work_s(self, model: str) -> float:
        """Seconds ``model``'s slot is expected to hold the device for its queued and running
        calls (the policy's ``slot_wait_*`` assumption per call, capped by the quantum)."""
        est = self.estimator
        calls = len(self.waiting[model]) + self._running_of[model]
        if calls == 0:
            return 0.0
        p = self.policy
        per_call = est.decode_step_s(model, calls, 0) * p.slot_wait_output_tokens
        per_call += p.slot_wait_prefill_tokens / est.prefill_tok_s(model)
        return min(p.slot_max_s, per_call)

    # ------------------------------------------------------------------ scheduling
    def schedule(self, now: float) -> Schedule:
        """Decide the next action (see module docstring). Mutates slot, admission, KV."""
        self._bounds.clear()
        self._expire(now)
        moves: tuple[MovePlan, ...] = ()
        slot = self.rounds.slot
        idle = (
            slot is not None and not self._running_of[slot.model] and not self.waiting[slot.model]
        )
        # expected returns matter only to an idle slot deciding whether to linger, and only
        # while another model waits (both slot orders keep a slot nobody else needs)
        others_wait = slot is not None and any(
            q for m, q in self.waiting.items() if m != slot.model
        )
        linger = slot is not None and idle and others_wait
        demand = self.demand(now, returns_for=[slot.model] if slot and linger else ())
        if slot is not None:
            self.rounds.should_close(now, demand)
        slot_running = slot is not None and self._running_of[slot.model] > 0
        if slot is None or (slot.closing and not slot_running):
            nxt = self.rounds.next_model(demand)
            if nxt is None:
                return Schedule(stage=self._maybe_stage(demand), kv_moves=moves)
            if nxt != self.arena.active_model:
                return self._switch_to(nxt, moves)
            self._open(nxt, now)
        moves += self._admit(now)
        # admission moved only the open slot's calls from waiting to running: the other
        # models' demand, all the staging guess reads, is what it was
        stage = self._maybe_stage(demand)
        step = self._build_step(moves)
        if step is None:
            return Schedule(stage=stage, kv_moves=moves)
        keys = [key for key, _, _ in step.prefill] + list(step.decode)
        return Schedule(step=step, stage=stage, requests={k: self.running[k] for k in keys})

    def _switch_to(self, model: str, moves: tuple[MovePlan, ...]) -> Schedule:
        arena = self.arena
        if arena.staging_in_progress == model:
            return Schedule(kv_moves=moves, waiting_for_stage=True)
        staged = arena.staged_model == model
        if not staged:
            self._cancel_stage()
        self._release_model_reservations(self.rounds.current)
        plan = arena.switch(model)
        self._switch_memo.clear()
        self.rounds.slot = None
        self.counters.model_switches += 1
        self.counters.staged_switches += staged
        self.counters.weight_bytes_moved += plan.total_bytes
        return Schedule(switch=plan, kv_moves=moves)

    def switch_done(self, model: str, now: float) -> None:
        """The substrate finished copying ``model``'s weights: its slot opens, and the KV
        blocks lent to staging (already copied from) go back to the pool."""
        self._bounds.clear()
        self.kv.return_lent()
        self.stage_blocks = ()
        self._open(model, now)

    def stage_done(self, model: str) -> None:
        if self.arena.staging_in_progress == model:
            self.arena.finish_stage(model)
            self._switch_memo.clear()
            self._bounds.clear()

    def _open(self, model: str, now: float) -> None:
        self.rounds.open(model, now)
        self._opening_pass = True

    def _release_model_reservations(self, model: str | None) -> None:
        """A slot closes: its sessions cannot be served until the model's next slot, so their
        reservations end; their KV stays cached and is demoted by value as room is needed.
        A TTL pin (Continuum's) lives out its TTL whatever the slots do."""
        if model is None:
            return
        for sid, res in list(self.admission.held.items()):
            if res.model == model and not res.hard:
                self._drop_reservation(sid)

    def _maybe_stage(self, demand: Mapping[str, SlotDemand]) -> SwitchPlan | None:
        """Stage the predicted next model into free KV blocks lent for the purpose (all of
        it if they suffice, else a part), keeping headroom for the open slot's queue."""
        arena = self.arena
        if not self.policy.weight_staging or arena.staging_in_progress is not None:
            return None
        nxt = self.rounds.predict_next(demand)
        if nxt is None or arena.staged_model == nxt or not arena.can_stage(nxt):
            return None
        if arena.residency(nxt) in (Residency.ACTIVE, Residency.RESIDENT):
            return None
        want = self.models[nxt].weight_bytes
        blocks = min(math.ceil(want / self.kv.block_bytes), self._spare_blocks())
        nbytes = min(want, blocks * self.kv.block_bytes)
        if nbytes < MIN_STAGE_SHARE * want:
            return None
        self._cancel_stage()
        self.stage_blocks = self.kv.lend(blocks)
        plan = arena.start_stage(nxt, nbytes)
        self._switch_memo.clear()
        self.counters.weight_bytes_moved += plan.total_bytes
        return plan

    def _spare_blocks(self) -> int:
        """Free device blocks not needed by the open slot's queue, less the headroom."""
        model = self.rounds.current
        queued = 0
        if model is not None:
            tpb = self.kv.tpb(model)
            queued = sum(
                math.ceil((r.prompt_len + r.target_output) / tpb) for r in self.waiting[model]
            )
        headroom = math.ceil(STAGE_HEADROOM * self.kv.device_blocks)
        return max(0, self.kv.device_free - queued - headroom)

    def _cancel_stage(self) -> None:
        """Abandon staging and give its lent blocks back to the KV pool."""
        self.arena.cancel_stage()
        self.kv.return_lent()
        self.stage_blocks = ()
        self._switch_memo.clear()

    def _expire(self, now: float) -> None:
        """Unpin expired reservations; their KV stays cached, valued by return probability."""
        adm = self.admission
        waiting: set[SessionId] = set()
        if adm.continuum is not None and adm.due(now):
            waiting = {r.call.session_id for q in self.waiting.values() for r in q}
        for res in adm.expire(now, waiting):
            self.kv.unpin(res.session)
            gap = self._in_gap.get(res.session)
            if gap is not None:
                try:
                    p = self.admission.probability(gap.since_s, now, gap.expected_s)
                except Exception as exc:
                    self._session_fault(res.session, exc)
                    continue
                self.kv.set_priority(res.session, p)

    def _admit(self, now: float) -> tuple[MovePlan, ...]:
        model = self.rounds.current
        if model is None or not self.rounds.may_admit(model):
            return ()
        moves: list[MovePlan] = []
        if self.policy.queue_order is QueueOrder.PROGRAM_FCFS:
            self._program_order(model)
        queue = self.waiting[model]
        while queue and len(self.running) < self.policy.max_running:
            req = queue[0]
            call = req.call
            self._drop_reservation(call.session_id)
            if self.kv.lent_blocks and not self.kv.can_allocate(
                model, call.tenant, call.prompt, req.target_output
            ):
                self._cancel_stage()  # KV for a waiting call comes before staged weights
            if not self.kv.can_allocate(model, call.tenant, call.prompt, req.target_output):
                moves.extend(self._reclaim_for(req, now))
                if not self.running and self.admission.continuum is not None:
                    moves.extend(self._release_stuck(req, now))
                if not self.kv.can_allocate(model, call.tenant, call.prompt, req.target_output):
                    break
            queue.popleft()
            self._queued_tokens[model] -= req.prompt_len
            alloc = self.kv.allocate(
                call.key, model, call.tenant, call.prompt, req.target_output, now
            )
            self._admitted(req, alloc, now)
            moves.extend(m for m in (alloc.evicted.demoted, alloc.restore) if m.moves)
        if self._opening_pass:
            self._opening_pass = False
            self.rounds.end_opening_pass()
        return tuple(moves)

    def _program_order(self, model: str) -> None:
        """Continuum's program-level FCFS: waiting calls of sessions holding a pin first,
        then by their session's first arrival, then by their own."""
        held = self.admission.held
        queue = self.waiting[model]
        ordered = sorted(
            queue, key=lambda r: (r.call.session_id not in held, r.program_s, r.queued_s)
        )
        queue.clear()
        queue.extend(ordered)

    def _release_stuck(self, req: Request, now: float) -> list[MovePlan]:
        """Continuum: a waiting call cannot be admitted and nothing runs: release TTL pins,
        latest-started program first, until it fits (their KV is demoted or dropped)."""
        return self._demote_until_fits(req, self.admission.stuck_order([req.call.session_id]), now)

    def _admitted(self, req: Request, alloc: Allocation, now: float) -> None:
        slot = self.rounds.slot
        req.admitted_s = now
        req.reused_tokens = alloc.reused_tokens
        req.restored_tokens = alloc.restored_tokens
        have = alloc.reused_tokens + alloc.restored_tokens
        req.recomputed_tokens = max(0, min(req.known_tokens, req.prompt_len) - have)
        if req.recomputed_tokens and self.admission.continuum is not None:
            self.admission.continuum.observe_wait(now - req.queued_s)  # it lost its KV
        req.blocks = alloc.device_blocks
        req.computed = have
        if req.computed >= req.prompt_len:  # whole prompt cached: recompute the last token
            req.computed = req.prompt_len - 1
        req.sp_admitted = bool(slot and not self._opening_pass and req.queued_s > slot.opened_s)
        self.counters.sp_admissions += req.sp_admitted
        self.counters.kv_bytes_moved += alloc.restore.nbytes + alloc.evicted.demoted.nbytes
        self.running[req.key] = req
        self._running_of[req.call.model] += 1

    def _reclaim_for(self, req: Request, now: float) -> list[MovePlan]:
        """Release reservations (least valuable first) until ``req`` fits, if it waited long
        enough. Their KV is demoted to host, not dropped."""
        if not self.admission.should_reclaim(now - req.queued_s):
            return []
        order = self.admission.reclaim_order(now, exclude=[req.call.session_id])
        return self._demote_until_fits(req, order, now)

    def _demote_until_fits(
        self, req: Request, order: Sequence[Reservation], now: float
    ) -> list[MovePlan]:
        """Release the reservations of ``order`` one by one, demoting their KV, until
        ``req`` fits. Returns the block moves to run."""
        call = req.call
        moves = []
        for res in order:
            self.admission.reclaim(res.session)
            self.kv.unpin(res.session)
            ev = self.kv.offload(res.session, now)
            self.counters.reclaims += 1
            self.counters.kv_bytes_moved += ev.demoted.nbytes
            if ev.demoted.moves:
                moves.append(ev.demoted)
            if self.kv.can_allocate(call.model, call.tenant, call.prompt, req.target_output):
                break
        return moves

    def _build_step(self, moves: tuple[MovePlan, ...]) -> StepPlan | None:
        model = self.rounds.current
        if model is None or not self.running:
            return None
        budget = self.policy.max_batch_tokens
        prefill: list[tuple[CallKey, int, int]] = []
        decode: list[CallKey] = []
        ctx = 0
        for key, req in self.running.items():
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
            repeat = min(self.running[k].target_output - self.running[k].generated for k in decode)
        return StepPlan(model, tuple(prefill), tuple(decode), ctx, moves, max(1, repeat))

    def _admissible_waiting(self, model: str) -> bool:
        return bool(self.waiting[model]) and self.rounds.may_admit(model)

    # ------------------------------------------------------------------ completion
    def complete_step(self, plan: StepPlan, now: float, repeat: int = 1) -> list[Request]:
        """The substrate ran ``plan`` (``repeat`` decode-only times). Returns finished calls."""
        self._bounds.clear()
        for key, n, _ in plan.prefill:
            req = self.running[key]
            req.computed += n
            if not req.prefilling:
                self.kv.mark_computed(key)
                req.generated = 1
                req.first_token_s = now
        for key in plan.decode:
            self.running[key].generated += repeat
        done = [r for r in self.running.values() if r.done]
        for req in done:
            self._finish(req, now)
        return done

    def stop(self, key: CallKey) -> None:
        """The running call ``key`` ended early (end-of-sequence): the next
        ``complete_step`` finishes it with the tokens generated so far. Set ``history``
        first if the substrate builds it."""
        self.running[key].stopped = True

    def abort(self, key: CallKey, reason: str) -> Request | None:
        """Drop a waiting or running call without keeping what it computed (a client went
        away, or the substrate failed while running it). Its KV blocks go back to the pool;
        the session keeps what earlier calls cached. Returns the request, or None if the
        instance does not hold ``key``."""
        self._bounds.clear()
        req = self.running.pop(key, None)
        if req is not None:
            self.kv.abort(key)
            self._running_of[req.call.model] -= 1
        else:
            req = self._unqueue(key)
            if req is None:
                return None
            self._queued_tokens[req.call.model] -= req.prompt_len
        self._load_tokens -= req.prompt_len + req.target_output
        req.error = reason
        self.counters.calls_failed += 1
        return req

    def _unqueue(self, key: CallKey) -> Request | None:
        for queue in self.waiting.values():
            for req in queue:
                if req.key == key:
                    queue.remove(req)
                    return req
        return None

    def _finish(self, req: Request, now: float) -> None:
        call = req.call
        del self.running[req.key]
        self._running_of[call.model] -= 1
        self._load_tokens -= req.prompt_len + req.target_output
        history = req.history if req.history is not None else call.prompt
        self.kv.finish(req.key, history, now)
        req.finished_s = now
        self.finished.append(req)
        self.counters.calls_finished += 1
        self._calls_done[call.session_id] = self._calls_done.get(call.session_id, 0) + 1
        if req.admitted_s is not None:
            self.call_cost.observe(call.model, now - req.admitted_s)
        self._gap_add(call.session_id, _Gap(call.model, now, None))
        blocks = self.kv.session_device_blocks(call.session_id)
        try:
            p = self.admission.probability(now, now, None)
            offered = self.admission.offer(
                call.session_id,
                call.model,
                blocks,
                now,
                None,
                reload_s=self._reload_s(call.model, len(history)),
                program_s=req.program_s,
            )
        except Exception as exc:
            self._session_fault(call.session_id, exc)
            return
        self.kv.set_priority(call.session_id, p)
        if offered is not None:
            self.kv.pin(call.session_id)

    def _reload_s(self, model: str, tokens: int) -> float:
        """Seconds to recompute ``tokens`` of context (attention included) on this instance."""
        return self.estimator.step_s(model, tokens, tokens * (tokens + 1) / 2, 0, 0)

    def _session_fault(self, session: SessionId, exc: Exception) -> None:
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
        self._gap_pop(session)
        self._drop_reservation(session)
        self.kv.set_priority(session, 0.0)
        self._bounds.clear()

    def end_session(self, session: SessionId) -> None:
        self.forget_session(session, ended=True)

    def check_integrity(self) -> None:
        """The memory managers' invariants, and this core's own derived state recomputed
        from its tables: per-model running counts and queued prompt tokens, the load, the gap
        index, and reservations against KV pins (a held reservation pins its session; a
        pinned session holds a reservation). Raises RuntimeError naming what disagrees."""
        self.kv.check_integrity()
        self.arena.check_integrity()
        problems = []
        for m in self.models:
            running = sum(1 for r in self.running.values() if r.call.model == m)
            queued = sum(r.prompt_len for r in self.waiting[m])
            if self._running_of[m] != running:
                problems.append(f"{m}: {self._running_of[m]} running counted, {running} held")
            if self._queued_tokens[m] != queued:
                problems.append(f"{m}: {self._queued_tokens[m]} queued tokens counted, {queued}")
            gaps = {s for s, g in self._in_gap.items() if g.model == m}
            if gaps != set(self._gaps_of[m]):
                problems.append(f"{m}: gap index {sorted(self._gaps_of[m])} != {sorted(gaps)}")
        calls = list(self.running.values()) + [r for q in self.waiting.values() for r in q]
        load = sum(r.prompt_len + r.target_output for r in calls)
        if self._load_tokens != load:
            problems.append(f"load {self._load_tokens} tokens counted, {load} held")
        pinned = {s for s in self.kv.sessions if self.kv.is_pinned(s)}
        held = set(self.admission.held)
        if pinned != held:
            problems.append(
                f"pinned without a reservation: {sorted(pinned - held)}; "
                f"reserved but not pinned: {sorted(held - pinned)}"
            )
        if problems:
            raise RuntimeError(f"instance {self.spec.name}: " + "; ".join(problems))
