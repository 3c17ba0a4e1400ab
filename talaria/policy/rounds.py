"""The slot scheduler of an instance that time-slices models, with session-prefill (SP).

A *slot* is a window in which one model runs; a *round* visits every model with work.
Decisions only, no I/O: the instance core asks, on every scheduling step,

* ``may_admit(model)``: may a waiting call of ``model`` join the running batch now?
  With SP a continuation is admitted any time the model's slot is open and admitting;
  without SP (the paper's ``round`` baseline) admission closes after the slot's opening
  pass, so a call arriving later waits for the next round.
* ``close_if_due(...)``: marks the open slot closing (it stops admitting and, once its batch
  drains, gives way) when it is time; the only decision here that mutates.
* ``next_model(...)``: which model's slot opens next.
* ``predict_next(...)``: which model to stage while the current slot runs.

The order is the policy's ``SlotOrder``: round-robin with a quantum (``round`` and the
per-request baselines), the model of the oldest waiting call with a quantum (a serverless
per-request queue), or Talaria's session-aware order (``SHORTEST_REMAINING``): the slot goes
to the model whose sessions have the least expected remaining work per session (its
``SlotDemand.remaining_s``, estimated by the instance core from what it can know online, and
its switch, over the sessions they serve: Smith's rule, since a slot serves all of its model's
sessions at once; the whole remaining work would put a popular model last), stays open while
they keep returning (no quantum; an idle slot lingers while the soonest return is expected within a
switch away and back), gives way to another model only for a clear win
(``slot_preempt_ratio``), and never lets a waiting call wait more than ``slot_starvation_s``
for its slot: the open slot starts closing once a waiting call's wait plus the expected
drain of the running batch (``SlotDemand.drain_s``) and its model's switch would reach the
bound, and that model goes next (the most-starved first, oldest call first).

Mutates only its own slot state. Times are seconds on the caller's clock.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import attrs

from talaria.config import PolicyConfig, SlotOrder
from talaria.errors import ConfigError, UnknownModel


class SlotClose(enum.Enum):
    """Why a slot started closing (counted per instance: ``RoundScheduler.closes``)."""

    QUANTUM = "quantum"  # it ran ``slot_max_s`` while another model waited
    DRAINED = "drained"  # it had stopped admitting and its batch drained
    IDLE = "idle"  # nothing ran or waited, and none of its sessions was worth lingering for
    STARVED = "starved"  # another model's oldest call neared ``slot_starvation_s``
    PREEMPTED = "preempted"  # another model's remaining work was a clear win


@attrs.define
class Slot:
    model: str
    opened_s: float
    admitting: bool = True
    closing: bool = False  # admit nothing more, drain the batch (``closed_for`` says why)
    closed_for: SlotClose | None = None
    opening: bool = True  # its first admission pass has not run yet
    starved: str | None = None  # the model this slot closes for: its call neared the bound


@attrs.frozen
class SlotDemand:
    """What the instance core knows about one model's work, for slot decisions."""

    waiting: int = 0  # calls queued for the model
    oldest_wait_s: float = 0.0  # how long the oldest of them has waited
    running: int = 0  # calls of the model in the running batch
    expected_back_s: float | None = None  # soonest expected return of one of its sessions
    returning: int = 0  # its sessions expected back within the linger window
    in_gap: int = 0  # its sessions in a tool gap after a call served here
    remaining_s: float = 0.0  # expected device seconds its sessions still need (estimate)
    sessions: int = 0  # the sessions ``remaining_s`` counts
    switch_s: float = 0.0  # seconds to make the model active from its residency now
    reload_s: float = 0.0  # seconds to bring it back from host once switched away
    drain_s: float = 0.0  # expected seconds until its running calls finish (open slot only)

    @property
    def work_per_session_s(self) -> float:
        """``remaining_s`` per session it counts."""
        return self.remaining_s / max(1, self.sessions)

    @property
    def slot_per_session_s(self) -> float:
        """The session-aware order's key: device seconds a slot of the model would take (its
        remaining work and its switch) per session it serves. Smith's rule: a slot serves
        all of its model's sessions, so the slot that serves the most sessions per second
        goes first (ordering by the whole remaining work puts a popular model last)."""
        return (self.remaining_s + self.switch_s) / max(1, self.sessions)


IDLE = SlotDemand()  # a model with no work: what a model missing from a demand map means


