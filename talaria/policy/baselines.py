"""Every policy named in DESIGN.md, as a ``PolicyConfig``.

Each baseline is an honest version of its idea, configured as its authors would run it:

* ``talaria``: everything on: expected-completion routing, soft reservations weighted by
  return probability, session-prefill, host-tier KV with value-based eviction, weight staging.
* ``round``: the paper baseline: the same round scheduler with SP, host-KV restoration and
  weight staging off. A continuation that arrives after its slot's opening admission waits
  for the next round; evicted KV is recomputed; a switch loads weights from host. It keeps
  sessions where their KV is (sticky placement) and LRU prefix caching, like a per-request
  server with a prefix cache.
* ``talaria``'s slot order is session-aware (``SlotOrder.SHORTEST_REMAINING``); every other
  policy keeps a quantum-based order.
* ``talaria-no-sp`` / ``-no-hostkv`` / ``-no-staging`` / ``-no-reserve`` / ``-no-slot-order``:
  one mechanism off (the last: round-robin slots with a 30 s quantum, as before).
* ``least-loaded``: load-only routing per request (fewest queued+running tokens), prefix
  caching with LRU eviction, continuous batching within the open slot, no host tier.
* ``sticky``: session affinity only (the instance that served the session last).
* ``ttl-pin``: Continuum as published (``talaria/policy/continuum.py``): sticky, a session's
  KV pinned after each call for the TTL that maximizes P(back within TTL) x (queueing delay
  x eta + reload) - TTL over the learned tool-duration CDF (an exponential 1 s prior at cold
  start), pins kept while the program's next call waits, released latest-program-first when
  nothing runs and a call cannot be admitted, and program-level first-come-first-served
  queues (sessions holding a pin first, then by their first arrival).
* ``cache-affinity``: prefix-affinity routing with a load cap (SGLang-router style), LRU
  prefix caching.
* ``oldest-first``: a serverless per-request scheduler's slot order: the next slot goes to the
  model of the oldest waiting call (first come, first served across models, the queue a
  per-request serverless platform keeps; longest-queue-first would let a busy model starve
  a quiet one), with the same quantum; otherwise as ``least-loaded``.

The per-request baselines run on the same time-sliced instances (they must: the models do
not fit together) with work-conserving slots: a slot closes as soon as its batch drains and
another model waits (no lingering for returning sessions, which is Talaria's idea).
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
    "host_kv": False,
    "weight_staging": False,
    "soft_reservations": False,
    "eviction": Eviction.LRU,
    "slot_linger_s": 0.0,
}


def _build() -> Mapping[str, PolicyConfig]:
    policies = [
        TALARIA,
        PolicyConfig(
            name="round",
            routing=Routing.STICKY,
            session_prefill=False,
            host_kv=False,
            weight_staging=False,
            soft_reservations=False,
            eviction=Eviction.LRU,
            slot_linger_s=0.0,
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
