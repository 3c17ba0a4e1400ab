"""The admission gate: whether the live cluster takes one more call, before anything changes.

A call is refused (``TooManyRequests``, HTTP 429) when the server holds ``max_calls`` calls,
when the caller's tenant holds ``max_calls_per_tenant`` of them (so one tenant's overload
leaves room for the others), when the tenant's token budget (:mod:`.quota`) cannot pay for
the call's prompt plus ``max_tokens`` yet, or when the call would open a session past the
tenant's ``max_sessions_per_tenant``. ``admit`` only checks; ``charge`` takes the tokens once
the call was placed (a check-then-commit pair, so a call routing refuses costs nothing).

Plain data, no clock and no I/O: the live cluster passes what is in flight and ``now``.
Not thread-safe: the live cluster's event loop owns it.
"""

from __future__ import annotations

from collections.abc import Iterable

from talaria.errors import BadRequest, TooManyRequests
from talaria.runtime.quota import TenantQuotas


def positive_int(name: str, value: object) -> int:
    """``value`` when it is an int of at least 1; ``BadRequest`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{name} must be a positive integer, got {value!r}")
    return value


class AdmissionGate:
    """The live cluster's limits and the count of calls they refused."""

    def __init__(
        self,
        max_calls: int,
        max_calls_per_tenant: int | None = None,
        tokens_per_minute_per_tenant: int | None = None,
        max_sessions_per_tenant: int | None = None,
    ) -> None:
        self.max_calls = positive_int("max_calls", max_calls)
        self.max_calls_per_tenant = positive_int(
            "max_calls_per_tenant",
            max_calls if max_calls_per_tenant is None else max_calls_per_tenant,
        )
        self.quotas = TenantQuotas(tokens_per_minute_per_tenant)
        self.max_sessions_per_tenant = (
            None
            if max_sessions_per_tenant is None
            else positive_int("max_sessions_per_tenant", max_sessions_per_tenant)
        )
        self.refused = 0

    def admit(
        self,
        tenant: str,
        cost: int,
        now: float,
        in_flight: Iterable[str],
        open_sessions: Iterable[str] | None,
    ) -> None:
        """Raise ``TooManyRequests`` (counting the refusal) if a call of ``tenant`` asking
        for ``cost`` tokens must wait. ``in_flight``: the tenant of each call held now;
        ``open_sessions``: the tenant of each open session when the call opens a new one,
        None when it continues a session. Mutates only ``refused``."""
        try:
            self._check(tenant, cost, now, list(in_flight), open_sessions)
        except TooManyRequests:
            self.refused += 1
            raise

    def charge(self, tenant: str, cost: int, now: float) -> None:
        """Take an admitted, placed call's tokens from its tenant's budget."""
        self.quotas.charge(tenant, cost, now)

    def _check(
        self,
        tenant: str,
        cost: int,
        now: float,
        in_flight: list[str],
        open_sessions: Iterable[str] | None,
    ) -> None:
        if len(in_flight) >= self.max_calls:
            raise TooManyRequests(
                f"the server holds {len(in_flight)} calls, its bound (max_calls); retry in a moment"
            )
        if sum(1 for t in in_flight if t == tenant) >= self.max_calls_per_tenant:
            raise TooManyRequests(
                f"your tenant has {self.max_calls_per_tenant} calls in flight, its share "
                "(max_calls_per_tenant); retry in a moment"
            )
        self.quotas.check(tenant, cost, now)
        limit = self.max_sessions_per_tenant
        if open_sessions is None or limit is None:
            return
        mine = sum(1 for t in open_sessions if t == tenant)
        if mine >= limit:
            raise TooManyRequests(
                f"your tenant has {mine} sessions open, its share (max_sessions_per_tenant); "
                "end one (an end event) or retry once one has ended"
            )
