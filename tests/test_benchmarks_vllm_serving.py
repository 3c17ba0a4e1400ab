"""``benchmarks/vllm_serving.py``'s report file: a rerun adds a run and drops none."""

from __future__ import annotations

import pytest

from benchmarks.vllm_serving import with_run

REPORT = {"benchmark": "vllm_serving", "workload": "w", "cores": 2}


def _run(name: str, p50: float) -> dict[str, object]:
    return {"date": "d", "command": "c", "deployments": [{"deployment": name, "sct_p50_s": p50}]}


def test_a_rerun_appends_to_the_runs_already_there() -> None:
    first = with_run(None, REPORT, _run("vllm", 1.0))
    assert first == {**REPORT, "runs": [_run("vllm", 1.0)]}
    second = with_run(first, REPORT, _run("talaria-vllm", 2.0))
    assert second["runs"] == [_run("vllm", 1.0), _run("talaria-vllm", 2.0)]
    assert first["runs"] == [_run("vllm", 1.0)]  # the old report is not mutated


def test_a_single_run_report_of_the_old_format_becomes_the_first_run() -> None:
    old = {**REPORT, "command": "c0", "deployments": [{"deployment": "x"}]}
    doc = with_run(old, REPORT, _run("y", 3.0))
    assert doc["runs"] == [{"command": "c0", "deployments": [{"deployment": "x"}]}, _run("y", 3.0)]
    assert "deployments" not in doc


def test_runs_of_another_workload_are_not_mixed_in() -> None:
    with pytest.raises(SystemExit, match="another workload"):
        with_run({**REPORT, "workload": "other", "runs": []}, REPORT, _run("y", 3.0))
