"""What one instance expects: the views the router ranks it by, and each model's demand the
slot order decides on.

``InstanceEstimates`` reads the instance's tables (calls, tool gaps, slot state, weight
arena, KV) and its estimator; it mutates none of them. Two values are memoized because the
router asks for them on every call: a model's switch time, keyed by the arena's commit count,
and the routing bound's terms, keyed by the call table's, the arena's and the slot
state's. No one clears a memo by hand: a changed table changes the key, and
``problems()`` recomputes every memoized entry that is current.

Everything here is seconds of device time on the instance's estimator; see
:mod:`talaria.policy.router` for how views become an estimate and a route, and
:mod:`talaria.policy.rounds` for how demand becomes a slot decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import attrs

from talaria.config import InstanceSpec, ModelSpec, PolicyConfig, SlotOrder
from talaria.core.calls import CallTable
from talaria.core.tool_gaps import GapTable
from talaria.cost.estimator import Estimator
from talaria.cost.pricing import plan_copy_s
from talaria.cost.step_shape import StepShape
from talaria.memory.kv import KVManager, PrefixMatch
from talaria.memory.weights import WeightArena
from talaria.policy.admission import Admission
from talaria.policy.gaps import GapModel
from talaria.policy.remaining import CallCost, SessionLengths
from talaria.policy.rounds import RoundScheduler, SlotDemand
from talaria.policy.router import InstanceView, estimate, later_share_s, pack_key
from talaria.types import Call, Link, SessionKey

FaultHandler = Callable[[SessionKey, Exception], None]
_BoundKey = tuple[int, int, tuple[object, ...]]
_BoundTerms = tuple[float, float, float, float, bool]
# Relative slack of a bound that adds the estimate's terms in its own order: far above the
# rounding of a sum of a few non-negative floats (about 1e-15), far below any real difference.
_BOUND_SLACK = 1e-12


@attrs.define(eq=False, kw_only=True)
class InstanceEstimates:
    """The instance's expectations, derived from its tables (see the module docstring)."""

    spec: InstanceSpec
    models: Mapping[str, ModelSpec]
    policy: PolicyConfig
    estimator: Estimator
    arena: WeightArena
    kv: KVManager
    rounds: RoundScheduler
    calls: CallTable
    gaps: GapTable
    admission: Admission
    lengths: SessionLengths
    call_cost: CallCost  # recent service seconds per call: the open batch's drain
    call_work: CallCost  # windowed mean of the same: priced remaining work
    calls_done: Mapping[SessionKey, int]  # each session's calls answered here (read only)
    on_fault: FaultHandler  # isolates a session whose gap reasoning raised in ``demand``
    released: Callable[[], bool]  # the instance is at zero: a switch waits for devices first
    # when the wake in progress (devices, then the copy) is expected to end; None: no wake
    waking_until: Callable[[], float | None] = lambda: None
    _switch_memo: tuple[int, dict[str, float]] = attrs.field(init=False, factory=lambda: (-1, {}))
    _bound_memo: tuple[_BoundKey | None, dict[str, _BoundTerms]] = attrs.field(
        init=False, factory=lambda: (None, {})
    )

    # ------------------------------------------------------------------ router views
    @property
    def name(self) -> str:
        """The instance's name."""
        return self.spec.name

    def bound_s(
        self,
        model: str,
        expected_output: int,
        calls_left: float = 1.0,
        wake_charge_s: float = 0.0,
        pack_slack: float = 0.0,
    ) -> float:
        """A lower bound of the router's key (``pack_key`` of ``Estimate.charge_s(calls_left,
        wake_charge_s)``) for any call of ``model`` here: the key of the optimistic view's
        charge (``optimistic_view``, which wakes the instance exactly when a real call's view
        does, and holds the model's calls exactly when it does), so it cannot exceed the exact
        one. Where a wake is shared the sum is taken a relative ``_BOUND_SLACK`` low (the
        exact charge subtracts the shared part in another order)."""
        terms = self._terms(model)
        return _bound_key(terms, expected_output, calls_left, wake_charge_s, pack_slack)

    def prefill_bound_s(
        self,
        call: Call,
        expected_output: int,
        calls_left: float = 1.0,
        wake_charge_s: float = 0.0,
        pack_slack: float = 0.0,
    ) -> float:
        """A tighter lower bound for ``call`` itself: ``bound_s`` plus the prefill of the
        whole prompt (before the key's discount) when no block of its prefix has KV here
        (device or host), so that its exact view's match is empty too; ``bound_s`` where some
        is cached. The sum is taken a relative ``_BOUND_SLACK`` low, so that float rounding
        (the exact estimate adds the same non-negative terms in another order) cannot put it
        above the exact estimate."""
        cached = self.kv.holds_prefix(call.model, call.tenant, call.prompt)
        uncached = None if cached else call.prompt_tokens
        terms = self._terms(call.model)
        return _bound_key(terms, expected_output, calls_left, wake_charge_s, pack_slack, uncached)

    def _terms(self, model: str) -> _BoundTerms:
        """The bound's terms for ``model``, memoized on the tables they read."""
        key: _BoundKey = (self.calls.changes, self.arena.changes, self.rounds.state)
        memo_key, memo = self._bound_memo
        if memo_key != key:
            memo = {}
            self._bound_memo = (key, memo)
        terms = memo.get(model)
        if terms is None:
            terms = memo[model] = self._bound_terms(model)
        return terms

    def _bound_terms(self, model: str) -> _BoundTerms:
        """The bound is affine in the answer length and, where nothing is cached, in the
        prompt length: (its value at zero, its slope per answer token, the prefill rate, the
        wake within the value, whether a call would join the model's calls here)."""
        view = self.optimistic_view(model)
        total = estimate(view, 0, 0).total_s
        return total, view.decode_step_s, view.prefill_tok_s, view.wake_s, view.model_calls > 0

    def optimistic_view(self, model: str) -> InstanceView:
        """The view of a call of ``model`` that no real call can beat here: nothing to
        compute for its prompt (every token cached on device, so no KV preparation and no
        prefill) and decode steps at zero context; slot wait, switch and queue as they are."""
        batch = self.calls.running_of(model) + 1
        match = PrefixMatch(0, 0, 0, self.kv.tpb(model))
        step = self.estimator.decode_step_s(model, batch, 0)
        return self._view(model, match, step, False, self.slot_wait_s(model))

    def view(self, call: Call, now: float, served_last: bool) -> InstanceView:
        """What the router needs to rank this instance for ``call``."""
        model = call.model
        batch = self.calls.running_of(model) + 1
        match = self.kv.match(model, call.tenant, call.prompt)
        step = self.estimator.decode_step_s(model, batch, batch * call.prompt_tokens)
        return self._view(model, match, step, served_last, self.held_wait_s(model, now))

    def _view(
        self,
        model: str,
        match: PrefixMatch,
        decode_step_s: float,
        served_last: bool,
        slot_wait_s: float,
    ) -> InstanceView:
        est, calls = self.estimator, self.calls
        mine = calls.held_of(model)
        return InstanceView(
            name=self.spec.name,
            residency=self.arena.residency(model),
            slot_wait_s=slot_wait_s,
            switch_s=self.switch_s(model),
            queue_s=calls.queued_tokens(model) / est.prefill_tok_s(model),
            match=match,
            prefill_tok_s=est.prefill_tok_s(model),
            restore_tok_s=est.restore_tok_s(model),
            decode_step_s=decode_step_s,
            load_tokens=calls.load_tokens,
            served_last=served_last,
            wake_s=self.wake_s(model),
            model_calls=mine,
            other_calls=calls.held_count - mine,
        )

    def switch_s(self, model: str) -> float:
        """Seconds to make ``model`` active from its residency."""
        changes, memo = self._switch_memo
        if changes != self.arena.changes:
            memo = {}
            self._switch_memo = (self.arena.changes, memo)
        value = memo.get(model)
        if value is None:
            value = memo[model] = self._switch_s(model)
        return value

    def _switch_s(self, model: str) -> float:
        if self.arena.active_model == model:
            return 0.0
        return self.wake_s(model) + self._copy_s(model)

    def wake_s(self, model: str) -> float:
        """Of ``switch_s(model)``: the wait for this instance's devices when it is at zero."""
        if self.arena.active_model == model or not self.released():
            return 0.0
        return self.estimator.provision_s()

    def _copy_s(self, model: str) -> float:
        arena, est = self.arena, self.estimator
        if arena.staging_in_progress == model:
            return est.copy_s(self.models[model].weight_bytes, Link.DEVICE_TO_DEVICE)
        if arena.can_switch(model):
            return plan_copy_s(est, arena.plan_switch(model))
        # a stage in progress pins host memory; switching would cancel it and load
        nbytes = self.models[model].weight_bytes
        value = est.copy_s(nbytes, Link.HOST_TO_DEVICE)
        if not arena.on_host(model):
            value += est.copy_s(nbytes, Link.DISK_TO_HOST)
        return value

    def slot_wait_s(self, model: str) -> float:
        """Expected seconds until ``model``'s slot admits: the rest of the current slot,
        then each model ahead in the round for its work (capped by the quantum)."""
        if self.rounds.may_admit(model):
            return 0.0
        wait = 0.0
        current = self.rounds.current
        if current is not None and current != model:
            wait += self.work_s(current)
        for other in self.rounds.models_ahead(model):
            if other != current and self.calls.waiting[other]:
                wait += self.work_s(other) + self.switch_s(other)
        return wait

    def held_wait_s(self, model: str, now: float) -> float:
        """``slot_wait_s`` where the slot order holds a slot for its sessions: under the
        session-aware order the open slot of another model stays open while its sessions
        keep returning (no quantum), so a call of ``model`` waits for that hold: the open
        model's remaining work here (``remaining``), at most ``slot_starvation_s`` (the close
        rule lets no waiting call wait longer), and at least ``slot_wait_s``, which the
        routing bound uses (it must not exceed this). Other orders: ``slot_wait_s`` (their
        ``remaining`` is zero).

        It reads the open model's sessions in a tool gap as of ``now``, so the bound's memo
        cannot key it; it prices no preemption of the open slot (a new call's session has all
        of its work left, so it rarely has the smaller work per session). While a wake is in
        progress nothing admits before it ends: at least what is left of it (the switch
        already shows its model active)."""
        wait = self.slot_wait_s(model)
        until = self.waking_until()
        if until is not None:
            wait = max(wait, until - now)
        current = self.rounds.current
        if current is None or current == model or self.rounds.may_admit(model):
            return wait
        hold = min(self.policy.slot_starvation_s, self._remaining_work(current, now)[0])
        return max(wait, hold)

    def work_s(self, model: str) -> float:
        """Seconds ``model``'s slot is expected to hold the device for its queued and running
        calls (the policy's ``slot_wait_*`` assumption per call, capped by the quantum)."""
        est = self.estimator
        calls = len(self.calls.waiting[model]) + self.calls.running_of(model)
        if calls == 0:
            return 0.0
        p = self.policy
        per_call = est.decode_step_s(model, calls, 0) * p.slot_wait_output_tokens
        per_call += p.slot_wait_prefill_tokens / est.prefill_tok_s(model)
        return min(p.slot_max_s, per_call)

    def reload_s(self, model: str, tokens: int) -> float:
        """Seconds to recompute ``tokens`` of context (attention included) on this instance."""
        return self.estimator.step_s(model, StepShape.prefill(tokens))

    # ------------------------------------------------------------------ slot demand
    def demand(self, now: float, returns_for: Iterable[str] = ()) -> dict[str, SlotDemand]:
        """Per-model work, for the models with any: calls waiting or running, sessions in a
        tool gap, or the open slot. An idle model is left out: no slot decision reads it
        (``RoundScheduler`` takes a missing model as ``rounds.IDLE``, and an idle model's
        demand differs from that only in its switch and reload times, which the decisions
        read for models with waiting work or sessions in a gap alone). On a pool instance
        serving dozens of models this skips most of them at every step. Expected returns
        (from the gap table's index: a few gaps priced, not all) are computed only for the
        models in ``returns_for``; the rest report None. Where the gap model raises for a
        gap the index prices, every gap of that model is priced one by one and each session
        whose reasoning raises is handed to ``on_fault`` and left out (a gap the index does
        not price is not tried: a gap model that raises only at some elapsed times may go
        unnoticed there)."""
        want = set(returns_for)
        linger = self.policy.slot_linger_s
        gap_model = self.admission.gaps
        current = self.rounds.current
        busy = set(self.calls.held_models())
        busy.update(self.gaps.models())
        if current is not None:
            busy.add(current)
        out = {}
        for m in sorted(busy, key=self.rounds.position):  # in the instance's model order
            queue = self.calls.waiting[m]
            soonest: float | None = None
            returning = 0
            if m in want:
                soonest, returning = self._returns(m, now, gap_model, linger)
            oldest = now - queue[0].queued_s if queue else 0.0
            running = self.calls.running_of(m)
            out[m] = SlotDemand(
                len(queue),
                oldest,
                running,
                soonest,
                returning,
                self.gaps.count(m),
                *self.remaining(m, now),
                drain_s=self._drain_s(m, running),
            )
        return out

    def _returns(
        self, model: str, now: float, gap_model: GapModel, linger: float
    ) -> tuple[float | None, int]:
        """``model``'s soonest expected return from a tool gap (None: no gap) and how many
        are due within ``linger``: from the gap table's index, or, where the gap model
        raised for a gap, priced gap by gap, each faulty session handed to ``on_fault``."""
        found = self.gaps.returns(model, now, gap_model, linger)
        if found is not None:
            return (None if found[0] == math.inf else found[0]), found[1]
        soonest: float | None = None
        returning = 0
        faulty: list[tuple[SessionKey, Exception]] = []
        for sid, gap in self.gaps.of_model(model):
            try:
                left = gap_model.expected_remaining_s(now - gap.since_s, gap.expected_s)
            except Exception as error:
                faulty.append((sid, error))
                continue
            soonest = left if soonest is None else min(soonest, left)
            returning += left <= linger
        for sid, fault in faulty:
            self.on_fault(sid, fault)
        return soonest, returning

    def _drain_s(self, model: str, running: int) -> float:
        """Expected seconds until the open slot's running calls finish, for the session-aware
        slot order's starvation bound: one call's mean measured service time (a batch runs
        its calls side by side); zero for a model whose slot is not open or runs nothing."""
        if (
            self.policy.slot_order is not SlotOrder.SHORTEST_REMAINING
            or running == 0
            or model != self.rounds.current
        ):
            return 0.0
        return self.call_cost.of(model)

    def remaining(self, model: str, now: float) -> tuple[float, int, float, float]:
        """(expected device seconds ``model``'s sessions still need here, how many sessions
        that counts, seconds to switch to it, seconds to load it back from host) for the
        session-aware slot order; zeros for the other orders. A session in a tool gap longer
        than ``slot_starvation_s`` no longer counts: it is not coming back soon enough to
        hold a slot."""
        if self.policy.slot_order is not SlotOrder.SHORTEST_REMAINING:
            return 0.0, 0, 0.0, 0.0
        return (*self._remaining_work(model, now), self.switch_s(model), self._reload_s(model))

    def _remaining_work(self, model: str, now: float) -> tuple[float, int]:
        """``remaining``'s first two figures: the work and the sessions it counts (zeros for
        the orders other than the session-aware one)."""
        if self.policy.slot_order is not SlotOrder.SHORTEST_REMAINING:
            return 0.0, 0
        left = self.lengths.expected_left
        done = self.calls_done
        queue = self.calls.waiting[model]
        calls = sum(left(done.get(r.call.session, 0)) for r in queue)
        calls += sum(
            left(done.get(r.call.session, 0))
            for r in self.calls.running.values()
            if r.call.model == model
        )
        recent = self.gaps.recent_calls_done(model, now - self.policy.slot_starvation_s)
        calls += sum(n * left(d) for d, n in recent.items())
        sessions = len(queue) + self.calls.running_of(model) + sum(recent.values())
        return calls * self.call_work.of(model), sessions

    def _reload_s(self, model: str) -> float:
        """Seconds to bring ``model`` back once its slot gives way: nothing when every model
        keeps a weight region (it stays resident), else a copy from host."""
        if self.arena.n_regions >= len(self.models):
            return 0.0
        return self.estimator.copy_s(self.models[model].weight_bytes, Link.HOST_TO_DEVICE)

    # ------------------------------------------------------------------ integrity
    def problems(self) -> list[str]:
        """Every memoized value that is current, recomputed; a line for each that differs."""
        out = []
        changes, switches = self._switch_memo
        if changes == self.arena.changes:
            for model, value in switches.items():
                if value != self._switch_s(model):
                    out.append(
                        f"{model}: switch memo {value} s, recomputed {self._switch_s(model)}"
                    )
        key, bounds = self._bound_memo
        if key == (self.calls.changes, self.arena.changes, self.rounds.state):
            for model, terms in bounds.items():
                if terms != self._bound_terms(model):
                    out.append(
                        f"{model}: bound memo {terms}, recomputed {self._bound_terms(model)}"
                    )
        return out


def _bound_key(
    terms: _BoundTerms,
    expected_output: int,
    calls_left: float,
    wake_charge_s: float,
    pack_slack: float,
    uncached_tokens: int | None = None,
) -> float:
    """The optimistic view's key from its memoized ``terms``: its charge, plus the prefill of
    ``uncached_tokens`` (None: none) taken a relative ``_BOUND_SLACK`` low, then the pack
    slack's discount where a call would join the model's calls (``pack_key``; guarded here
    so that a search without a slack makes no extra call per candidate)."""
    bound = terms[0] + expected_output * terms[1]
    if terms[3]:
        bound += wake_charge_s
    later = later_share_s(terms[3], calls_left)
    if later:
        bound = (bound - later) * (1.0 - _BOUND_SLACK)
    if uncached_tokens is not None:
        bound = (bound + uncached_tokens / terms[2]) * (1.0 - _BOUND_SLACK)
    return pack_key(bound, terms[4], pack_slack) if pack_slack and terms[4] else bound
