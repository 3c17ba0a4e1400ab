"""The keep-alive benchmark's bookkeeping: knobs from several tuned results, reports merged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.keep_alive import PAIRS, doubling, merge, pairs_of, tuned_knobs, variants
from talaria.errors import BadRequest
from talaria.sim.pool_catalog import pool_catalog
from talaria.swebench_replay import load_sweep as ls
from talaria.swebench_replay.split import Part


def tuned(path: Path, knobs: dict[str, dict[str, Any]], instances: int = 8) -> Path:
    doc = {
        "instances": instances,
        "workload": {"sessions_per_rate": 40},
        "tuning": {
            "tuned": True,
            "part": Part.TUNE.value,
            "policies": {name: {"knobs": k} for name, k in knobs.items()},
        },
    }
    path.write_text(json.dumps(doc))
    return path


def test_knobs_come_from_the_first_result_that_tuned_each_policy(tmp_path: Path) -> None:
    setting = ls.LoadSetting(pool_catalog(), 8, 40)
    a = tuned(tmp_path / "a.json", {"talaria": {"slot_starvation_s": 100.0}})
    b = tuned(
        tmp_path / "b.json",
        {"talaria": {"slot_starvation_s": 300.0}, "autoscale": {"concurrency_target": 4}},
    )
    knobs = tuned_knobs([a, b], ["talaria", "talaria-no-reserve", "autoscale"], setting)
    assert knobs == {
        "talaria": {"slot_starvation_s": 100.0},
        "talaria-no-reserve": {"slot_starvation_s": 100.0},  # talaria's, none of its own
        "autoscale": {"concurrency_target": 4},
    }
    with pytest.raises(BadRequest, match="no tuned knobs for 'serverless'"):
        tuned_knobs([a, b], ["serverless"], setting)
    other = tuned(tmp_path / "c.json", {"serverless": {}}, instances=64)
    with pytest.raises(BadRequest, match="tuned on 64 instances"):
        tuned_knobs([a, other], ["talaria"], setting)
    with pytest.raises(BadRequest, match="tuned on 64 instances"):  # never another pool
        tuned_knobs([other], ["serverless"], setting, any_sessions=True)


def test_knobs_tuned_at_another_load_only_when_asked(tmp_path: Path) -> None:
    a = tuned(tmp_path / "a.json", {"talaria": {"slot_starvation_s": 100.0}})  # 40 a point
    setting = ls.LoadSetting(pool_catalog(), 8, 200)
    with pytest.raises(BadRequest, match="8 instances and 40 sessions a point"):
        tuned_knobs([a], ["talaria"], setting)
    knobs = tuned_knobs([a], ["talaria"], setting, any_sessions=True)
    assert knobs == {"talaria": {"slot_starvation_s": 100.0}}


def point(policy: str, keep: float | None, p95: float) -> dict[str, Any]:
    return {"policy": policy, "keep_alive_s": keep, "rate_per_s": 0.05, "sct_p95_s": p95}


def test_reports_of_one_pool_merge_and_others_are_refused() -> None:
    head = {
        "instances": 8,
        "sessions_per_point": 40,
        "seeds": [0, 1, 2],
        "provision_s": 30.0,
        "part": "test",
    }
    a = {**head, "points": [point("talaria", 0.0, 1.0), point("serverless", 10.0, 2.0)]}
    b = {**head, "points": [point("autoscale", 10.0, 3.0), point("talaria", 0.0, 9.0)]}
    merged = merge([a, b])
    assert [(p["policy"], p["sct_p95_s"]) for p in merged["points"]] == [
        ("talaria", 1.0),  # in both: the first run's
        ("serverless", 2.0),
        ("autoscale", 3.0),
    ]
    with pytest.raises(BadRequest, match="must share"):
        merge([a, {**b, "provision_s": 0.0}])
    with pytest.raises(BadRequest, match="must share"):
        merge([a, {**b, "part": "tune"}])  # a knob chosen on the tune part is not a test point


def test_a_varied_knob_replaces_its_policys_run_by_one_per_value() -> None:
    runs = variants(
        ["talaria", "autoscale", "serverless"],
        ["talaria:wake_charge_s=0,12.5", "autoscale:concurrency_target=2,64"],
    )
    assert runs == [
        ("talaria wake_charge_s=0", "talaria", {"wake_charge_s": 0.0}),
        ("talaria wake_charge_s=12.5", "talaria", {"wake_charge_s": 12.5}),
        ("autoscale concurrency_target=2", "autoscale", {"concurrency_target": 2}),
        ("autoscale concurrency_target=64", "autoscale", {"concurrency_target": 64}),
        ("serverless", "serverless", {}),
    ]
    assert isinstance(runs[2][2]["concurrency_target"], int)


@pytest.mark.parametrize(
    "spec",
    [
        "round:wake_charge_s=1",  # a policy not run
        "talaria:no_such_knob=1",
        "talaria:wake_charge_s",  # no values
        "talaria=wake_charge_s=1",
        "talaria:wake_charge_s=ten",
        "talaria:session_prefill=0",  # not a number
        "autoscale:concurrency_target=2.5",
    ],
)
def test_a_bad_vary_spec_is_refused_with_what_is_wanted(spec: str) -> None:
    with pytest.raises(BadRequest, match="--vary"):
        variants(["talaria", "autoscale"], [spec])


def test_a_varied_point_is_paired_as_its_policy_is_and_against_its_policy() -> None:
    points = [
        point("talaria", None, 1.0),
        point("talaria pack_slack=0.1", None, 1.0),
        point("talaria pack_slack=0.1", 0.0, 1.0),
        point("talaria pack_slack=0.3", None, 1.0),
        point("autoscale", None, 1.0),
    ]
    added = pairs_of(points)[len(PAIRS) :]
    assert added == [
        (("talaria pack_slack=0.1", None), ("autoscale", None)),
        (("talaria pack_slack=0.1", None), ("serverless", None)),
        (("talaria pack_slack=0.1", None), ("talaria", None)),
        (("talaria pack_slack=0.1", 0.0), ("talaria", None)),
        (("talaria pack_slack=0.1", 0.0), ("talaria-no-reserve", 0.0)),
        (("talaria pack_slack=0.1", 0.0), ("serverless", 10.0)),
        (("talaria pack_slack=0.1", 0.0), ("autoscale", 0.0)),
        (("talaria pack_slack=0.1", 0.0), ("autoscale", 10.0)),
        (("talaria pack_slack=0.1", 0.0), ("autoscale", 60.0)),
        (("talaria pack_slack=0.1", 0.0), ("talaria", 0.0)),
        (("talaria pack_slack=0.3", None), ("autoscale", None)),
        (("talaria pack_slack=0.3", None), ("serverless", None)),
        (("talaria pack_slack=0.3", None), ("talaria", None)),
        (("talaria pack_slack=0.3", None), ("talaria pack_slack=0.1", None)),  # the first
    ]


def test_doubling_rate_per_seed_and_mean_where_every_seed_doubles() -> None:
    def point(name: str, rate: float, p95s: list[float]) -> dict[str, Any]:
        seeds = [{"sct_p95_s": x} for x in p95s]
        return {
            "policy": name,
            "keep_alive_s": None,
            "rate_per_s": rate,
            "sct_p95_s": sum(p95s) / len(p95s),
            "per_seed": seeds,
        }

    doc = {
        "points": [
            point("talaria", 0.3, [300.0, 400.0]),  # out of order: sorted by rate
            point("talaria", 0.1, [100.0, 100.0]),
            point("talaria", 0.2, [150.0, 250.0]),
            point("autoscale", 0.1, [100.0, 100.0]),
            point("autoscale", 0.2, [150.0, 150.0]),
            point("autoscale", 0.3, [190.0, 200.0]),
        ]
    }
    t = doubling(doc)
    cells = [list(c._cells) for c in t.columns]
    assert cells[0] == ["talaria", "autoscale"]
    assert cells[1] == ["inf", "inf"]
    assert cells[3] == ["100", "100"]
    # seed 0: 2 x 100 reached between 0.2 (150) and 0.3 (300): 0.2 + 50/150 x 0.1
    # seed 1: between 0.1 (100) and 0.2 (250): 0.1 + 100/150 x 0.1
    assert cells[4] == ["0.233, 0.167; mean 0.2", "none, 0.3"]  # no mean: one seed never
    # the same bound for both, 2 x 100: autoscale's seed 1 reaches it at 0.3, seed 0 never
    assert cells[5] == ["0.233, 0.167; mean 0.2", "none, 0.3"]
    doc["points"][3]["sct_p95_s"] = 90.0  # autoscale's lowest p95 sets the bound: 180
    cells = [list(c._cells) for c in doubling(doc).columns]
    assert cells[5] == ["0.22, 0.153; mean 0.187", "0.275, 0.26; mean 0.268"]
