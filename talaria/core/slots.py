"""Slot control: switching an instance's active model, and staging the next one's weights.

``SlotControl`` carries out what the slot order (:mod:`talaria.policy.rounds`) decides: it
commits a switch in the weight arena and hands the executor the copy plan; it opens the new
model's slot when the copy is done; and while a slot runs it stages the predicted next
model's weights into free KV blocks lent for the purpose, keeping headroom for the open
slot's queue. Mutates the arena, the round scheduler's slot, the KV pool's lent blocks and
the instance's switch counters (``cold_loads`` counts the switches and stages that read a
model's weights from disk); reads the call table. The reservations of the slot a switch
ends are released through ``release_reservations`` (the admitter's, in
:mod:`talaria.core.admitter`).

Not thread-safe: the instance core's single driver owns it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import attrs

from talaria.config import ModelSpec, PolicyConfig
from talaria.core.calls import CallTable
from talaria.core.counters import InstanceCounters
from talaria.memory.kv import KVManager
from talaria.memory.kv.types import EvictionResult, KVHeld
from talaria.memory.weights import ArenaRefused, SwitchPlan, WeightArena
from talaria.policy.rounds import RoundScheduler, SlotDemand
from talaria.schedule import Schedule
from talaria.types import Link, Residency


@attrs.define(eq=False, kw_only=True)
class SlotControl:
    """Model switches and weight staging of one instance (see the module docstring)."""

    policy: PolicyConfig
    models: Mapping[str, ModelSpec]
    arena: WeightArena
    kv: KVManager
    rounds: RoundScheduler
    calls: CallTable
    counters: InstanceCounters
    release_reservations: Callable[[str | None], None]
    # seconds a switch that wakes the instance from zero waits for its devices
    provision_s: float = 0.0
    # the expected seconds of a switch plan (provisioning and copies: the estimator's price)
    price_s: Callable[[SwitchPlan], float] = lambda plan: 0.0
    # when the wake in progress (a switch that waited for devices) is expected to end
    waking_until_s: float | None = attrs.field(default=None, init=False)
    # device blocks lent to the current stage
    stage_blocks: tuple[int, ...] = attrs.field(default=(), init=False)
    # the instance holds no devices and no switch has woken it since: it scaled to zero
    # (``scale_to_zero``), or it belongs to a pool that scales to zero (a finite keep-alive)
    # and has not been used yet, so its first switch waits for its devices too
    released: bool = attrs.field(
        default=attrs.Factory(lambda self: self.policy.keep_alive_s < math.inf, takes_self=True),
        init=False,
    )

    def switch_to(self, model: str, now: float) -> Schedule:
        """Make ``model`` active: the open slot ends and the arena commits the switch (a
        staged copy is used, any other stage is abandoned); the returned schedule carries
        the copy plan (after ``provision_s`` where the switch wakes the instance from zero:
        then ``waking_until_s`` is when it is expected to end, ``now`` plus its price).
        While ``model`` is still being staged, the schedule says to wait."""
        arena = self.arena
        if arena.staging_in_progress == model:
            return Schedule(waiting_for_stage=True)
        staged = arena.staged_model == model
        if not staged:
            self.cancel_stage()
        self.release_reservations(self.rounds.current)
        plan = arena.switch(model)
        if self.released and self.provision_s > 0:
            plan = attrs.evolve(plan, provision_s=self.provision_s)
            self.waking_until_s = now + self.price_s(plan)
        self.rounds.end_slot()
        self.released = False
        self.counters.model_switches += 1
        self.counters.staged_switches += staged
        self.counters.weight_bytes_moved += plan.total_bytes
        self.counters.cold_loads += Link.DISK_TO_HOST in plan.bytes_by_link
        return Schedule(switch=plan)

    def switch_done(self, model: str, now: float) -> None:
        """The executor finished copying ``model``'s weights: its slot opens, and the KV
        blocks lent to staging (already copied from) go back to the pool."""
        self.waking_until_s = None
        self.kv.return_lent()
        self.stage_blocks = ()
        self.rounds.open(model, now)

    def stage_done(self, model: str) -> None:
        """The executor finished staging ``model`` (ignored if that stage was abandoned)."""
        if self.arena.staging_in_progress == model:
            self.arena.finish_stage(model)

    def maybe_stage(self, demand: Mapping[str, SlotDemand]) -> SwitchPlan | None:
        """Stage the predicted next model into free KV blocks lent for the purpose (all of
        it if they suffice, else a part), keeping headroom for the open slot's queue. No
        stage whose read from disk would drop the host copy of a model with work here."""
        arena = self.arena
        if self.released or not self.policy.weight_staging or arena.staging_in_progress is not None:
            return None  # a scaled-to-zero instance has no device to stage into
        nxt = self.rounds.predict_next(demand)
        if nxt is None or arena.staged_model == nxt:
            return None
        try:
            whole = arena.plan_stage(nxt)  # its host drops are those of any part of it
        except ArenaRefused:
            return None
        if arena.residency(nxt) in (Residency.ACTIVE, Residency.RESIDENT):
            return None
        want = self.models[nxt].weight_bytes
        blocks = min(math.ceil(want / self.kv.block_bytes), self.spare_blocks())
        nbytes = min(want, blocks * self.kv.block_bytes)
        if nbytes < self.policy.stage_min_share * want:
            return None
        if any(_has_work(demand.get(m)) for m in whole.host_drops):
            return None  # a guess is not worth a cold start of a model whose sessions are here
        self.cancel_stage()
        self.stage_blocks = self.kv.lend(blocks)
        plan = arena.start_stage(nxt, nbytes)
        self.counters.weight_bytes_moved += plan.total_bytes
        self.counters.cold_loads += Link.DISK_TO_HOST in plan.bytes_by_link
        return plan

    def spare_blocks(self) -> int:
        """Free device blocks not needed by the open slot's queue, less the headroom."""
        model = self.rounds.current
        queued = 0
        if model is not None:
            tpb = self.kv.tpb(model)
            queued = sum(
                math.ceil((r.prompt_len + r.target_output) / tpb) for r in self.calls.waiting[model]
            )
        headroom = math.ceil(self.policy.stage_headroom * self.kv.device_blocks)
        return max(0, self.kv.device_free - queued - headroom)

    def can_scale_to_zero(self) -> bool:
        """Whether no call and no pin holds a device block (a stage's loan may: it is
        abandoned)."""
        kv = self.kv
        return kv.device_free + kv.device_evictable + kv.lent_blocks == kv.device_blocks

    def scale_to_zero(self) -> EvictionResult:
        """Give the devices back: the stage is abandoned, the KV demoted to the host tier
        (``KVManager.vacate``: the returned moves run before the devices go), the open slot
        ends and the weights leave the device (``WeightArena.vacate``). The instance core
        checks that no call and no reservation holds the instance first. Raises ``KVHeld``
        (nothing changed) where ``can_scale_to_zero`` is False."""
        if not self.can_scale_to_zero():
            raise KVHeld("a call or a pin holds device blocks: the instance is not idle")
        self.cancel_stage()
        evicted = self.kv.vacate()
        self.rounds.end_slot()
        self.arena.vacate()
        self.released = True
        self.counters.scale_to_zero += 1
        return evicted

    def cancel_stage(self) -> None:
        """Abandon staging and give its lent blocks back to the KV pool."""
        self.arena.cancel_stage()
        self.kv.return_lent()
        self.stage_blocks = ()


def _has_work(demand: SlotDemand | None) -> bool:
    """Calls of the model wait or run here, or its sessions are in a tool gap after a call
    served here."""
    return demand is not None and bool(demand.waiting or demand.running or demand.in_gap)
