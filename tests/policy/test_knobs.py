"""Each policy's tunable knobs, the grid a tuning sweeps and the rule that picks its best."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.config import PolicyConfig, SlotOrder
from talaria.errors import ConfigError
from talaria.policy.baselines import POLICIES
from talaria.policy.knobs import LOAD_CAP, QUANTUM_S, axes, best, grid, knobs_of, with_knobs
from tests.helpers import examples


def test_each_policy_sweeps_its_own_knobs_only() -> None:
    names = {name: [k for k, _ in axes(POLICIES[name])] for name in POLICIES}
    assert names["talaria"] == ["slot_starvation_s", "slot_preempt_ratio"]
    assert names["round"] == ["slot_max_s", "slot_linger_s"]  # talaria's linger, a quantum
    assert names["talaria-no-slot-order"] == ["slot_max_s", "slot_linger_s"]
    assert names["talaria-no-reserve"] == ["slot_starvation_s", "slot_preempt_ratio"]
    for per_request in ("least-loaded", "sticky", "ttl-pin", "oldest-first"):
        assert names[per_request] == ["slot_max_s"]  # work-conserving: no linger to tune
    assert names["cache-affinity"] == ["slot_max_s", "cache_affinity_load_cap"]
    assert names["serverless"] == ["slot_max_s"]
    assert names["autoscale"] == ["slot_max_s", "concurrency_target"]


def test_grid_is_the_product_in_a_fixed_order() -> None:
    g = grid(POLICIES["cache-affinity"])
    assert len(g) == len(QUANTUM_S) * len(LOAD_CAP) == 15
    assert dict(g[0]) == {"slot_max_s": 10.0, "cache_affinity_load_cap": 1.5}
    assert dict(g[1]) == {"slot_max_s": 10.0, "cache_affinity_load_cap": 2.0}
    assert dict(g[-1]) == {"slot_max_s": 1000.0, "cache_affinity_load_cap": 4.0}
    assert grid(POLICIES["cache-affinity"]) == g  # deterministic


def test_with_knobs_sets_own_knobs_and_refuses_others() -> None:
    p = with_knobs(POLICIES["sticky"], {"slot_max_s": 300.0})
    assert p.slot_max_s == 300.0 and knobs_of(p) == {"slot_max_s": 300.0}
    assert attrs.evolve(p, slot_max_s=POLICIES["sticky"].slot_max_s) == POLICIES["sticky"]
    with pytest.raises(ConfigError, match="no tunable knob"):
        with_knobs(POLICIES["sticky"], {"slot_starvation_s": 10.0})


def test_best_takes_the_lowest_p50_and_breaks_ties_by_p95() -> None:
    assert best([(100.0, 500.0), (90.0, 800.0), (120.0, 100.0)]) == 1
    # 90 and 90.5 tie (within 1%): the lower p95 wins
    assert best([(100.0, 500.0), (90.0, 800.0), (90.5, 700.0)]) == 2
    # an exact tie on both goes to the earliest in grid order
    assert best([(50.0, 60.0), (50.0, 60.0)]) == 0
    assert best([(50.0, 60.0), (50.4, 60.0)], tie=0.0) == 0


@pytest.mark.parametrize("scores", [[], [(math.nan, 1.0)], [(1.0, math.inf)], [(-1.0, 1.0)]])
def test_best_refuses_bad_scores(scores: list[tuple[float, float]]) -> None:
    with pytest.raises(ConfigError):
        best(scores)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 1e6, allow_nan=False), st.floats(0, 1e6, allow_nan=False)),
        min_size=1,
        max_size=20,
    )
)
def test_best_is_within_the_tie_of_the_minimum_and_never_beaten_inside_it(
    scores: list[tuple[float, float]],
) -> None:
    i = best(scores)
    low = min(p50 for p50, _ in scores)
    assert scores[i][0] <= low * 1.01
    tied = [s for s in scores if s[0] <= low * 1.01]
    assert scores[i][1] == min(p95 for _, p95 in tied)


def test_a_policy_without_a_quantum_order_keeps_its_defaults_on_its_grid() -> None:
    for name, p in POLICIES.items():
        on_grid = [dict(k) for k in grid(p)]
        assert knobs_of(p) in on_grid, name


def test_slot_order_and_routing_knobs_read_from_text() -> None:
    # a tuned file or a TOML config writes enum knobs as their values
    p = attrs.evolve(POLICIES["talaria"], slot_order="round-robin", routing="sticky")
    assert p.slot_order is SlotOrder.ROUND_ROBIN
    with pytest.raises(ConfigError, match="slot_order must be one of 'round-robin'"):
        PolicyConfig(name="x", slot_order="fastest")  # type: ignore[arg-type]
