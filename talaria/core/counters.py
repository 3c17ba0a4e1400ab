"""What instances have done: their counters, and the one roll-up every report uses.

``InstanceCounters`` is mutated only by the instance core's roles (slot control, admission,
completion); the KV manager and the reservations policy keep counters of their own.
``instance_counters`` flattens them into one mapping (KV counters prefixed ``kv_``, the slot
scheduler's closes by reason ``slot_closes_``) and ``cluster_counters`` sums it over a
cluster's instances: the simulator's and the live replay's results and the API's
``stats()`` all read these, so a counter added in one place shows in all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import attrs

from talaria.memory.kv import KVManager
from talaria.policy.admission import Admission
from talaria.policy.rounds import RoundScheduler, SlotClose


@attrs.define
class InstanceCounters:
    """What one instance has done since it started."""

    model_switches: int = 0
    staged_switches: int = 0
    weight_bytes_moved: int = 0
    kv_bytes_moved: int = 0
    sp_admissions: int = 0
    reclaims: int = 0
    calls_finished: int = 0
    calls_failed: int = 0
    policy_faults: int = 0  # sessions whose gap reasoning raised (isolated, see InstanceCore)
    cold_loads: int = 0  # switches and stages that read a model's weights from disk
    scale_to_zero: int = 0  # times the instance gave its devices back (keep-alive ran out)


class Counted(Protocol):
    """An instance core, as far as its counters go."""

    @property
    def counters(self) -> InstanceCounters: ...

    @property
    def kv(self) -> KVManager: ...

    @property
    def admission(self) -> Admission: ...

    @property
    def rounds(self) -> RoundScheduler: ...


def instance_counters(inst: Counted) -> dict[str, int]:
    """One instance's counters: its own, its KV manager's (prefixed ``kv_``), the
    reservations it made and its slots' closes by reason (``slot_closes_<reason>``)."""
    out = {k: int(v) for k, v in attrs.asdict(inst.counters).items()}
    out |= {f"kv_{k}": int(v) for k, v in attrs.asdict(inst.kv.counters).items()}
    out["reservations_made"] = inst.admission.reservations_made
    out |= {f"slot_closes_{why.value}": inst.rounds.closes[why] for why in SlotClose}
    return out


def cluster_counters(instances: Iterable[Counted], kv_moved: int) -> dict[str, int]:
    """Every instance's ``instance_counters`` summed, with ``kv_bytes_moved`` replaced by
    ``kv_moved``: the bytes the executor really moved (the counters count what was
    planned)."""
    out: dict[str, int] = {}
    for inst in instances:
        for k, v in instance_counters(inst).items():
            out[k] = out.get(k, 0) + v
    out["kv_bytes_moved"] = kv_moved
    return out
