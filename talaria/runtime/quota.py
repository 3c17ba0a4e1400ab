"""Per-tenant token budgets: how many tokens a minute each tenant's calls may ask for.

A tenant's budget is a token bucket that holds at most ``per_minute`` tokens and refills at
``per_minute / 60`` tokens a second. A call asks for its prompt tokens plus its
``max_tokens`` (what it may use, as OpenAI's tokens-per-minute limits count a request).
``check`` says whether the call fits now, raising ``TooManyRequests`` with the seconds until
it would (``retry_after_s``, what the HTTP layer sends as ``Retry-After``), or ``BadRequest``
when the call alone asks for more than a whole minute's budget (waiting cannot help);
``charge`` takes the tokens once the call was accepted: a check-then-commit pair, so a call
refused for another reason costs its tenant nothing.

Plain data and arithmetic, no clock: callers pass ``now`` (seconds on their clock). Not
thread-safe: the live cluster's event loop owns it.
"""

from __future__ import annotations

import math

import attrs

from talaria.errors import BadRequest, ConfigError, TooManyRequests


@attrs.define
class TokenBucket:
    """One tenant's budget: ``level`` tokens available at ``updated_s``."""

    per_minute: int
    level: float
    updated_s: float

    @property
    def rate(self) -> float:
        """Tokens refilled per second."""
        return self.per_minute / 60.0

    def level_at(self, now: float) -> float:
        """Tokens available at ``now`` (a clock that went back refills nothing)."""
        return min(float(self.per_minute), self.level + max(0.0, now - self.updated_s) * self.rate)

    def wait_s(self, cost: int, now: float) -> float:
        """Seconds from ``now`` until ``cost`` tokens are available (0 when they are)."""
        missing = cost - self.level_at(now)
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, cost: int, now: float) -> None:
        """Spend ``cost`` tokens at ``now`` (after ``wait_s`` said 0)."""
        self.level = self.level_at(now) - cost
        self.updated_s = max(self.updated_s, now)


class TenantQuotas:
    """Every tenant's bucket; ``per_minute`` None means no limit (every check passes)."""

    def __init__(self, per_minute: int | None) -> None:
        if per_minute is not None and (
            isinstance(per_minute, bool) or not isinstance(per_minute, int) or per_minute < 1
        ):
            raise ConfigError(
                f"tokens_per_minute_per_tenant must be a positive integer or None, got "
                f"{per_minute!r}"
            )
        self.per_minute = per_minute
        self._buckets: dict[str, TokenBucket] = {}

    def _bucket(self, tenant: str, now: float) -> TokenBucket | None:
        if self.per_minute is None:
            return None
        bucket = self._buckets.get(tenant)
        if bucket is None:  # a tenant starts with a full minute
            bucket = TokenBucket(self.per_minute, float(self.per_minute), now)
        return bucket

    def check(self, tenant: str, cost: int, now: float) -> None:
        """Raise if ``tenant`` may not spend ``cost`` tokens at ``now``; changes nothing."""
        bucket = self._bucket(tenant, now)
        if bucket is None:
            return
        if cost > bucket.per_minute:
            raise BadRequest(
                f"this call asks for {cost} tokens (prompt plus max_tokens), more than your "
                f"tenant's {bucket.per_minute} tokens per minute; lower max_tokens or shorten "
                "the prompt"
            )
        wait = bucket.wait_s(cost, now)
        if wait > 0:
            raise TooManyRequests(
                f"your tenant's budget of {bucket.per_minute} tokens per minute is spent "
                f"(this call asks for {cost}); retry in {math.ceil(wait)} s",
                retry_after_s=wait,
            )

    def charge(self, tenant: str, cost: int, now: float) -> None:
        """``tenant`` spends ``cost`` tokens at ``now`` (after ``check`` passed)."""
        bucket = self._bucket(tenant, now)
        if bucket is None:
            return
        bucket.take(cost, now)
        self._buckets[tenant] = bucket

    def available(self, tenant: str, now: float) -> float | None:
        """Tokens ``tenant`` may still ask for at ``now`` (None: no limit)."""
        bucket = self._bucket(tenant, now)
        return None if bucket is None else bucket.level_at(now)
