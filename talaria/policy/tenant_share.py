"""Fair share of a model's running batch between tenants.

When several tenants' calls wait for the same model, the next call admitted comes from the
tenant with the fewest calls in the batch, counting the calls of its own that are queued ahead
of it: one tenant's backlog of a thousand calls no longer stands in front of another tenant's
single call. Within a tenant the queue's own order (first come first served, or Continuum's
program order) is kept; ties between tenants go to the call that was ahead in that order. With
one tenant the order is unchanged, so single-tenant replays are not affected.

This is start-time fair queueing with equal weights and unit cost per call: a call's tag is
its tenant's running calls plus its rank among its tenant's waiting calls, and the queue is
served by tag. Pure functions; nothing here mutates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def fair_order(
    queue: Sequence[T], tenant_of: Callable[[T], str], running: Mapping[str, int]
) -> list[T]:
    """``queue`` reordered so that each next call is from the tenant with the fewest calls in
    the batch (``running``: calls per tenant, absent = 0) counting those admitted before it
    in this order; a tenant's calls keep their relative order; ties keep queue order."""
    rank: dict[str, int] = {}
    tagged = []
    for position, item in enumerate(queue):
        tenant = tenant_of(item)
        k = rank.get(tenant, 0)
        rank[tenant] = k + 1
        tagged.append((running.get(tenant, 0) + k, position, item))
    tagged.sort(key=lambda t: (t[0], t[1]))
    return [item for _, _, item in tagged]
