"""Admission with soft reservations, for one instance.

A session that just got its answer goes into a tool gap. If it is likely to come back soon
(``GapModel``), the instance that served it holds a *soft reservation*: the session's KV
blocks stay pinned on device so its continuation reuses them. A reservation

* is weighted by the probability that the session returns within the policy's horizon, and
  is not taken at all below ``reservation_min_probability``;
* expires when its hold time runs out or when its return probability decays (the gap has
  lasted far longer than expected);
* is reclaimable: when a waiting call cannot be admitted and has waited longer than
  ``reclaim_after_wait_s``, the least valuable reservations are released and their KV is
  demoted to host (never silently dropped), most valuable last.

A TTL pin is a reservation with probability one that is not reclaimed by value and expires
after its TTL: a fixed ``kv_pin_ttl_s``, or with ``continuum_ttl`` the TTL Continuum's
cost-benefit rule picks for each call (``ContinuumTTL``: learned tool-duration CDFs, the
queueing delay an eviction costs, the context's reload time; 0 means no pin). Continuum also
releases pins when a waiting call cannot be admitted and nothing runs (latest program first:
``stuck_order``).

This class decides; it does not touch the KV manager. The instance core applies the
decisions (``kv.pin`` / ``kv.unpin`` / ``kv.offload``). Mutates only its own table.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Iterable

import attrs

from talaria.config import PolicyConfig
from talaria.policy.continuum import ContinuumTTL
from talaria.policy.gaps import GapModel
from talaria.types import SessionKey


@attrs.define
class Reservation:
    session: SessionKey
    model: str
    blocks: int  # device blocks pinned for the session
    since_s: float  # gap start (the call's answer)
    expected_gap_s: float | None  # the hint or prediction (median gap, seconds)
    expires_s: float
    probability: float  # of returning within the horizon, when last evaluated
    hard: bool = False  # a TTL pin: not reclaimable
    deadline_s: float = 0.0  # when it expires: hold runs out or the return becomes unlikely
    reload_s: float = 0.0  # seconds to rebuild its KV if lost (Continuum's TTL input)
    program_s: float = 0.0  # when its session (program) started (Continuum's release order)

    def value(self, now: float, gaps: GapModel, horizon_s: float) -> float:
        """Expected benefit per pinned block: P(back within horizon) per unit of KV."""
        if self.hard:
            return float("inf")
        p = gaps.prob_back_within(now - self.since_s, horizon_s, self.expected_gap_s)
        return p / max(1, self.blocks)


class Admission:
    """Soft reservations of one instance (decisions only)."""

    def __init__(self, policy: PolicyConfig, gaps: GapModel | None = None) -> None:
        self.policy = policy
        self.gaps = gaps or GapModel()
        self._held: dict[SessionKey, Reservation] = {}
        self._deadlines: list[tuple[float, int, SessionKey]] = []  # heap, stale entries skipped
        self._seq = 0
        self._decay_cache: dict[float | None, float] = {}
        self.continuum = ContinuumTTL() if policy.continuum_ttl else None
        self.reservations_made = 0
        self.reservations_reclaimed = 0
        self.reservations_expired = 0

    @property
    def enabled(self) -> bool:
        p = self.policy
        return p.soft_reservations or p.kv_pin_ttl_s > 0 or p.continuum_ttl

    @property
    def held(self) -> dict[SessionKey, Reservation]:
        return self._held

    @property
    def reserved_blocks(self) -> int:
        return sum(r.blocks for r in self._held.values())

    def weighted_reserved_blocks(self, now: float) -> float:
        """Blocks held, each reservation weighted by its return probability."""
        h = self.policy.reservation_horizon_s
        return sum(
            r.blocks
            * (1.0 if r.hard else self.gaps.prob_back_within(now - r.since_s, h, r.expected_gap_s))
            for r in self._held.values()
        )

    def probability(self, since_s: float, now: float, expected_gap_s: float | None) -> float:
        return self.gaps.prob_back_within(
            now - since_s, self.policy.reservation_horizon_s, expected_gap_s
        )

    def offer(
        self,
        session: SessionKey,
        model: str,
        blocks: int,
        now: float,
        expected_gap_s: float | None,
        reload_s: float = 0.0,
        program_s: float = 0.0,
        tool: str | None = None,
    ) -> Reservation | None:
        """A session entered a tool gap. Returns the reservation to hold, or None.

        The caller pins the session's KV when a reservation is returned. ``reload_s``,
        ``program_s`` and ``tool`` feed Continuum's TTL (``continuum_ttl``).
        """
        if session in self._held or blocks <= 0:
            return None
        ttl = self._ttl_s(tool, reload_s)
        if ttl is not None:
            if ttl <= 0.0:
                return None
            res = Reservation(
                session,
                model,
                blocks,
                now,
                expected_gap_s,
                now + ttl,
                1.0,
                True,
                reload_s=reload_s,
                program_s=program_s,
            )
        elif self.policy.soft_reservations:
            p = self.probability(now, now, expected_gap_s)
            if p < self.policy.reservation_min_probability:
                return None
            expires = now + self.policy.reservation_max_hold_s
            res = Reservation(session, model, blocks, now, expected_gap_s, expires, p)
        else:
            return None
        self._held[session] = res
        self._schedule_expiry(res)
        self.reservations_made += 1
        return res

    def _ttl_s(self, tool: str | None, reload_s: float) -> float | None:
        """A TTL pin's TTL (Continuum's rule, else the fixed one); None: no TTL pins."""
        if self.continuum is not None:
            return self.continuum.ttl_s(tool, reload_s)
        return self.policy.kv_pin_ttl_s if self.policy.kv_pin_ttl_s > 0 else None

    def _decay_s(self, expected_gap_s: float | None) -> float:
        """Gap length after which a return within the horizon is below the minimum
        probability (memoized per expected gap: hints take few distinct values)."""
        cached = self._decay_cache.get(expected_gap_s)
        if cached is None:
            p = self.policy
            cached = self.gaps.decays_below_s(
                p.reservation_min_probability, p.reservation_horizon_s, expected_gap_s
            )
            if len(self._decay_cache) < 4096:
                self._decay_cache[expected_gap_s] = cached
        return cached

    def _schedule_expiry(self, res: Reservation) -> None:
        decay = math.inf if res.hard else res.since_s + self._decay_s(res.expected_gap_s)
        res.deadline_s = min(res.expires_s, decay)
        self._seq += 1
        heapq.heappush(self._deadlines, (res.deadline_s, self._seq, res.session))

    def update_hint(self, session: SessionKey, expected_gap_s: float | None, now: float) -> None:
        """A client's tool-start hint arrived after the reservation was made."""
        res = self._held.get(session)
        if res is not None and not res.hard:
            res.expected_gap_s = expected_gap_s
            res.probability = self.probability(res.since_s, now, expected_gap_s)
            self._schedule_expiry(res)

    def retime(self, session: SessionKey, tool: str | None, now: float) -> Reservation | None:
        """Continuum: the tool of ``session``'s gap became known (its hint came after the
        pin): size the TTL for that tool, from the gap's start. Returns the reservation when
        it ends here (TTL 0, or already run out): the caller unpins."""
        res = self._held.get(session)
        if res is None or self.continuum is None:
            return None
        res.expires_s = res.since_s + self.continuum.ttl_s(tool, res.reload_s)
        if res.expires_s <= max(now, res.since_s):
            return self._held.pop(session)
        self._schedule_expiry(res)
        return None

    def stuck_order(self, exclude: Iterable[SessionKey] = ()) -> list[Reservation]:
        """Continuum's release order when a waiting call cannot be admitted and nothing
        runs: TTL pins of the latest-started programs first."""
        skip = set(exclude)
        cands = [r for r in self._held.values() if r.hard and r.session not in skip]
        return sorted(cands, key=lambda r: (-r.program_s, r.session))

    def release(self, session: SessionKey) -> Reservation | None:
        """The session came back (or ended): drop its reservation. Caller unpins."""
        return self._held.pop(session, None)

    def next_deadline_s(self) -> float:
        """The earliest time ``expire`` may end a reservation (inf with none held); a
        superseded deadline may make it early, never late."""
        return self._deadlines[0][0] if self._deadlines else math.inf

    def due(self, now: float) -> bool:
        """Whether ``expire(now)`` has a deadline to look at (cheap: the heap's top)."""
        return bool(self._deadlines) and self._deadlines[0][0] <= now

    def expire(self, now: float, waiting: Container[SessionKey] = ()) -> list[Reservation]:
        """Reservations whose hold ran out or whose return became unlikely (below
        ``reservation_min_probability`` within the horizon). Caller unpins; the KV stays
        cached (evictable by value), so an expiry costs nothing by itself. O(log n) each:
        deadlines are computed when a reservation is made or its hint changes. With
        Continuum's TTL, a pin whose session has a call ``waiting`` outlives its TTL: that
        call's admission releases it."""
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, sid = heapq.heappop(heap)
            res = self._held.get(sid)
            if res is None or res.deadline_s != deadline:
                continue
            if self.continuum is not None and sid in waiting:
                res.deadline_s = math.inf
            else:
                out.append(self._held.pop(sid))
        self.reservations_expired += len(out)
        return out

    def reclaim_order(self, now: float, exclude: Iterable[SessionKey] = ()) -> list[Reservation]:
        """Reclaimable reservations, least valuable first (hard TTL pins excluded)."""
        skip = set(exclude)
        h = self.policy.reservation_horizon_s
        cands = [r for r in self._held.values() if not r.hard and r.session not in skip]
        return sorted(cands, key=lambda r: (r.value(now, self.gaps, h), r.session))

    def should_reclaim(self, waited_s: float) -> bool:
        """A waiting call that cannot be admitted may reclaim once it waited long enough."""
        return waited_s >= self.policy.reclaim_after_wait_s

    def reclaim(self, session: SessionKey) -> Reservation:
        """Release a reservation to make room. Caller unpins and offloads (demotes) its KV."""
        res = self._held.pop(session)
        self.reservations_reclaimed += 1
        return res
