"""The real-engine replay player on tiny random-weight models (fast), against the simulator."""

from __future__ import annotations

import anyio

from talaria.swebench_replay.driver import to_scripts
from talaria.swebench_replay.live_replay import _play, _references, _simulate, step_breakdown
from talaria.swebench_replay.metrics import check_conservation, policy_summary
from talaria.swebench_replay.setup import load_workload
from tests.helpers import tiny_cluster


def test_live_replay_answers_every_call_once_and_reuses_prefixes() -> None:
    workload = load_workload(
        synthetic=True,
        n_sessions=3,
        target_calls=15,
        seed=1,
        models=("llama-tiny", "qwen-tiny"),
        max_context=240,
        token_scale=0.01,
        vocab_size=128,
    )
    replay = workload.replay
    scripts = to_scripts(replay, workload.tool_table, gap_scale=0.02)
    cluster = tiny_cluster(device_bytes=4 * 10**6)
    ticks: list[int] = []
    result, steps = anyio.run(_play, cluster, scripts, "talaria", ticks.append)
    tool_s = {s.session_id: sum(c.tool_seconds for c in s.calls) for s in scripts}
    check_conservation(result, replay.n_calls, tool_s)
    assert ticks == list(range(1, replay.n_calls + 1))
    summary = policy_summary(result)
    assert summary["calls"] == replay.n_calls and summary["sessions"] == 3
    # teacher-forced answers: every call produced exactly the trace's answer length
    by_key = {(s.session_id, i): c for s in scripts for i, c in enumerate(s.calls)}
    for rec in result.calls:
        assert rec.output_tokens == by_key[(rec.session_id, rec.index)].output_tokens
    later = [r for r in result.calls if r.index > 0]
    assert sum(r.reused_tokens + r.restored_tokens for r in later) > 0
    kinds = step_breakdown(steps)
    assert kinds["prefill"]["count"] > 0 and kinds["switch"]["count"] >= 1
    assert all(row["predicted_s"] > 0 for row in kinds.values() if row["count"])
    predicted = _simulate(cluster, cluster.core.policy, scripts)
    assert len(predicted.calls) == replay.n_calls
    refs = _references(cluster, scripts)
    assert sorted(refs) == ["isolated", "model-serial"]
    for entry in refs.values():
        assert entry["reference"] is True and entry["simulated"] is True
        assert entry["calls"] == replay.n_calls and entry["sessions"] == 3
    assert refs["isolated"]["sct_p50_s"] <= refs["model-serial"]["sct_p50_s"]
