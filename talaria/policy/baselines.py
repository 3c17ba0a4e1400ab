"""Every policy named in docs/design.md, as a ``PolicyConfig``, and the real system each stands for.

Each baseline is an honest version of its idea, with the substrate features its real
counterpart has, so what separates it from ``talaria`` is session awareness. Every one is
run at its tuned best: its own knobs (:mod:`talaria.policy.knobs`) are swept on the tune
part of the traces before any comparison (``talaria tune``); the values here are defaults.

* ``talaria``: everything on: expected-completion routing, soft reservations weighted by
  return probability, session-prefill, host-tier KV with value-based eviction, weight
  staging, and the session-aware slot order (``SlotOrder.SHORTEST_REMAINING``).
* ``round``: the paper's baseline, "an otherwise identical round scheduler with SP,
  host-KV restoration and D2D staging disabled": ``talaria`` with those three off and a
  round-robin slot order with a quantum (its routing, reservations, lingering and
  value-based eviction are talaria's). Nothing else differs.
* ``talaria-no-sp`` / ``-no-hostkv`` / ``-no-staging`` / ``-no-reserve`` / ``-no-slot-order``:
  one mechanism off (the last: round-robin slots with a quantum).
* The per-request baselines keep no session state beyond what their systems keep: LRU
  prefix caching with a host KV tier (evicted prefix blocks are offloaded to host memory and
  restored on a hit, as vLLM's CPU offloading connector or LMCache do), weights switched in
  from host memory at the link's rate (the fast loading ServerlessLLM gets from keeping
  checkpoints in host memory), continuous batching within the open slot, a quantum-based
  slot order, and work-conserving slots (a slot closes as soon as its batch drains and
  another model waits: lingering for returning sessions is Talaria's idea). No weight
  staging (none of them overlaps the next model's load with the current one's run).

  - ``least-loaded``: per-request load balancing (fewest queued + running tokens), as a
    production router in front of vLLM engines does.
  - ``sticky``: session affinity (the instance that served the session last), as
    vLLM production-stack's session router or a consistent-hash router keyed by session.
  - ``ttl-pin``: Continuum as published (``talaria/policy/continuum.py``): sticky, a
    session's KV pinned after each call for the TTL that maximizes P(back within TTL) x
    (queueing delay x eta + reload) - TTL over the learned tool-duration CDF (an exponential
    1 s prior at cold start), pins kept while the program's next call waits, released
    latest-program-first when nothing runs and a call cannot be admitted, and program-level
    first-come-first-served queues. Its constants are the paper's; its quantum is tuned.
  - ``cache-affinity``: prefix-affinity routing with a load cap (SGLang router's cache-aware
    policy with its balance thresholds), with a host tier as SGLang's HiCache keeps.
  - ``oldest-first``: a serverless per-request scheduler (ServerlessLLM-style: weights
    loaded fast from host memory, FCFS across models): the next slot goes to the model of
    the oldest waiting call (longest-queue-first would let a busy model starve a quiet one).

* A pool baseline (``POOL_BASELINES``: many models on many instances, ``talaria load``):

  - ``serverless``: ServerlessLLM's scheduler as far as a per-request scheduler goes:
    ``oldest-first`` with its locality-aware placement, each call to the instance with the
    least estimated startup time (``Routing.STARTUP_TIME``: the model's load from the tier
    its weights are in there, device, host or disk, after the slot and the queue ahead).
    Kept: startup-time placement, fast loading from host memory, FCFS across models, and
    keep-alive as the pool has it (a model's weights stay until another model needs the
    memory). Not kept: live migration of running inference (no policy here migrates a
    running call), and a keep-alive timer that unloads an idle model (nothing in the
    simulated pool is gained by unloading before memory is needed).
  - ``autoscale``: a serverless autoscaler (ServerlessLLM's ``auto_scaling_config``,
    Knative's concurrency target): a model gets an instance per ``concurrency_target`` calls
    in flight and an instance serves one model while it has calls
    (``Routing.CONCURRENCY_TARGET``, ``talaria.policy.router.scale_by_concurrency``), with
    ``serverless``'s FCFS slots where instances run out and a model must share one. Kept:
    the scaling metric and rule (concurrency, desired = ceil(in flight / target), min 0,
    max the pool), placement of a new instance by startup time, scale-in by keep-alive (the
    pool's timer). Not kept: the scaling loop's one-second period (each call is placed as it
    arrives, with the rule's count at that moment) and round-robin balancing (least-loaded).
    Its target is tuned (``talaria.policy.knobs``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

from talaria.config import Eviction, PolicyConfig, QueueOrder, Routing, SlotOrder
from talaria.errors import ConfigError

TALARIA = PolicyConfig(name="talaria", slot_order=SlotOrder.SHORTEST_REMAINING)

_PER_REQUEST = {
    "routing": Routing.LEAST_LOADED,
    "host_kv": True,
    "weight_staging": False,
    "soft_reservations": False,
    "eviction": Eviction.LRU,
    "slot_linger_s": 0.0,
    "wake_shared": False,
}


def _build() -> Mapping[str, PolicyConfig]:
    policies = [
        TALARIA,
        attrs.evolve(
            TALARIA,
            name="round",
            session_prefill=False,
            host_kv=False,
            weight_staging=False,
            slot_order=SlotOrder.ROUND_ROBIN,
        ),
        attrs.evolve(TALARIA, name="talaria-no-sp", session_prefill=False),
        attrs.evolve(TALARIA, name="talaria-no-hostkv", host_kv=False),
        attrs.evolve(TALARIA, name="talaria-no-staging", weight_staging=False),
        attrs.evolve(
            TALARIA, name="talaria-no-reserve", soft_reservations=False, slot_linger_s=0.0
        ),
        attrs.evolve(TALARIA, name="talaria-no-slot-order", slot_order=SlotOrder.ROUND_ROBIN),
        PolicyConfig(name="least-loaded", **_PER_REQUEST),  # type: ignore[arg-type]
        PolicyConfig(name="sticky", **{**_PER_REQUEST, "routing": Routing.STICKY}),  # type: ignore[arg-type]
        PolicyConfig(
            name="ttl-pin",
            **{**_PER_REQUEST, "routing": Routing.STICKY},  # type: ignore[arg-type]
            continuum_ttl=True,
            queue_order=QueueOrder.PROGRAM_FCFS,
        ),
        PolicyConfig(
            name="cache-affinity",
            **{**_PER_REQUEST, "routing": Routing.CACHE_AFFINITY},  # type: ignore[arg-type]
        ),
        PolicyConfig(
            name="oldest-first",
            **_PER_REQUEST,  # type: ignore[arg-type]
            slot_order=SlotOrder.OLDEST_WAITING,
        ),
        PolicyConfig(
            name="serverless",
            **{**_PER_REQUEST, "routing": Routing.STARTUP_TIME},  # type: ignore[arg-type]
            slot_order=SlotOrder.OLDEST_WAITING,
        ),
        PolicyConfig(
            name="autoscale",
            **{**_PER_REQUEST, "routing": Routing.CONCURRENCY_TARGET},  # type: ignore[arg-type]
            slot_order=SlotOrder.OLDEST_WAITING,
        ),
    ]
    return MappingProxyType({p.name: p for p in policies})


POLICIES: Mapping[str, PolicyConfig] = _build()
ABLATIONS = (
    "talaria-no-sp",
    "talaria-no-hostkv",
    "talaria-no-staging",
    "talaria-no-reserve",
    "talaria-no-slot-order",
)
BASELINES = ("round", "least-loaded", "sticky", "ttl-pin", "cache-affinity", "oldest-first")
POOL_BASELINES = ("serverless", "autoscale")


def policy(name: str) -> PolicyConfig:
    """The policy called ``name``; unknown names raise ``ConfigError`` listing the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None


def parse_policies(spec: str) -> tuple[PolicyConfig, ...]:
    """A comma-separated list of names (``all`` for every policy)."""
    if spec.strip() == "all":
        return tuple(POLICIES.values())
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ConfigError("no policy named; give a comma-separated list or 'all'")
    return tuple(policy(n) for n in names)
