"""Every policy named in DESIGN.md, as a ``PolicyConfig``.

Each baseline is an honest version of its idea, configured as its authors would run it:

* ``talaria``: everything on: expected-completion routing, soft reservations weighted by
  return probability, session-prefill, host-tier KV with value-based eviction, weight staging.
* ``round``: the paper baseline: the same round scheduler with SP, host-KV restoration and
  weight staging off. A continuation that arrives after its slot's opening admission waits
  for the next round; evicted KV is recomputed; a switch loads weights from host. It keeps
  sessions where their KV is (sticky placement) and LRU prefix caching, like a per-request
  server with a prefix cache.
* ``talaria-no-sp`` / ``-no-hostkv`` / ``-no-staging`` / ``-no-reserve``: one mechanism off.
* ``least-loaded``: load-only routing per request (fewest queued+running tokens), prefix
  caching with LRU eviction, continuous batching within the open slot, no host tier.
* ``sticky``: session affinity only (the instance that served the session last).
* ``ttl-pin``: Continuum-style: sticky, and a session's KV is pinned for a TTL after each
  call (the TTL covers the tool time of most steps: 2 s, above the traces' p95 of 1.05 s).
* ``cache-affinity``: prefix-affinity routing with a load cap (SGLang-router style), LRU
  prefix caching.

The per-request baselines run on the same time-sliced instances (they must: the models do
not fit together) with work-conserving slots: a slot closes as soon as its batch drains and
another model waits (no lingering for returning sessions, which is Talaria's idea).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from talaria.config import Eviction, PolicyConfig, Routing
from talaria.errors import ConfigError

TALARIA = PolicyConfig(name="talaria")

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
        PolicyConfig(name="talaria-no-sp", session_prefill=False),
        PolicyConfig(name="talaria-no-hostkv", host_kv=False),
        PolicyConfig(name="talaria-no-staging", weight_staging=False),
        PolicyConfig(name="talaria-no-reserve", soft_reservations=False, slot_linger_s=0.0),
        PolicyConfig(name="least-loaded", **_PER_REQUEST),  # type: ignore[arg-type]
        PolicyConfig(name="sticky", **{**_PER_REQUEST, "routing": Routing.STICKY}),  # type: ignore[arg-type]
        PolicyConfig(
            name="ttl-pin",
            **{**_PER_REQUEST, "routing": Routing.STICKY},  # type: ignore[arg-type]
            kv_pin_ttl_s=2.0,
        ),
        PolicyConfig(
            name="cache-affinity",
            **{**_PER_REQUEST, "routing": Routing.CACHE_AFFINITY},  # type: ignore[arg-type]
        ),
    ]
    return MappingProxyType({p.name: p for p in policies})


POLICIES: Mapping[str, PolicyConfig] = _build()
ABLATIONS = ("talaria-no-sp", "talaria-no-hostkv", "talaria-no-staging", "talaria-no-reserve")
BASELINES = ("round", "least-loaded", "sticky", "ttl-pin", "cache-affinity")


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
