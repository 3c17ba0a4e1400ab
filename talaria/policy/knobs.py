"""Each policy's own knobs and the values a tuning sweep tries, as its authors would tune it.

A policy is compared at its best setting of the knobs that are *its own* (the quantum of a
round-based scheduler, the load cap of cache-affinity routing, the starvation bound of the
session-aware order), chosen on the tune part of the traces; mechanisms a policy does not
have are not knobs. :func:`grid` lists the settings to try, in a fixed order (the first is
the default where the default is on the grid), and :func:`with_knobs` applies one.

* every quantum-based slot order (``ROUND_ROBIN``, ``OLDEST_WAITING``): ``slot_max_s`` in
  10 s .. 1,000 s, from "switch often" to "run a model until its queue drains" (the review
  that started this found 300 s best for the per-request baselines on one server);
* a quantum-based order of a policy that reserves returning sessions' KV (``round``,
  ``talaria-no-slot-order``): also ``slot_linger_s``, how long an idle slot waits for them
  (0, 2, 10 s);
* ``SHORTEST_REMAINING``: ``slot_starvation_s`` (100, 300, 1,000 s) and
  ``slot_preempt_ratio`` (1.5, 2, 4, 16: 16 all but turns preemption on remaining work off,
  leaving the starvation bound; on two instances it is what the tune part prefers);
* ``CACHE_AFFINITY`` routing: also ``cache_affinity_load_cap`` (1.5, 2, 4: SGLang router's
  balance threshold is a ratio of this kind);
* ``CONCURRENCY_TARGET`` routing: also ``concurrency_target`` (1, 2, 4, 8, 16, 64 calls in
  flight per instance: ServerlessLLM's deploy config defaults to 1, its scaler to 2, Ray
  Serve's to 2; a continuously batched engine serves many at once).

Pure: plain data in, plain data out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from talaria.config import PolicyConfig, Routing, SlotOrder
from talaria.errors import ConfigError

Knobs = Mapping[str, Any]

QUANTUM_S = (10.0, 30.0, 100.0, 300.0, 1000.0)
LINGER_S = (0.0, 2.0, 10.0)
STARVATION_S = (100.0, 300.0, 1000.0)
PREEMPT_RATIO = (1.5, 2.0, 4.0, 16.0)
LOAD_CAP = (1.5, 2.0, 4.0)
CONCURRENCY_TARGET = (1, 2, 4, 8, 16, 64)


def axes(policy: PolicyConfig) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """The knobs of ``policy`` a sweep varies, each with the values it tries."""
    out: list[tuple[str, tuple[Any, ...]]] = []
    if policy.slot_order is SlotOrder.SHORTEST_REMAINING:
        out += [("slot_starvation_s", STARVATION_S), ("slot_preempt_ratio", PREEMPT_RATIO)]
    else:
        out.append(("slot_max_s", QUANTUM_S))
        if policy.soft_reservations:  # it holds returning sessions' KV, so it may linger
            out.append(("slot_linger_s", LINGER_S))
    if policy.routing is Routing.CACHE_AFFINITY:
        out.append(("cache_affinity_load_cap", LOAD_CAP))
    if policy.routing is Routing.CONCURRENCY_TARGET:
        out.append(("concurrency_target", CONCURRENCY_TARGET))
    return tuple(out)


def grid(policy: PolicyConfig) -> tuple[Knobs, ...]:
    """Every setting of ``policy``'s knobs (the product of :func:`axes`), in a fixed order."""
    named = axes(policy)
    names = [n for n, _ in named]
    return tuple(
        MappingProxyType(dict(zip(names, values, strict=True)))
        for values in itertools.product(*(v for _, v in named))
    )


def knobs_of(policy: PolicyConfig) -> dict[str, Any]:
    """``policy``'s current values of the knobs :func:`axes` names."""
    return {name: getattr(policy, name) for name, _ in axes(policy)}


def with_knobs(policy: PolicyConfig, knobs: Knobs) -> PolicyConfig:
    """``policy`` with ``knobs`` set. A knob that is not one of its own raises
    ``ConfigError`` (a tuned file for another policy, or a typo)."""
    own = {name for name, _ in axes(policy)}
    unknown = sorted(set(knobs) - own)
    if unknown:
        raise ConfigError(
            f"policy {policy.name!r} has no tunable knob {unknown}; its knobs: {sorted(own)}"
        )
    return attrs.evolve(policy, **dict(knobs))


def best(scores: Sequence[tuple[float, float]], tie: float = 0.01) -> int:
    """The index of the best setting by (mean SCT p50, mean SCT p95) pairs: the lowest p50;
    settings within ``tie`` (relative) of it are tied, and the tie goes to the lowest p95,
    then to the earliest in grid order. Raises ``ConfigError`` on an empty or non-finite
    list."""
    if not scores:
        raise ConfigError("no tuning scores to choose from")
    if any(not (math.isfinite(x) and x >= 0) for pair in scores for x in pair):
        raise ConfigError(f"tuning scores must be finite and non-negative, got {list(scores)}")
    low = min(p50 for p50, _ in scores)
    tied = [i for i, (p50, _) in enumerate(scores) if p50 <= low * (1 + tie)]
    return min(tied, key=lambda i: (scores[i][1], i))
