"""The tuning protocol: each policy's best knobs chosen on the tune part only, cached by
everything they depend on, and a comparison that never runs on the tune part."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from talaria.errors import ConfigError
from talaria.policy.baselines import POLICIES
from talaria.policy.knobs import grid
from talaria.sim.catalog import paper_cluster
from talaria.swebench_replay import runs as runs_module
from talaria.swebench_replay import setup as workload_setup
from talaria.swebench_replay.compare import comparison_runs
from talaria.swebench_replay.runs import Setting, WorkloadSpec
from talaria.swebench_replay.split import Part
from talaria.swebench_replay.tuning import (
    cache_key,
    choose,
    from_document,
    read_cached,
    to_document,
    tune,
    tuned_policies,
    tuning_runs,
    write_cached,
)

SMALL = {"synthetic": True, "sessions": 3, "calls": 15}
SETTING = Setting(paper_cluster(1))


def test_no_tuning_step_reads_the_test_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every workload a tuning builds is drawn from the tune part, whatever it tunes."""
    parts: list[Part] = []
    real = workload_setup.select_part

    def spy(sessions, part):  # type: ignore[no-untyped-def]
        parts.append(part)
        return real(sessions, part)

    monkeypatch.setattr(workload_setup, "select_part", spy)
    runs_module.workload.cache_clear()
    policies = [POLICIES["talaria"], POLICIES["sticky"]]
    tuned = tune(WorkloadSpec(part=Part.TUNE, **SMALL), SETTING, policies, seeds=(0, 1))
    assert parts and set(parts) == {Part.TUNE}
    assert set(tuned) == {"talaria", "sticky"}
    for name, t in tuned.items():
        assert [dict(x.knobs) for x in t.trials] == [dict(k) for k in grid(POLICIES[name])]
        assert all(len(x.p50_s) == 2 for x in t.trials)
        assert t.knobs in [x.knobs for x in t.trials]
    runs_module.workload.cache_clear()


@pytest.mark.parametrize("part", [Part.TEST, Part.ALL])
def test_a_tuning_refuses_any_part_but_tune(part: Part) -> None:
    with pytest.raises(ConfigError, match="tune part only"):
        tuning_runs(WorkloadSpec(part=part, **SMALL), SETTING, [POLICIES["talaria"]])


def test_a_comparison_refuses_the_tune_part() -> None:
    with pytest.raises(ConfigError, match="never runs on the tune part"):
        comparison_runs(WorkloadSpec(part=Part.TUNE, **SMALL), SETTING, [POLICIES["talaria"]])


def test_the_chosen_knobs_are_the_best_trial_and_apply() -> None:
    policies = [POLICIES["sticky"]]
    runs = tuning_runs(WorkloadSpec(part=Part.TUNE, **SMALL), SETTING, policies, seeds=(0,))
    fake = [
        runs_module.Outcome(r, {"sticky": {"sct_p50_s": p50, "sct_p95_s": 1.0}})
        for r, p50 in zip(runs, [50.0, 40.0, 30.0, 30.1, 60.0], strict=True)
    ]
    tuned = choose(policies, (0,), fake)
    assert dict(tuned["sticky"].knobs) == {"slot_max_s": 100.0}  # 30.0 < 30.1, p95 tied
    (p,) = tuned_policies(policies, tuned)
    assert p.slot_max_s == 100.0 and attrs.evolve(p, slot_max_s=30.0) == POLICIES["sticky"]
    with pytest.raises(ConfigError, match="no tuning for"):
        tuned_policies([POLICIES["round"]], tuned)


def test_a_tuning_document_round_trips_and_caches(tmp_path: Path) -> None:
    spec = WorkloadSpec(part=Part.TUNE, **SMALL)
    policies = [POLICIES["sticky"]]
    key = cache_key(spec, SETTING, policies, (0,))
    assert key == cache_key(spec, SETTING, policies, (0,))  # stable
    assert key != cache_key(spec, SETTING, policies, (0, 1))
    assert key != cache_key(attrs.evolve(spec, sessions=4), SETTING, policies, (0,))
    assert key != cache_key(spec, attrs.evolve(SETTING, gap_scale=2.0), policies, (0,))
    tuned = tune(spec, SETTING, policies, seeds=(0,))
    doc = to_document(tuned, key, (0,))
    assert read_cached(key, tmp_path) is None
    write_cached(doc, tmp_path)
    assert from_document(read_cached(key, tmp_path) or {}) == tuned
    with pytest.raises(ConfigError, match="not a tuning document"):
        from_document({"policies": {"x": {"knobs": {}}}})
