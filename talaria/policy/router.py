"""The router: rank placements for a call in one unit, expected seconds to completion.

For each instance that may serve the call, the expected completion time is

    slot_wait + switch + kv_prep + queue + service

* ``slot_wait``: until the model's slot admits on that instance (0 if admitting now; under
  the session-aware slot order, the hold of another model's open slot);
* ``switch``: weight switch or staging cost when the model is not active there (on an
  instance at zero, after its devices are provisioned: ``wake``);
* ``kv_prep``: restore what is on host (``restore_tokens / restore_tok_s``) plus recompute
  what the session had computed before but is gone there (``recompute_tokens / prefill_tok_s``);
* ``queue``: work queued ahead of the call for that model;
* ``service``: prefill of the new tokens plus the expected answer at the current batch's
  decode step time.

Model residency, KV locality and instance pressure all land in that one number; the
breakdown is returned so decisions can be explained and tested. One part of it is paid once
for the rest of the session rather than per call: the wake of an instance at zero (its
devices provisioned) buys an instance the session keeps, while a slot wait or a shared
model's switch recurs on its later calls. So ``EXPECTED_COMPLETION`` ranks by the call's
*charge* (``Estimate.charge_s``): the estimate with the wake shared over the session's
expected calls left (``calls_left``, learned from ended sessions), where the policy says so
(``PolicyConfig.wake_shared``); the estimate itself stays the call's expected completion.
A wake also commits devices the pool pays for: ``PolicyConfig.wake_charge_s`` adds that
price, in seconds of latency, to the charge of a call that would wake an instance (0, the
default: latency alone decides), and ``PolicyConfig.pack_slack`` sends a call to an
instance where its model already has calls in flight when that instance's charge is within
the slack of the least (``packed``: such an instance is ranked by its charge discounted by
``1 + pack_slack``, ``pack_key``; the call joins its model's batch instead of starting the
model elsewhere): the knobs that trade a call's latency for device-seconds.
The baselines rank differently (``Routing``) but report the same breakdown.

``search`` is where a call's instance is chosen: with expected-completion routing it ranks
the candidates by a lower bound of their estimate (each candidate's estimate of an optimistic
view, so the bound cannot exceed the exact estimate) and computes exact estimates in that
order until the next (bound, name) is not below the best (estimate, name), both discounted
alike where a pack slack applies (``pack_key``, so the bound stays below): ties go by name,
so a tie is viewed only when its name is earlier; ``route`` ranks the views. Before a
candidate is viewed its bound is tightened once (``prefill_bound_s``: plus the whole prompt's
prefill where none of its prefix is cached) and it goes back in line if that moved it: on the
instances that never saw the session and hold no other model's slot the tightened bound is
as good as exact, so a call needs a few exact views however many instances serve its model
(the bound leaves out that hold, which reads the sessions in a tool gap at the call's time).

Pure: plain data in, plain data out (``search`` reads its candidates, never mutates them).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Protocol

import attrs

from talaria.config import PolicyConfig, Routing
from talaria.errors import ConfigError, Overloaded
from talaria.memory.kv import PrefixMatch
from talaria.types import Call, Residency


@attrs.frozen
class InstanceView:
    """What one instance reports about a prospective call (a snapshot, in seconds/tokens)."""

    name: str
    residency: Residency
    slot_wait_s: float
    switch_s: float
    queue_s: float
    match: PrefixMatch
    prefill_tok_s: float
    restore_tok_s: float
    decode_step_s: float
    load_tokens: int = 0  # tokens queued and running (the load-only view)
    served_last: bool = False  # this instance served the session's previous call
    wake_s: float = 0.0  # of switch_s: the wait for the devices of an instance at zero
    model_calls: int = 0  # calls of the call's model queued or running here
    other_calls: int = 0  # calls of every other model queued or running here


@attrs.frozen
class Estimate:
    instance: str
    slot_wait_s: float
    switch_s: float
    kv_prep_s: float
    queue_s: float
    service_s: float
    reused_tokens: int
    restore_tokens: int
    recompute_tokens: int
    new_tokens: int
    wake_s: float = 0.0  # of switch_s: provisioning an instance at zero

    @property
    def total_s(self) -> float:
        return self.slot_wait_s + self.switch_s + self.kv_prep_s + self.queue_s + self.service_s

    def charge_s(self, calls_left: float, wake_charge_s: float = 0.0) -> float:
        """``total_s`` with the wake shared over ``calls_left`` calls (>= 1; this one
        included): what the call is charged when the session keeps the woken instance; plus
        ``wake_charge_s`` where the call wakes an instance at zero (the pool's price of
        provisioning devices, in seconds of latency; 0: none)."""
        later = later_share_s(self.wake_s, calls_left)
        charge = self.total_s - later if later else self.total_s
        return charge + wake_charge_s if self.wake_s else charge


def later_share_s(wake_s: float, calls_left: float) -> float:
    """Of a wake of ``wake_s`` shared over ``calls_left`` calls (this one included), the
    part the later calls pay: 0 with no wake or no later call."""
    if wake_s == 0.0 or calls_left <= 1.0:
        return 0.0
    return wake_s * (1.0 - 1.0 / calls_left)


@attrs.frozen
class Decision:
    instance: str
    estimates: tuple[Estimate, ...]
    routing: Routing

    @property
    def chosen(self) -> Estimate:
        return next(e for e in self.estimates if e.instance == self.instance)


def estimate(view: InstanceView, known_tokens: int, expected_output: int) -> Estimate:
    """The expected-completion breakdown of a call on one instance.

    ``known_tokens`` is how much of the prompt the session had computed before (its previous
    history); gone tokens within it count as recompute, the rest of the prompt as new.
    """
    m = view.match
    have = m.device_tokens + m.host_tokens
    recompute = max(0, min(known_tokens, m.total_tokens) - have)
    new = m.total_tokens - have - recompute
    kv_prep = m.host_tokens / view.restore_tok_s + recompute / view.prefill_tok_s
    service = new / view.prefill_tok_s + expected_output * view.decode_step_s
    return Estimate(
        view.name,
        view.slot_wait_s,
        view.switch_s,
        kv_prep,
        view.queue_s,
        service,
        m.device_tokens,
        m.host_tokens,
        recompute,
        new,
        view.wake_s,
    )


def route(
    views: Sequence[InstanceView],
    routing: Routing,
    known_tokens: int,
    expected_output: int,
    load_cap: float = 2.0,
    load_abs_tokens: int = 8192,
    calls_left: float = 1.0,
    concurrency_target: int = 2,
    wake_charge_s: float = 0.0,
    pack_slack: float = 0.0,
) -> Decision:
    """Pick an instance. Ties break by name so decisions are deterministic.

    ``EXPECTED_COMPLETION`` takes the minimum charge (the estimate with a wake shared over
    ``calls_left`` calls, 1: the estimate; plus ``wake_charge_s`` for a wake; within
    ``pack_slack``, :func:`packed`); ``LEAST_LOADED`` the fewest tokens queued and running;
    ``STICKY`` the instance that served the session last, else least loaded; ``CACHE_AFFINITY``
    the longest device prefix unless that instance's load exceeds ``load_cap`` times the
    lightest load *and* the lightest load by ``load_abs_tokens`` (SGLang router's relative and
    absolute balance thresholds; then least loaded); ``STARTUP_TIME`` the least time until the
    call can start there, its slot wait, model load and queue (ServerlessLLM's locality-aware
    placement by estimated startup time; the KV and the answer do not count), ties to the less
    loaded; ``CONCURRENCY_TARGET`` as a serverless autoscaler (:func:`scale_by_concurrency`).
    """
    if not views:
        raise Overloaded("no instance can serve this model now")
    ests = tuple(estimate(v, known_tokens, expected_output) for v in views)

    def least_loaded() -> str:
        return min(views, key=lambda v: (v.load_tokens, v.name)).name

    if routing is Routing.EXPECTED_COMPLETION:
        chosen = packed(views, ests, calls_left, wake_charge_s, pack_slack)
    elif routing is Routing.LEAST_LOADED:
        chosen = least_loaded()
    elif routing is Routing.STICKY:
        last = [v.name for v in views if v.served_last]
        chosen = last[0] if last else least_loaded()
    elif routing is Routing.CACHE_AFFINITY:
        best = min(views, key=lambda v: (-v.match.device_tokens, v.load_tokens, v.name))
        floor = min(v.load_tokens for v in views)
        over = best.load_tokens > load_cap * floor and best.load_tokens - floor > load_abs_tokens
        chosen = least_loaded() if over or best.match.device_tokens == 0 else best.name
    elif routing is Routing.STARTUP_TIME:
        chosen = soonest_start(views)
    elif routing is Routing.CONCURRENCY_TARGET:
        chosen = scale_by_concurrency(views, concurrency_target)
    else:
        raise ConfigError(f"unknown routing {routing!r}")
    return Decision(chosen, ests, routing)


def packed(
    views: Sequence[InstanceView],
    ests: Sequence[Estimate],
    calls_left: float,
    wake_charge_s: float,
    pack_slack: float,
) -> str:
    """Expected-completion's choice: the least (``pack_key`` of the charge, name). With no
    slack that is the least charge; with ``pack_slack`` > 0 it is the least charge among the
    instances holding calls of the call's model where one is within ``1 + pack_slack`` times
    the least (the call joins its model's batch there rather than start the model on another
    instance; its charge rises by at most that factor), else the least charge."""
    keys = [
        (pack_key(e.charge_s(calls_left, wake_charge_s), v.model_calls > 0, pack_slack), v.name)
        for e, v in zip(ests, views, strict=True)
    ]
    return min(keys)[1]


def pack_key(charge_s: float, joins: bool, pack_slack: float) -> float:
    """What expected-completion ranks an instance by: the call's charge there, divided by
    ``1 + pack_slack`` where the call ``joins`` its model's batch (the instance holds calls of
    its model). A join thus wins over any instance at most that factor cheaper. Division keeps
    the order of charges, so a lower bound of a charge gives a lower bound of its key."""
    return charge_s / (1.0 + pack_slack) if joins and pack_slack else charge_s


def soonest_start(views: Sequence[InstanceView]) -> str:
    """The instance where the call can start soonest: its slot wait, model load and queue
    (ServerlessLLM's estimated startup time), ties to the less loaded, then by name."""
    return min(
        views, key=lambda v: (v.slot_wait_s + v.switch_s + v.queue_s, v.load_tokens, v.name)
    ).name


def scale_by_concurrency(views: Sequence[InstanceView], target: int) -> str:
    """A serverless autoscaler's choice, per request: ServerlessLLM's deployment config
    (``auto_scaling_config``: metric ``concurrency``, a ``target``, min 0 instances, at most
    the pool) and its scaling rule, desired instances = ceil(calls in flight / target).

    The model's instances are those holding its calls, and those where it is loaded with no
    other model's call (an idle replica kept alive). With this call in flight, if they reach
    the desired count the call goes to the one holding the fewest of the model's calls (then
    the fewest tokens, then by name; ServerlessLLM balances round-robin). Otherwise the model
    scales out: to the free instance (no call of any model) where the call starts soonest
    (``soonest_start``: its weights' tier, then warm before at zero), as ServerlessLLM's
    storage-aware placement picks a server. With no free instance the call queues on the
    model's least-loaded instance, and with none of those it shares one with another model
    (the soonest start; that instance's slot order decides). Every instance is free once idle,
    whatever model it keeps loaded (the pool's keep-alive keeps weights until another model
    needs the devices), where ServerlessLLM would hold an idle replica for its keep-alive.
    """
    if target < 1:
        raise ConfigError(f"the concurrency target must be at least 1 call, got {target}")
    in_flight = sum(v.model_calls for v in views) + 1  # this call included
    mine = [
        v
        for v in views
        if v.model_calls or (v.residency is Residency.ACTIVE and not v.other_calls and not v.wake_s)
    ]
    free = [v for v in views if not v.model_calls and not v.other_calls]
    if mine and (len(mine) >= -(-in_flight // target) or not free):
        return min(mine, key=lambda v: (v.model_calls, v.load_tokens, v.name)).name
    return soonest_start(free or views)


class Candidate(Protocol):
    """An instance as ``search`` sees it (``talaria.core.estimates.InstanceEstimates``)."""

    @property
    def name(self) -> str: ...

    def bound_s(
        self,
        model: str,
        expected_output: int,
        calls_left: float = 1.0,
        wake_charge_s: float = 0.0,
        pack_slack: float = 0.0,
    ) -> float:
        """At most the key (``pack_key`` of ``Estimate.charge_s(calls_left, wake_charge_s)``,
        discounted where the call would join its model's calls here) of any call of
        ``model`` with that answer length here."""
        ...

    def prefill_bound_s(
        self,
        call: Call,
        expected_output: int,
        calls_left: float = 1.0,
        wake_charge_s: float = 0.0,
        pack_slack: float = 0.0,
    ) -> float:
        """At most the key of ``call`` with that answer length here, at least ``bound_s``
        (cheap, not free: it may look up the call's prefix)."""
        ...

    def view(self, call: Call, now: float, served_last: bool) -> InstanceView: ...


def search(
    candidates: Sequence[Candidate],
    call: Call,
    now: float,
    policy: PolicyConfig,
    *,
    last_instance: str | None,
    known_tokens: int,
    expected_output: int,
    calls_left: float = 1.0,
) -> Decision:
    """Choose the instance for ``call`` among ``candidates`` (every one can hold it).

    ``last_instance`` served the session last; ``known_tokens`` is the session's history the
    last instance computed; ``expected_output`` the answer length expected (the session's
    last); ``calls_left`` the session's expected calls left, this one included (a wake is
    shared over them where ``policy.wake_shared``). With ``EXPECTED_COMPLETION`` only the
    candidates whose bound of the key (``pack_key``: the charge, less the pack slack's
    discount where the candidate holds calls of the model) beats the best exact key so far
    get an exact view (see the module docstring); the decision is the same as ranking them
    all. The baselines rank every candidate's view.
    """
    if policy.routing is not Routing.EXPECTED_COMPLETION:
        views = [c.view(call, now, c.name == last_instance) for c in candidates]
        return route(
            views,
            policy.routing,
            known_tokens,
            expected_output,
            policy.cache_affinity_load_cap,
            policy.cache_affinity_abs_tokens,
            concurrency_target=policy.concurrency_target,
        )
    # ``route`` takes the least (key, name), the key being ``pack_key`` of the charge; a
    # candidate can beat the best so far only if its (bound, name) is below the best's
    # (key, name): pop in that order, stop there
    left = calls_left if policy.wake_shared else 1.0
    wake, slack = policy.wake_charge_s, policy.pack_slack
    bounds = [
        (c.bound_s(call.model, expected_output, left, wake, slack), c.name, i, False)
        for i, c in enumerate(candidates)
    ]
    heapq.heapify(bounds)
    exact: list[InstanceView] = []
    best: tuple[float, str] = (math.inf, "")
    while bounds and bounds[0][:2] < best:
        bound, name, i, tightened = heapq.heappop(bounds)
        cand = candidates[i]
        if not tightened:
            tight = cand.prefill_bound_s(call, expected_output, left, wake, slack)
            if tight > bound:  # back in line at the tighter bound
                heapq.heappush(bounds, (tight, name, i, True))
                continue
        view = cand.view(call, now, cand.name == last_instance)
        exact.append(view)
        charge = estimate(view, known_tokens, expected_output).charge_s(left, wake)
        best = min(best, (pack_key(charge, view.model_calls > 0, slack), view.name))
    return route(
        exact,
        policy.routing,
        known_tokens,
        expected_output,
        calls_left=left,
        wake_charge_s=wake,
        pack_slack=policy.pack_slack,
    )
