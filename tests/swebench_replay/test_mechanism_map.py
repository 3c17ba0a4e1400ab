"""The mechanism map: every point's workloads can be drawn from the bundled traces (a point
asking more sessions than the tune part holds is tuned on all it holds), and an interrupted
map goes on from its last finished point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from talaria.cli import main
from talaria.swebench_replay import mechanism_map as mm
from talaria.swebench_replay import runs
from talaria.swebench_replay.setup import playable_sessions
from talaria.swebench_replay.split import Part


@pytest.mark.parametrize("point", mm.POINTS, ids=lambda p: p.label)
def test_every_point_draws_its_tune_and_test_workloads(point: mm.Point) -> None:
    tune, test = mm.specs(point)
    assert (tune.part, test.part) == (Part.TUNE, Part.TEST)
    assert test.sessions == point.sessions
    assert tune.calls == tune.sessions * point.calls_per_session
    for spec in (tune, test):
        replay = runs.workload(spec, 0).replay
        assert len(replay.sessions) == spec.sessions


def test_a_point_past_the_tune_part_is_tuned_on_all_the_tune_part_holds() -> None:
    room = playable_sessions(None, Part.TUNE)
    assert room == 39  # the bundled traces' tune part: sessions that fit 64K, 5+ calls
    tune, test = mm.specs(mm.Point("60 sessions", sessions=60))
    assert (tune.sessions, tune.calls) == (39, 39 * mm.CALLS_PER_SESSION)
    assert (test.sessions, test.calls) == (60, 60 * mm.CALLS_PER_SESSION)
    tune, test = mm.specs(mm.Point("60 sessions", sessions=60), synthetic=True)
    assert tune.sessions == test.sessions == 60  # synthetic sessions: as many as asked


def _row(point: mm.Point) -> dict[str, Any]:
    effect = {"value": 1.0, "ci95": [0.9, 1.1], "n": 3}
    best = {"policy": "sticky", "ratio": effect}
    return {
        "point": point.to_json(),
        "policies": {},
        "mechanisms": {m: {"p50": effect, "p95": effect} for m in mm.MECHANISMS},
        "comparison": {"best_per_request_p50": best, "best_per_request_p95": best},
    }


def test_resume_keeps_the_finished_points_and_runs_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []

    def run_point(point: mm.Point, *args: Any, **kwargs: Any) -> dict[str, Any]:
        ran.append(point.label)
        return _row(point)

    monkeypatch.setattr(mm, "run_point", run_point)
    done = {
        "seeds": [0, 1, 2],
        "tune_seeds": [0, 1],
        "rows": [_row(p) for p in mm.QUICK[:2]],
        "wall_s": 1000.0,
    }
    (tmp_path / "map.json").write_text(json.dumps(done))
    assert main(["map", "--points", "quick", "--resume", "--out", str(tmp_path)]) == 0
    assert ran == [p.label for p in mm.QUICK[2:]]
    doc = json.loads((tmp_path / "map.json").read_text())
    assert [r["point"]["label"] for r in doc["rows"]] == [p.label for p in mm.QUICK]
    assert doc["wall_s"] >= 1000.0  # the earlier run's seconds count too
    assert all(p.label in (tmp_path / "map.md").read_text() for p in mm.QUICK)

    ran.clear()  # other seeds: nothing is kept
    assert (
        main(["map", "--points", "quick", "--resume", "--seeds", "2", "--out", str(tmp_path)]) == 0
    )
    assert ran == [p.label for p in mm.QUICK]


def test_resume_keeps_a_row_only_for_the_very_same_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []
    monkeypatch.setattr(mm, "run_point", lambda p, *a, **k: ran.append(p.label) or _row(p))
    moved = attrs.evolve(mm.QUICK[0], gap_scale=2.0)  # same label, another setting
    done = {"seeds": [0, 1, 2], "tune_seeds": [0, 1], "rows": [_row(moved)]}
    (tmp_path / "map.json").write_text(json.dumps(done))
    assert main(["map", "--points", "quick", "--resume", "--out", str(tmp_path)]) == 0
    assert ran == [p.label for p in mm.QUICK]


def test_resume_refuses_a_map_json_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "map.json").write_text("{half")
    assert main(["map", "--points", "quick", "--resume", "--out", str(tmp_path)]) != 0
