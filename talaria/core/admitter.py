"""Admission on one instance: waiting calls into the running batch, and the reservations
that keep a returning session's KV on the device.

``Admitter`` carries out the reservations policy (:class:`talaria.policy.admission.Admission`)
against the instance's KV manager:

* ``admit`` moves the open slot's waiting calls into the batch while their KV fits, the
  tenant with the fewest calls in the batch first when several wait (the session's own
  reservation is released first and its blocks reused; lent staging blocks come back before
  a waiting call goes without; reservations of others are reclaimed, least valuable first,
  once a call has waited long enough; Continuum's TTL pins give way when nothing runs);
* ``offer`` reserves a finished call's KV for its session's return; hints re-value it;
  ``expire`` unpins what ran out of time; ``release_model`` ends a closing slot's
  reservations; ``drop_reservation`` is the one way a reservation ends here (release and
  unpin together). A released session's KV stays cached, evictable by its value.

Mutates the call table, the KV manager, the reservations, the slot's opening pass and the
instance's counters. Policy code that raises while reasoning about one session is handed to
``on_fault`` (the instance isolates that session); everyone else is served.

Not thread-safe: the instance core's single driver owns it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import attrs

from talaria.config import PolicyConfig, QueueOrder
from talaria.core.calls import CallTable
from talaria.core.counters import InstanceCounters
from talaria.core.estimates import FaultHandler, InstanceEstimates
from talaria.core.slots import SlotControl
from talaria.core.tool_gaps import GapTable
from talaria.memory.kv import Allocation, KVManager, MovePlan
from talaria.policy.admission import Admission, Reservation
from talaria.policy.rounds import RoundScheduler
from talaria.policy.tenant_share import fair_order
from talaria.schedule import Request
from talaria.types import SessionKey, TokenSeq


@attrs.define(eq=False, kw_only=True)
class Admitter:
    """Admission and reservations of one instance (see the module docstring)."""

    policy: PolicyConfig
    admission: Admission
    kv: KVManager
    rounds: RoundScheduler
    calls: CallTable
    gaps: GapTable
    slots: SlotControl
    estimates: InstanceEstimates
    counters: InstanceCounters
    on_fault: FaultHandler

    # ------------------------------------------------------------------ reservations
    def drop_reservation(self, session: SessionKey) -> Reservation | None:
        """Release ``session``'s reservation (if any) and unpin its KV: the one way a
        reservation ends here. Its KV stays cached, evictable by value."""
        res = self.admission.release(session)
        if res is not None:
            self.kv.unpin(session)
        return res

    def release_model(self, model: str | None) -> None:
        """A slot closes: its sessions cannot be served until the model's next slot, so their
        reservations end; their KV stays cached and is demoted by value as room is needed.
        A TTL pin (Continuum's) lives out its TTL whatever the slots do."""
        if model is None:
            return
        for sid, res in list(self.admission.held.items()):
            if res.model == model and not res.hard:
                self.drop_reservation(sid)

    def offer(self, req: Request, history: TokenSeq, now: float) -> None:
        """``req`` just finished: value its session's KV as a likely return and offer a
        reservation, pinning the KV if the policy takes it."""
        call = req.call
        blocks = self.kv.session_device_blocks(call.session)
        try:
            p = self.admission.probability(now, now, None)
            offered = self.admission.offer(
                call.session,
                call.model,
                blocks,
                now,
                None,
                reload_s=self.estimates.reload_s(call.model, len(history)),
                program_s=req.program_s,
            )
        except Exception as exc:
            self.on_fault(call.session, exc)
            return
        self.kv.set_priority(call.session, p)
        if offered is not None:
            self.kv.pin(call.session)

    def hint(
        self, session: SessionKey, expected_s: float | None, now: float, tool: str | None = None
    ) -> None:
        """A client's tool-start hint for a session in a gap here: the gap's expected length
        (and the tool it named: Continuum's TTL is sized for it) re-value its KV and
        reservation."""
        gap = self.gaps.get(session)
        if gap is None:
            return
        self.gaps.set_expected(session, expected_s)
        if tool is not None:
            gap.tool = tool
            if self.admission.retime(session, tool, now) is not None:
                self.kv.unpin(session)  # retime already released it
        try:
            self.admission.update_hint(session, expected_s, now)
            p = self.admission.probability(gap.since_s, now, expected_s)
        except Exception as exc:
            self.on_fault(session, exc)
            return
        self.kv.set_priority(session, p)

    def expire(self, now: float) -> None:
        """Unpin expired reservations; their KV stays cached, valued by return probability."""
        adm = self.admission
        waiting: set[SessionKey] = set()
        if adm.continuum is not None and adm.due(now):
            waiting = {r.call.session for q in self.calls.waiting.values() for r in q}
        for res in adm.expire(now, waiting):
            self.kv.unpin(res.session)
            gap = self.gaps.get(res.session)
            if gap is not None:
                try:
                    p = adm.probability(gap.since_s, now, gap.expected_s)
                except Exception as exc:
                    self.on_fault(res.session, exc)
                    continue
                self.kv.set_priority(res.session, p)

    # ------------------------------------------------------------------ admission
    def admit(self, now: float) -> tuple[MovePlan, ...]:
        """Admit the open slot's waiting calls while they fit (see the module docstring).
        Returns the KV block moves the admitted calls need before the step."""
        model = self.rounds.current
        if model is None or not self.rounds.may_admit(model):
            return ()
        moves: list[MovePlan] = []
        if self.policy.queue_order is QueueOrder.PROGRAM_FCFS:
            self._program_order(model)
        self._tenant_order(model)
        queue = self.calls.waiting[model]
        kv = self.kv
        while queue and len(self.calls.running) < self.policy.max_running:
            req = queue[0]
            call = req.call
            self.drop_reservation(call.session)
            if kv.lent_blocks and not kv.can_allocate(
                model, call.tenant, call.prompt, req.target_output
            ):
                self.slots.cancel_stage()  # KV for a waiting call comes before staged weights
            if not kv.can_allocate(model, call.tenant, call.prompt, req.target_output):
                moves.extend(self._reclaim_for(req, now))
                if not self.calls.running and self.admission.continuum is not None:
                    moves.extend(self._release_stuck(req, now))
                if not kv.can_allocate(model, call.tenant, call.prompt, req.target_output):
                    break
            self.calls.pop_waiting(model)
            alloc = kv.allocate(call.key, model, call.tenant, call.prompt, req.target_output, now)
            self._admitted(req, alloc, now)
            moves.extend(m for m in (alloc.evicted.demoted, alloc.restore) if m.moves)
        self.rounds.end_opening_pass()
        return tuple(moves)

    def _program_order(self, model: str) -> None:
        """Continuum's program-level FCFS: waiting calls of sessions holding a pin first,
        then by their session's first arrival, then by their own."""
        held = self.admission.held
        self.calls.reorder(model, lambda r: (r.call.session not in held, r.program_s, r.queued_s))

    def _tenant_order(self, model: str) -> None:
        """Fair share between tenants (:func:`talaria.policy.tenant_share.fair_order`): the
        next call admitted is from the tenant with the fewest of ``model``'s calls in the batch;
        a tenant's own calls keep their order. A no-op when one tenant waits."""
        if self.calls.tenants_waiting(model) < 2:
            return
        queue = self.calls.waiting[model]
        running = collections.Counter(
            r.call.tenant for r in self.calls.running.values() if r.call.model == model
        )
        self.calls.replace_queue(model, fair_order(queue, lambda r: r.call.tenant, running))

    def _release_stuck(self, req: Request, now: float) -> list[MovePlan]:
        """Continuum: a waiting call cannot be admitted and nothing runs: release TTL pins,
        latest-started program first, until it fits (their KV is demoted or dropped)."""
        return self._demote_until_fits(req, self.admission.stuck_order([req.call.session]), now)

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
        if req.computed >= req.prompt_len:  # a guard: a KV match never holds the last token
            req.computed = req.prompt_len - 1
        req.sp_admitted = bool(slot and not slot.opening and req.queued_s > slot.opened_s)
        self.counters.sp_admissions += req.sp_admitted
        self.counters.kv_bytes_moved += alloc.restore.nbytes + alloc.evicted.demoted.nbytes
        self.calls.start(req)

    def _reclaim_for(self, req: Request, now: float) -> list[MovePlan]:
        """Release reservations (least valuable first) until ``req`` fits, if it waited long
        enough. Their KV is demoted to host, not dropped."""
        if not self.admission.should_reclaim(now - req.queued_s):
            return []
        order = self.admission.reclaim_order(now, exclude=[req.call.session])
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
