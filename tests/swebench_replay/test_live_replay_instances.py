"""The embedded replay on several instances: each instance its own engine, run side by side
in real time, the torch threads split among them, and the simulator predicting the same
multi-instance run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import talaria.swebench_replay.live_replay as live_replay
from talaria.calibration.cache import CalibrationMode
from talaria.errors import ConfigError
from talaria.policy.baselines import POLICIES
from talaria.sim.simulator import SimResult
from talaria.swebench_replay.live_replay import EmbeddedOptions, ReplayHooks, run_embedded_replay
from tests.swebench_replay.test_live_replay_calibration import MB, MODELS, _tiny_load, tiny_workload


def _options(instances: int, cache: Path) -> EmbeddedOptions:
    fast = {"slot_max_s": 0.5, "slot_linger_s": 0.05}
    return EmbeddedOptions(
        (attrs.evolve(POLICIES["talaria"], **fast), attrs.evolve(POLICIES["round"], **fast)),
        models=MODELS,
        instances=instances,
        device_memory_bytes=4 * MB,
        host_memory_bytes=8 * MB,
        dtype=torch.float32,
        gap_scale=0.02,
        calibration=CalibrationMode.SHIPPED,
        cache_dir=cache,
    )


def test_two_instances_serve_the_replay_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workload = tiny_workload(4, 20)
    monkeypatch.setattr(live_replay, "_load", _tiny_load)
    threads_seen: list[int] = []
    real_play = live_replay._play

    async def play(*args: Any) -> Any:
        threads_seen.append(torch.get_num_threads())
        return await real_play(*args)

    monkeypatch.setattr(live_replay, "_play", play)
    runs: dict[str, SimResult] = {}
    threads = torch.get_num_threads()
    doc = run_embedded_replay(
        workload.replay,
        _options(2, tmp_path),
        workload.tool_table,
        ReplayHooks(result=runs.__setitem__),
    )
    assert torch.get_num_threads() == threads  # the split is undone afterwards
    share = max(1, threads // 2)
    assert threads_seen == [share, share]
    assert doc["engine"]["torch_threads_per_instance"] == share
    assert [i["name"] for i in doc["instances"]] == ["cpu-0", "cpu-1"]
    for name in ("talaria", "round"):
        assert doc["policies"][name]["calls"] == workload.replay.n_calls
        assert {r.instance for r in runs[name].calls} <= {"cpu-0", "cpu-1"}
        assert "predicted_sct_p50_s" in doc["fidelity"][name]
        # the measured schedule beside the predicted one: the same sessions, models, starts
        measured, predicted = (doc["schedules"][name][k] for k in ("measured", "predicted"))
        assert measured["sessions"].keys() == predicted["sessions"].keys()
        assert len(measured["sessions"]) == 4
        for sid, (model, start, end) in measured["sessions"].items():
            assert predicted["sessions"][sid][0] == model and end > start
        assert measured["slots"] == [
            [r.instance, r.model, r.switch_s, r.open_s, r.until_s] for r in runs[name].slots
        ]
        assert {s[0] for s in predicted["slots"]} <= {"cpu-0", "cpu-1"} and predicted["slots"]
    # with one model per instance to be had, the routers use both instances
    assert {r.instance for r in runs["talaria"].calls} == {"cpu-0", "cpu-1"}
    # the schedule references beside the measured policies, simulated on the same cluster
    for ref in ("isolated", "model-serial"):
        entry = doc["policies"][ref]
        assert entry["reference"] is True and entry["simulated"] is True
        assert entry["calls"] == workload.replay.n_calls and ref not in runs
    serial = doc["policies"]["model-serial"]["sct_p50_s"]
    talaria = doc["policies"]["talaria"]
    assert talaria["sct_p50_over_model-serial"] == pytest.approx(talaria["sct_p50_s"] / serial)


@pytest.mark.parametrize("bad", [0, -1, live_replay.MAX_INSTANCES + 1])
def test_instance_counts_out_of_range_are_refused(bad: int, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--instances"):
        _options(bad, tmp_path)