class RoundScheduler:
    """Slot state of one instance. Not thread-safe: the instance core owns it."""

    def __init__(self, models: Sequence[str], policy: PolicyConfig) -> None:
        if not models:
            raise ConfigError("a round scheduler needs at least one model")
        self.models = tuple(models)
        self._position: dict[str, int] = {}
        for i, m in enumerate(self.models):
            self._position.setdefault(m, i)
        self.policy = policy
        self.slot: Slot | None = None
        self._last_index = -1
        self.slots_opened = 0
        self.closes: Counter[SlotClose] = Counter()  # slots that started closing, by reason

    @property
    def current(self) -> str | None:
        return self.slot.model if self.slot else None

    @property
    def state(self) -> tuple[str | None, bool, bool, int]:
        """What every slot-wait estimate reads (the open slot's model, whether it admits,
        whether it is closing, the ring position): equal states give equal estimates, so it
        keys their memos."""
        slot = self.slot
        if slot is None:
            return None, False, False, self._last_index
        return slot.model, slot.admitting, slot.closing, self._last_index

    def position(self, model: str) -> int:
        """``model``'s place in the ring (the instance's model order)."""
        try:
            return self._position[model]
        except KeyError:
            raise UnknownModel(f"model {model!r} is not served by this instance") from None

    def open(self, model: str, now: float) -> Slot:
        """Open ``model``'s slot (its weights are active from now)."""
        self._last_index = self.position(model)
        self.slot = Slot(model, now)
        self.slots_opened += 1
        return self.slot

    def end_slot(self) -> None:
        """The open slot ended (its model is being switched away): none is open until
        ``open``."""
        self.slot = None

    def may_admit(self, model: str) -> bool:
        slot = self.slot
        return slot is not None and slot.model == model and slot.admitting and not slot.closing

    def end_opening_pass(self) -> None:
        """Called after each admission pass: after a slot's first, without SP, admission
        closes. Later calls change nothing."""
        slot = self.slot
        if slot is None or not slot.opening:
            return
        slot.opening = False
        if not self.policy.session_prefill:
            slot.admitting = False

    def close_if_due(self, now: float, demand: Mapping[str, SlotDemand]) -> bool:
        """Mark the open slot closing if it should stop admitting now (a mutation: the
        decision sticks until the next slot opens, and its reason is counted once in
        ``closes``), and return whether it should: True also when no slot is open; False
        while nobody else needs the device."""
        slot = self.slot
        if slot is None:
            return True
        why = self._close_reason(now, demand, slot)  # still run once closing: it may
        if why is not None and not slot.closing:  # move ``starved`` to a hungrier model
            slot.closing, slot.closed_for = True, why
            self.closes[why] += 1
        return slot.closing

    def _close_reason(
        self, now: float, demand: Mapping[str, SlotDemand], slot: Slot
    ) -> SlotClose | None:
        """Why the open slot should start closing now, None if it should not. Sets only
        ``slot.starved``."""
        order = self.policy.slot_order
        if order is SlotOrder.SHORTEST_REMAINING:
            return self._session_aware_close(demand, slot)
        if order is not SlotOrder.ROUND_ROBIN and order is not SlotOrder.OLDEST_WAITING:
            raise ConfigError(f"unknown slot order {order!r}")
        mine = demand.get(slot.model, IDLE)
        if not slot.admitting and mine.running == 0 and mine.waiting:
            # the slot stopped admitting and drained: end the round even if no other model
            # waits, so the next one reopens this model for the calls that arrived meanwhile
            return SlotClose.DRAINED
        others_wait = any(d.waiting for m, d in demand.items() if m != slot.model)
        if not others_wait:
            return None  # nobody else needs the device: keep the model (no switch cost)
        if now - slot.opened_s >= self.policy.slot_max_s:
            return SlotClose.QUANTUM
        if not slot.admitting and mine.running == 0:
            return SlotClose.DRAINED
        if (
            slot.admitting
            and mine.running == 0
            and mine.waiting == 0
            and not self._linger(mine, demand)
        ):
            return SlotClose.IDLE
        return None

    def _linger(self, mine: SlotDemand, demand: Mapping[str, SlotDemand]) -> bool:
        """Keep an idle slot open for sessions about to return? Only while the wait imposed on
        the other models' queued calls (``back`` seconds each) stays within what the
        returning sessions save (a round trip, counted as ``slot_linger_s`` each)."""
        back = mine.expected_back_s
        linger = self.policy.slot_linger_s
        if back is None or back > linger:
            return False
        queued = sum(d.waiting for m, d in demand.items() if self.slot and m != self.slot.model)
        return back * queued <= linger * max(1, mine.returning)

    def _session_aware_close(
        self, demand: Mapping[str, SlotDemand], slot: Slot
    ) -> SlotClose | None:
        """``SHORTEST_REMAINING``'s close rule (see the module docstring); sets only
        ``slot.starved``."""
        mine = demand.get(slot.model, IDLE)
        others = {m: d for m, d in demand.items() if m != slot.model and d.waiting}
        if not others:
            # nobody else needs the device: keep the model (no switch cost); without SP,
            # end the drained slot so that it reopens for the calls that arrived meanwhile
            drained = not slot.admitting and mine.running == 0 and bool(mine.waiting)
            return SlotClose.DRAINED if drained else None
        if slot.opening:
            # a fresh slot admits once before it may give way: otherwise two starving models
            # close each other's slots as they open, and nothing is ever served
            return None
        starving = self._starving(others, others, mine.drain_s)
        if starving is not None:
            slot.starved = starving
            return SlotClose.STARVED
        if not slot.admitting and mine.running == 0:
            return SlotClose.DRAINED
        best = min(others.values(), key=lambda d: d.slot_per_session_s)  # as next_model
        if mine.work_per_session_s > self.policy.slot_preempt_ratio * best.slot_per_session_s:
            return SlotClose.PREEMPTED
        if mine.running or mine.waiting:
            return None
        back = mine.expected_back_s
        return SlotClose.IDLE if back is None or back > best.switch_s + mine.reload_s else None

    def _starving(
        self, models: Iterable[str], demand: Mapping[str, SlotDemand], drain_s: float
    ) -> str | None:
        """Of ``models``, the one whose oldest call would wait ``slot_starvation_s`` by the
        time the device could be its (``drain_s`` for the open batch, then its switch): the
        one whose call has waited longest; None when no call is that close to the bound."""
        bound = self.policy.slot_starvation_s
        late = [
            m for m in models if demand[m].oldest_wait_s + drain_s + demand[m].switch_s >= bound
        ]
        return max(late, key=lambda m: demand[m].oldest_wait_s) if late else None

    def _in_ring_order(self, models: Iterable[str]) -> list[str]:
        """Those of ``models`` this scheduler serves, in round-robin order after the current
        one's index (a demand map names only the models with work: sorting them is cheaper
        than walking every model)."""
        position, n, last = self._position, len(self.models), self._last_index
        return sorted(
            (m for m in models if m in position), key=lambda m: (position[m] - last - 1) % n
        )

    def next_model(self, demand: Mapping[str, SlotDemand]) -> str | None:
        """The model whose slot opens next, among those with waiting work (see
        ``SlotOrder``); None when no model has waiting work. Ties go round-robin."""
        waiting = self._in_ring_order(m for m, d in demand.items() if d.waiting)
        if not waiting:
            return None
        order = self.policy.slot_order
        if order is SlotOrder.ROUND_ROBIN:
            return waiting[0]
        if order is SlotOrder.OLDEST_WAITING:
            return max(waiting, key=lambda m: demand[m].oldest_wait_s)
        if order is SlotOrder.SHORTEST_REMAINING:
            slot = self.slot
            if slot is not None and slot.starved in waiting:
                return slot.starved  # the slot closed for it
            starving = self._starving(waiting, demand, 0.0)
            if starving is not None:
                return starving
            return min(waiting, key=lambda m: demand[m].slot_per_session_s)
        raise ConfigError(f"unknown slot order {order!r}")

    def predict_next(self, demand: Mapping[str, SlotDemand]) -> str | None:
        """The model most likely to get the next slot: the one ``next_model`` would pick
        among the other models with waiting work, else the next with sessions in a tool gap
        (they will be back; with ``SHORTEST_REMAINING``, the least remaining work per session
        first)."""
        current = self.current
        others = {m: d for m, d in demand.items() if m != current}
        pick = self.next_model(others)
        if pick is not None:
            return pick
        gapped = self._in_ring_order(m for m, d in demand.items() if m != current and d.in_gap)
        if not gapped:
            return None
        if self.policy.slot_order is SlotOrder.SHORTEST_REMAINING:
            return min(gapped, key=lambda m: demand[m].work_per_session_s)
        return gapped[0]

    def models_ahead(self, model: str) -> tuple[str, ...]:
        """Models whose slots come before ``model``'s next slot in round-robin order."""
        target = self.position(model)
        n = len(self.models)
        ahead = []
        for step in range(1, n + 1):
            idx = (self._last_index + step) % n
            if idx == target:
                break
            ahead.append(self.models[idx])
        return tuple(ahead)
