"""Regression: on a small seeded simulated workload (9 synthetic sessions, 180 calls, three
paper-scale models on one TP8 server), Talaria's session-aware slot order beats ``round``
and the best per-request baseline at p50 and p95. Deterministic: exact figures."""

from __future__ import annotations

from typing import Any

import pytest

from talaria.policy.baselines import BASELINES, POLICIES
from talaria.swebench_replay.driver import ReplayOptions, run_replay
from talaria.swebench_replay.setup import load_workload


@pytest.fixture(scope="module")
def policies() -> dict[str, Any]:
    w = load_workload(synthetic=True, n_sessions=9, target_calls=180, seed=1)
    return run_replay(w.replay, ReplayOptions(tuple(POLICIES.values())), w.tool_table)["policies"]


def test_talaria_beats_round_and_every_per_request_baseline(policies: dict[str, Any]) -> None:
    t = policies["talaria"]
    assert (t["sct_p50_s"], t["sct_p95_s"]) == pytest.approx((85.509, 160.111), abs=1e-3)
    r = policies["round"]
    assert (r["sct_p50_s"], r["sct_p95_s"]) == pytest.approx((229.127, 252.572), abs=1e-3)
    best = min((policies[b] for b in BASELINES), key=lambda e: e["sct_p50_s"])
    assert (best["sct_p50_s"], best["sct_p95_s"]) == pytest.approx((128.504, 168.215), abs=1e-3)
    for name in BASELINES:
        assert t["sct_p50_s"] < policies[name]["sct_p50_s"]
        assert t["sct_p95_s"] < policies[name]["sct_p95_s"]


def test_the_slot_order_is_where_the_gain_comes_from(policies: dict[str, Any]) -> None:
    """The ablation with round-robin slots loses most of the p50 gain; the model-serial
    reference is the bound talaria approaches."""
    off = policies["talaria-no-slot-order"]
    assert (off["sct_p50_s"], off["sct_p95_s"]) == pytest.approx((112.012, 166.47), abs=1e-3)
    serial = policies["model-serial"]
    assert (serial["sct_p50_s"], serial["sct_p95_s"]) == pytest.approx((86.178, 161.362), abs=1e-3)
    assert policies["talaria"]["sct_p50_over_model-serial"] <= 1.0
