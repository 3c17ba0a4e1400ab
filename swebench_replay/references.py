"""Schedule references: yardsticks beside the policies, never ranked as policies.

* ``isolated``: each session alone on the whole server (its SCT with nobody to share with:
  the floor no schedule of the shared server can beat for that session).
* ``model-serial``: each model's sessions served alone to completion (one group at a time,
  Talaria's mechanisms inside a group), the groups in order of their makespan, shortest
  first, each group's run starting with its model's switch. A session's SCT is its SCT in
  its group's run plus the makespans of the groups before it. It needs nothing but
  session-level knowledge of each model's total work, and it is what a slot order that
  finishes one model's sessions before opening the next approaches. With arrivals spread in
  time it is an approximation (a group's run keeps its sessions' own start times, shifted).

Both run in the same simulator on the same cluster as the policies (the cost model prices
them alike). Their ``results.json`` entries carry ``"reference": true``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from talaria.errors import BadRequest
from talaria.sim.simulator import CallRecord, SessionRecord, SimResult
from talaria.swebench_replay.metrics import policy_summary
from talaria.types import SessionScript

REFERENCES = ("isolated", "model-serial")

Simulate = Callable[[Sequence[SessionScript]], SimResult]


def _shifted(result: SimResult, offset_s: float) -> SimResult:
    """``result`` as if it had started ``offset_s`` later, its sessions still counted from
    their own start (their first call waits the offset)."""
    first: dict[str, int] = {}
    for c in result.calls:
        if c.session_id not in first or c.index < first[c.session_id]:
            first[c.session_id] = c.index

    def shift(c: CallRecord) -> CallRecord:
        arrival = c.arrival_s if first[c.session_id] == c.index else c.arrival_s + offset_s
        return attrs.evolve(
            c,
            arrival_s=arrival,
            admitted_s=c.admitted_s + offset_s,
            first_token_s=c.first_token_s + offset_s,
            finish_s=c.finish_s + offset_s,
        )

    sessions = tuple(attrs.evolve(s, end_s=s.end_s + offset_s) for s in result.sessions)
    calls = tuple(shift(c) for c in result.calls)
    return SimResult(result.policy, calls, sessions, result.counters, result.end_s + offset_s)


def _merged(name: str, parts: Sequence[SimResult]) -> SimResult:
    counters: dict[str, int] = {}
    for p in parts:
        for k, v in p.counters.items():
            counters[k] = counters.get(k, 0) + v
    calls = tuple(c for p in parts for c in p.calls)
    sessions: tuple[SessionRecord, ...] = tuple(s for p in parts for s in p.sessions)
    end = max((p.end_s for p in parts), default=0.0)
    return SimResult(name, calls, sessions, counters, end)


def isolated(scripts: Sequence[SessionScript], simulate: Simulate) -> SimResult:
    """Each session alone on the server, from its own start time."""
    return _merged("isolated", [simulate([s]) for s in scripts])


def model_serial(
    scripts: Sequence[SessionScript], simulate: Simulate, order: Sequence[str] | None = None
) -> SimResult:
    """Each model's sessions alone to completion, shortest group first (see module doc), or
    in ``order`` (every model of ``scripts`` once; a ``BadRequest`` otherwise)."""
    groups: dict[str, list[SessionScript]] = {}
    for s in scripts:
        groups.setdefault(s.model, []).append(s)
    if order is not None and sorted(order) != sorted(groups):
        raise BadRequest(
            f"a group order must name every model of the workload once: got {list(order)}, "
            f"the workload's models are {sorted(groups)}"
        )
    runs = []
    for model, group in groups.items():
        res = simulate(group)
        start = min(s.start_s for s in group)
        runs.append((res.end_s - start, model, res))
    if order is None:
        runs.sort(key=lambda r: (r[0], r[1]))
    else:
        runs.sort(key=lambda r: list(order).index(r[1]))
    parts, offset = [], 0.0
    for makespan, _, res in runs:
        parts.append(_shifted(res, offset))
        offset += makespan
    return _merged("model-serial", parts)


def reference_entries(
    scripts: Sequence[SessionScript], simulate: Simulate, policy_name: str
) -> dict[str, dict[str, Any]]:
    """Both references' ``results.json`` entries; ``simulate`` runs a part of the scripts
    alone (under the policy ``policy_name``, which runs inside each group)."""
    out = {}
    for name, result in (
        ("isolated", isolated(scripts, simulate)),
        ("model-serial", model_serial(scripts, simulate)),
    ):
        entry = policy_summary(result)
        entry["reference"] = True
        entry["reference_policy"] = policy_name
        out[name] = entry
    return out


def add_bound_ratios(policies: Mapping[str, dict[str, Any]]) -> None:
    """Each policy's SCT over each reference's (``sct_p50_over_model-serial``, ...: 1.0 is
    at the bound, above is that many times slower), when the references are present."""
    for ref in REFERENCES:
        bound = policies.get(ref)
        if bound is None:
            continue
        for entry in policies.values():
            for key in ("p50", "p95"):
                b = bound[f"sct_{key}_s"]
                entry[f"sct_{key}_over_{ref}"] = entry[f"sct_{key}_s"] / b if b else 0.0
