"""The live pool in miniature: open-loop arrivals on embedded instances whose host weight
budget holds one model of three, so cold starts read weight files from disk, and the
simulator's prediction of the same run."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from talaria.calibration.cache import CalibrationMode
from talaria.errors import BadRequest
from talaria.policy.baselines import POLICIES
from talaria.policy.rounds import SlotClose
from talaria.swebench_replay.live_pool import LivePool, run_live_pool

MODELS = ("llama-mini-dummy", "qwen2-tiny-dummy", "smollm2-tiny-dummy")
MB = 10**6


def _pool(**changes: object) -> LivePool:
    fast = attrs.evolve(POLICIES["talaria"], slot_max_s=0.5, slot_linger_s=0.05)
    pool = LivePool(
        (fast,),
        models=MODELS,
        instances=2,
        sessions=2,
        rate_per_s=2.0,
        token_scale=0.01,
        gap_scale=0.01,
        seed=0,  # llama-mini (on host) and smollm2-tiny (on disk), 63 calls
        device_memory_bytes=50 * MB,
        host_memory_bytes=60 * MB,  # weights: the largest model's 31.5 MB, the rest host KV
        host_weight_share=0.5,
        calibration=CalibrationMode.SHIPPED,
    )
    return attrs.evolve(pool, **changes)


def test_cold_starts_read_the_weight_files_and_the_run_is_predicted(tmp_path: Path) -> None:
    doc = run_live_pool(_pool(), tmp_path)
    run = doc["policies"]["talaria"]
    measured, predicted = run["measured"], run["predicted"]
    used = {a["model"] for a in doc["workload"]["arrivals"]}
    assert used - {MODELS[0]}, "the seed draws a model that starts on disk"
    # llama-mini fills the host budget; the tiny models start on disk: each of their first
    # slots on an instance is a cold start, one file read apiece
    assert measured["cold_loads"] >= 1
    # a read started per cold load (whole, or stopped by a cancelled stage), plus the reads
    # a switch redid on the step thread for a stage's stopped read
    started = measured["disk_reads"] + measured["disk_reads_stopped"]
    assert started == measured["cold_loads"] + measured["sync_reads"]
    assert measured["disk_bytes_read"] >= min(doc["catalog"]["weight_bytes"][m] for m in MODELS)
    assert predicted["cold_loads"] >= 1
    assert measured["sessions"] == predicted["sessions"] == 2
    assert measured["calls"] == predicted["calls"] == doc["workload"]["calls"]
    # both sides carry the slots' closes by reason (every switch but each instance's first
    # ends a closing slot; the exact count is checked in tests/sim/test_simulator.py)
    for side in (measured, predicted):
        closes = [side[f"slot_closes_{why.value}"] for why in SlotClose]
        assert sum(closes) >= side["model_switches"] - len(doc["instances"])
    assert set(run["fidelity"]) >= {"error_sct_p95_s", "measured_sct_p95_s"}
    assert sorted(tmp_path.iterdir()) == [tmp_path / f"{m}.safetensors" for m in sorted(MODELS)]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rate_per_s": 0.0}, "rate"),
        ({"sessions": 0}, "at least one session"),
        ({"token_scale": 0.0}, "token_scale"),
        ({"gap_scale": 1.5}, "gap_scale"),
    ],
)
def test_bad_settings_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        _pool(**changes)
