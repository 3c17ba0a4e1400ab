"""Continuum's TTL rule: tau* = argmax P(back within tau) * (T * eta + reload) - tau, on
hand-made tool-duration samples, the cold-start prior's closed form, and eta."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.policy.continuum import (
    COLD_START_SAMPLES,
    MIN_PROGRAMS,
    ContinuumTTL,
    best_ttl,
    prior_ttl,
)
from tests.helpers import examples


def test_best_ttl_on_a_small_empirical_cdf() -> None:
    samples = [0.5, 1.0, 4.0, 30.0]  # F jumps by 1/4 at each
    # benefit 10 s: U(0.5) = 2.5 - 0.5 = 2; U(1) = 5 - 1 = 4; U(4) = 7.5 - 4 = 3.5; U(30) < 0
    assert best_ttl(samples, 10.0) == 1.0
    # benefit 40 s: U(1) = 19, U(4) = 26, U(30) = 10
    assert best_ttl(samples, 40.0) == 4.0
    assert best_ttl(samples, 1.0) == 0.0  # U(0.5) = -0.25: never worth pinning
    assert best_ttl([], 100.0) == 0.0
    assert best_ttl([0.0, 0.0, 2.0], 3.0) == 0.0  # ties go to the smaller TTL


def test_cold_start_prior_closed_form() -> None:
    assert prior_ttl(math.e) == pytest.approx(1.0)  # mu ln(B / mu), mu = 1 s
    assert prior_ttl(0.9) == 0.0 and prior_ttl(1.0) == 0.0
    assert prior_ttl(10.0, mean_s=2.0) == pytest.approx(2.0 * math.log(5.0))


@settings(max_examples=examples(200), deadline=None)
@given(benefit=st.floats(1.0001, 1e6))
def test_the_prior_ttl_maximizes_the_exponential_utility(benefit: float) -> None:
    tau = prior_ttl(benefit)

    def u(t: float) -> float:
        return (1 - math.exp(-t)) * benefit - t

    assert u(tau) >= max(u(tau * 0.9), u(tau * 1.1), u(0.0)) - 1e-9 * benefit


def test_ttl_moves_from_the_prior_to_the_pooled_then_the_tools_own_cdf() -> None:
    c = ContinuumTTL()
    assert c.queue_delay_s == 0.0 and c.eta == 1.0
    assert c.ttl_s("tests", math.e) == pytest.approx(1.0)  # the prior
    for _ in range(COLD_START_SAMPLES + 1):
        c.observe_tool("bash", 0.5)
    assert c.ttl_s("tests", 10.0) == 0.5  # pooled CDF: every tool took 0.5 s
    for _ in range(COLD_START_SAMPLES + 1):
        c.observe_tool("tests", 6.0)
    assert c.ttl_s("tests", 10.0) == 6.0  # its own CDF: U(6) = 4 > 0
    assert c.ttl_s("tests", 5.0) == 0.0  # U(6) = -1: not worth it
    c.observe_tool("tests", -1.0)  # ignored
    c.observe_tool(None, math.inf)  # ignored


def test_queue_delay_and_eta_enter_the_benefit() -> None:
    c = ContinuumTTL()
    c.observe_wait(4.0)
    c.observe_wait(2.0)
    assert c.queue_delay_s == 3.0
    assert c.ttl_s(None, 0.0) == pytest.approx(math.log(3.0))  # B = T * 1 + 0
    for _ in range(MIN_PROGRAMS):
        c.observe_program(10)  # every program the same length: k predicts N - k exactly
    assert c.eta == pytest.approx(1.0)
    c.observe_program(1)  # a one-call program has no pairs: ignored
    mixed = ContinuumTTL()
    for n in (2, 3, 5, 8, 40, 60):
        mixed.observe_program(n)
    assert -1.0 <= mixed.eta <= 1.0
