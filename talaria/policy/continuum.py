"""Continuum's KV time-to-live, as published (Li et al., "Continuum: Efficient and Robust
Multi-Turn LLM Agent Scheduling with KV Cache Time-to-Live", arXiv 2511.02230), for the
``ttl-pin`` baseline.

When a call of a multi-turn program ends in a tool call, Continuum pins the program's KV for
the TTL that maximizes the expected benefit of pinning minus its cost in seconds of memory:

    tau* = argmax over tau of  U(tau) = P(tool returns within tau) * (T * eta + reload) - tau

* ``P``: the empirical CDF of observed durations of this tool (the paper's per-tool CDF once
  it has more than ``COLD_START_SAMPLES`` observations; the pooled CDF of every tool once the
  pool has; before that an exponential prior of mean ``PRIOR_MEAN_S``, for which the argmax
  has the closed form ``tau* = mu ln(B / mu)`` when ``B > mu``, else 0). With an empirical
  CDF the argmax lies at 0 or at an observed duration (the CDF only jumps there).
* ``T``: the mean queueing delay that calls which lost their KV saw on readmission (a
  sliding window of ``WINDOW`` calls, 0 until one is seen): what an eviction costs the
  program beyond recomputation, because its next call queues again.
* ``eta = -corr(k, N - k)`` over finished programs' turns (``k`` done of ``N``): how much
  "turns done" predicts "turns left" (1 before ``MIN_PROGRAMS`` programs ended).
* ``reload``: seconds to recompute (or restore) the program's context if its KV is evicted.

A TTL of 0 means "do not pin". Program-level first-come-first-served (the paper's queue
order: waiting calls by their program's first arrival, programs holding a pin first) lives
in the instance core's queue (``QueueOrder.PROGRAM_FCFS``).

Pure: numbers in, numbers out; mutated only by the ``observe_*`` methods. Constants whose
value the paper does not give (the window lengths) are set here and named.
"""

from __future__ import annotations

import bisect
import collections
import math

import attrs

COLD_START_SAMPLES = 100  # observations before an empirical CDF is trusted (the paper's K)
PRIOR_MEAN_S = 1.0  # the cold-start exponential prior's mean tool duration (the paper's)
WINDOW = 256  # queueing delays remembered (a sliding window; not given in the paper)
MIN_PROGRAMS = 5  # ended programs before eta is estimated (1 before; not in the paper)
MAX_SAMPLES = 4096  # tool durations remembered per key (the most recent)


@attrs.define
class _Samples:
    """Tool durations of one key: sorted for the CDF, in arrival order to forget the oldest."""

    sorted: list[float] = attrs.field(factory=list)
    order: collections.deque[float] = attrs.field(factory=collections.deque)

    def add(self, x: float) -> None:
        if len(self.order) >= MAX_SAMPLES:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.order.append(x)
        bisect.insort(self.sorted, x)


def best_ttl(samples: list[float], benefit_s: float) -> float:
    """``argmax_tau F(tau) * benefit - tau`` for the empirical CDF ``F`` of the sorted
    ``samples`` (0 if pinning never pays). Ties go to the smaller TTL."""
    n = len(samples)
    if n == 0:
        return 0.0
    best_tau = 0.0
    best_u = bisect.bisect_right(samples, 0.0) / n * benefit_s  # U(0) = F(0) * benefit
    i = 0
    while i < n:
        tau = samples[i]
        j = bisect.bisect_right(samples, tau, lo=i)
        u = j / n * benefit_s - tau
        if u > best_u:
            best_tau, best_u = tau, u
        i = j
    return best_tau


def prior_ttl(benefit_s: float, mean_s: float = PRIOR_MEAN_S) -> float:
    """The argmax for an exponential tool duration of mean ``mean_s``:
    d/dtau [(1 - exp(-tau/mu)) B - tau] = 0 gives tau = mu ln(B / mu), when B > mu."""
    if not benefit_s > mean_s:
        return 0.0
    return mean_s * math.log(benefit_s / mean_s)


@attrs.define
class ContinuumTTL:
    """What Continuum learns online, and the TTL it chooses (seconds)."""

    _tools: dict[str, _Samples] = attrs.field(factory=dict)
    _pooled: _Samples = attrs.field(factory=_Samples)
    _waits: collections.deque[float] = attrs.field(factory=lambda: collections.deque(maxlen=WINDOW))
    _pairs: list[tuple[int, int]] = attrs.field(factory=list)  # (k done, N - k left)
    _programs: int = 0

    def observe_tool(self, key: str | None, seconds: float) -> None:
        """A tool (``key``; None when no hint named it) took ``seconds``."""
        if not seconds >= 0.0 or seconds == math.inf:
            return
        if key is not None:
            self._tools.setdefault(key, _Samples()).add(seconds)
        self._pooled.add(seconds)

    def observe_wait(self, seconds: float) -> None:
        """A call that had lost its KV waited ``seconds`` in the queue."""
        if seconds >= 0.0 and seconds != math.inf:
            self._waits.append(seconds)

    def observe_program(self, turns: int) -> None:
        """A program ended after ``turns`` calls."""
        if turns < 2:
            return
        self._programs += 1
        self._pairs.extend((k, turns - k) for k in range(1, turns))
        if len(self._pairs) > MAX_SAMPLES:
            del self._pairs[: len(self._pairs) - MAX_SAMPLES]

    @property
    def queue_delay_s(self) -> float:
        """``T``: the mean readmission wait of calls that lost their KV (0 before any)."""
        return sum(self._waits) / len(self._waits) if self._waits else 0.0

    @property
    def eta(self) -> float:
        """``-corr(k, N - k)`` over ended programs' turns (1 before ``MIN_PROGRAMS``; 1 when
        the correlation is undefined, every program having the same length)."""
        if self._programs < MIN_PROGRAMS or len(self._pairs) < 2:
            return 1.0
        n = len(self._pairs)
        mk = sum(k for k, _ in self._pairs) / n
        ml = sum(r for _, r in self._pairs) / n
        cov = sum((k - mk) * (r - ml) for k, r in self._pairs)
        vk = sum((k - mk) ** 2 for k, _ in self._pairs)
        vl = sum((r - ml) ** 2 for _, r in self._pairs)
        if vk <= 0.0 or vl <= 0.0:
            return 1.0
        return -cov / math.sqrt(vk * vl)

    def ttl_s(self, tool: str | None, reload_s: float) -> float:
        """The TTL to pin a program's KV for after a call that ends in ``tool`` (None: not
        known), when losing the KV costs ``reload_s`` to rebuild."""
        benefit = self.queue_delay_s * self.eta + max(0.0, reload_s)
        own = self._tools.get(tool) if tool is not None else None
        if own is not None and len(own.sorted) > COLD_START_SAMPLES:
            return best_ttl(own.sorted, benefit)
        if len(self._pooled.sorted) > COLD_START_SAMPLES:
            return best_ttl(self._pooled.sorted, benefit)
        return prior_ttl(benefit)
