"""The slot scheduler of an instance that time-slices models, with session-prefill (SP).

A *slot* is a window in which one model runs; a *round* visits every model with work.
Decisions only, no I/O: the instance core asks, on every scheduling step,

* ``may_admit(model)``: may a waiting call of ``model`` join the running batch now?
  With SP a continuation is admitted any time the model's slot is open and admitting;
  without SP (the paper's ``round`` baseline) admission closes after the slot's opening
  pass, so a call arriving later waits for the next round.
* ``should_close(...)``: is it time to stop admitting (and, once the batch drains, switch)?
* ``next_model(...)``: which model's slot opens next (round-robin among models with work).
* ``predict_next(...)``: which model to stage while the current slot runs.

Mutates only its own slot state. Times are seconds on the caller's clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from talaria.config import PolicyConfig
from talaria.errors import ConfigError, UnknownModel


@attrs.define
class Slot:
    model: str
    opened_s: float
    admitting: bool = True
    closing: bool = False  # quantum spent: admit nothing more, drain the batch


@attrs.frozen
class SlotDemand:
    """What the instance core knows about one model's work, for slot decisions."""

    waiting: int = 0  # calls queued for the model
    oldest_wait_s: float = 0.0  # how long the oldest of them has waited
    running: int = 0  # calls of the model in the running batch
    expected_back_s: float | None = None  # soonest expected return of one of its sessions
    returning: int = 0  # its sessions expected back within the linger window
    in_gap: int = 0  # its sessions in a tool gap after a call served here


class RoundScheduler:
    """Slot state of one instance. Not thread-safe: the instance core owns it."""

    def __init__(self, models: Sequence[str], policy: PolicyConfig) -> None:
        if not models:
            raise ConfigError("a round scheduler needs at least one model")
        self.models = tuple(models)
        self.policy = policy
        self.slot: Slot | None = None
        self._last_index = -1
        self.slots_opened = 0

    @property
    def current(self) -> str | None:
        return self.slot.model if self.slot else None

    def _index(self, model: str) -> int:
        try:
            return self.models.index(model)
        except ValueError:
            raise UnknownModel(f"model {model!r} is not served by this instance") from None

    def open(self, model: str, now: float) -> Slot:
        """Open ``model``'s slot (its weights are active from now)."""
        self._last_index = self._index(model)
        self.slot = Slot(model, now)
        self.slots_opened += 1
        return self.slot

    def may_admit(self, model: str) -> bool:
        slot = self.slot
        return slot is not None and slot.model == model and slot.admitting and not slot.closing

    def end_opening_pass(self) -> None:
        """Called after the first admission pass of a slot: without SP, admission closes."""
        if self.slot is not None and not self.policy.session_prefill:
            self.slot.admitting = False

    def should_close(self, now: float, demand: Mapping[str, SlotDemand]) -> bool:
        """Whether the open slot should stop (marks it closing). True also when no slot."""
        slot = self.slot
        if slot is None:
            return True
        mine = demand.get(slot.model, SlotDemand())
        if not slot.admitting and mine.running == 0 and mine.waiting:
            # the slot stopped admitting and drained: end the round even if no other model
            # waits, so the next one reopens this model for the calls that arrived meanwhile
            slot.closing = True
            return True
        others_wait = any(d.waiting for m, d in demand.items() if m != slot.model)
        if not others_wait:
            return False  # nobody else needs the device: keep the model (no switch cost)
        if now - slot.opened_s >= self.policy.slot_max_s:
            slot.closing = True
        if not slot.admitting and mine.running == 0:
            slot.closing = True
        if (
            slot.admitting
            and mine.running == 0
            and mine.waiting == 0
            and not self._linger(mine, demand)
        ):
            slot.closing = True
        return slot.closing

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

    def next_model(self, demand: Mapping[str, SlotDemand]) -> str | None:
        """The next model with waiting work, round-robin after the current one."""
        n = len(self.models)
        for step in range(1, n + 1):
            model = self.models[(self._last_index + step) % n]
            if demand.get(model, SlotDemand()).waiting:
                return model
        return None

    def predict_next(self, demand: Mapping[str, SlotDemand]) -> str | None:
        """The model most likely to get the next slot: the next in round-robin order with
        waiting work, else the next with sessions in a tool gap (they will be back)."""
        current = self.current
        n = len(self.models)
        order = [self.models[(self._last_index + k) % n] for k in range(1, n + 1)]
        order = [m for m in order if m != current]
        for m in order:
            if demand.get(m, SlotDemand()).waiting:
                return m
        for m in order:
            if demand.get(m, SlotDemand()).in_gap:
                return m
        return None

    def models_ahead(self, model: str) -> tuple[str, ...]:
        """Models whose slots come before ``model``'s next slot in round-robin order."""
        target = self._index(model)
        n = len(self.models)
        ahead = []
        for step in range(1, n + 1):
            idx = (self._last_index + step) % n
            if idx == target:
                break
            ahead.append(self.models[idx])
        return tuple(ahead)
