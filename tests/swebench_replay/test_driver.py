"""The replay driver end to end through the simulator, on a short synthetic replay."""

from __future__ import annotations

import json
from typing import Any

import pytest

from talaria.errors import ConfigError
from talaria.policy.baselines import policy
from talaria.swebench_replay.driver import (
    ReplayOptions,
    cluster_for,
    run_replay,
    simulate,
    to_scripts,
)
from talaria.swebench_replay.setup import Workload, load_workload

N_SESSIONS = 5
TARGET_CALLS = 50
SEED = 3

POLICY_KEYS: dict[str, type | tuple[type, ...]] = {
    "sessions": int,
    "calls": int,
    "sct_p50_s": float,
    "sct_p95_s": float,
    "sct_mean_s": float,
    "ttft_p50_s": float,
    "ttft_p95_s": float,
    "prefix_reused_tokens": int,
    "restored_tokens": int,
    "recomputed_tokens": int,
    "bytes_moved": int,
    "model_switches": int,
    "sp_admissions": int,
}


def _workload() -> Workload:
    return load_workload(
        synthetic=True, n_sessions=N_SESSIONS, target_calls=TARGET_CALLS, seed=SEED
    )


def _options(**kw: Any) -> ReplayOptions:
    return ReplayOptions((policy("talaria"), policy("round")), **kw)


@pytest.fixture(scope="module")
def workload() -> Workload:
    return _workload()


@pytest.fixture(scope="module")
def results(workload: Workload) -> dict[str, Any]:
    return run_replay(workload.replay, _options(), workload.tool_table)


def _is(value: object, kind: type | tuple[type, ...]) -> bool:
    # bool is an int subclass; no figure of the results format is a bool
    return isinstance(value, kind) and not isinstance(value, bool)


def test_results_document_has_the_design_format(
    workload: Workload, results: dict[str, Any]
) -> None:
    assert results["substrate"] == "sim"
    assert results["hardware"] == "h200-tp8"
    wl = results["workload"]
    assert isinstance(wl["trace"], str) and wl["trace"]
    assert _is(wl["sessions"], int) and wl["sessions"] == N_SESSIONS
    assert _is(wl["calls"], int) and wl["calls"] == workload.replay.n_calls
    assert isinstance(wl["models"], list) and wl["models"]
    assert all(isinstance(m, str) for m in wl["models"])
    assert _is(wl["seed"], int) and wl["seed"] == SEED
    assert wl["arrival"] == "all"
    assert set(results["policies"]) == {
        "talaria",
        "round",
        "talaria-no-hints",  # the same sessions without hints: the server learns the gaps
        "isolated",
        "model-serial",
    }
    assert results["policies"]["talaria-no-hints"]["hints"] is False
    refs = {n for n, e in results["policies"].items() if e.get("reference")}
    assert refs == {"isolated", "model-serial"}
    for name, entry in results["policies"].items():
        for key, kind in POLICY_KEYS.items():
            assert key in entry, f"{name} lacks {key}"
            assert _is(entry[key], kind), f"{name}.{key} = {entry[key]!r} is not {kind}"
        assert entry["sct_p50_s"] <= entry["sct_p95_s"]
        assert entry["ttft_p50_s"] <= entry["ttft_p95_s"]
        assert entry["sct_p50_s"] > 0
    # the document is plain JSON
    assert json.loads(json.dumps(results)) == results


def test_every_call_answered_once(workload: Workload, results: dict[str, Any]) -> None:
    n_calls = workload.replay.n_calls
    assert n_calls == TARGET_CALLS == 50
    for entry in results["policies"].values():
        assert entry["calls"] == n_calls == results["workload"]["calls"]
        assert entry["sessions"] == N_SESSIONS
        assert len(entry["session_sct_s"]) == N_SESSIONS


def test_round_over_itself_is_one(results: dict[str, Any]) -> None:
    r = results["policies"]["round"]
    assert r["speedup_p50_vs_round"] == 1.0
    assert r["speedup_p95_vs_round"] == 1.0
    assert r["speedup_mean_vs_round"] == 1.0
    t = results["policies"]["talaria"]
    assert t["speedup_p50_vs_round"] == pytest.approx(r["sct_p50_s"] / t["sct_p50_s"])


@pytest.mark.parametrize("name", ["talaria", "round"])
def test_session_sct_at_least_its_tool_time(workload: Workload, name: str) -> None:
    scripts = to_scripts(workload.replay, workload.tool_table)
    tool_s = {s.session_id: sum(c.tool_seconds for c in s.calls) for s in scripts}
    result = simulate(workload.replay, scripts, policy(name), cluster_for("h200-tp8", 1))
    assert {s.session_id for s in result.sessions} == set(tool_s)
    assert sorted((c.session_id, c.index) for c in result.calls) == sorted(
        (s.session_id, i) for s in scripts for i in range(len(s.calls))
    )
    for s in result.sessions:
        assert s.sct_s >= tool_s[s.session_id] - 1e-9
        assert s.tool_s == pytest.approx(tool_s[s.session_id])
    assert any(v > 0 for v in tool_s.values())


def test_same_arguments_give_identical_json(results: dict[str, Any]) -> None:
    again_wl = _workload()
    again = run_replay(again_wl.replay, _options(), again_wl.tool_table)
    assert json.dumps(again, sort_keys=False) == json.dumps(results, sort_keys=False)


def test_progress_reports_every_call(workload: Workload) -> None:
    seen: dict[str, int] = {}

    def on_progress(name: str, n: int) -> None:
        assert n >= seen.get(name, 0)
        seen[name] = n

    run_replay(workload.replay, _options(), workload.tool_table, on_progress)
    assert seen == {"talaria": workload.replay.n_calls, "round": workload.replay.n_calls}


def test_gap_scale_scales_tool_seconds(workload: Workload) -> None:
    base = to_scripts(workload.replay, workload.tool_table)
    scaled = to_scripts(workload.replay, workload.tool_table, gap_scale=2.5)
    assert len(base) == len(scaled) == N_SESSIONS
    for b, s, rs in zip(base, scaled, workload.replay.sessions, strict=True):
        assert b.session_id == s.session_id == rs.session_id
        assert b.model == s.model and b.start_s == s.start_s
        for bc, sc, rc in zip(b.calls, s.calls, rs.calls, strict=True):
            assert bc.tool_seconds == rc.tool_seconds
            assert sc.tool_seconds == pytest.approx(2.5 * rc.tool_seconds)
            # the hint is the tool kind's typical time where the client runs: in a world
            # whose tools take 2.5x as long, the client's typical times are 2.5x too (it is
            # still a prediction: the kind's median, never this call's own time)
            assert sc.hint_s == pytest.approx(2.5 * bc.hint_s)
            assert sc.output_tokens == sc.max_new_tokens == rc.output_tokens
            assert sc.prompt is rc.prompt and sc.history is rc.history


def test_gap_scale_option_reaches_results(workload: Workload) -> None:
    doc = run_replay(workload.replay, _options(gap_scale=0.5), workload.tool_table)
    assert doc["workload"]["gap_scale"] == 0.5
    assert doc["policies"]["round"]["calls"] == workload.replay.n_calls


def test_hints(workload: Workload) -> None:
    with_hints = to_scripts(workload.replay, workload.tool_table, hints=True)
    without = to_scripts(workload.replay, workload.tool_table, hints=False)
    for script in without:
        assert all(c.hint_s is None for c in script.calls)
    for script, rs in zip(with_hints, workload.replay.sessions, strict=True):
        for c, rc in zip(script.calls, rs.calls, strict=True):
            assert c.hint_s == workload.tool_table.dist(rc.tool_kind).median
            assert c.tool_kind == rc.tool_kind.value


def test_no_hints_replay_runs(workload: Workload) -> None:
    doc = run_replay(workload.replay, _options(hints=False), workload.tool_table)
    assert doc["workload"]["hints"] is False
    assert doc["policies"]["talaria"]["calls"] == workload.replay.n_calls


def test_cluster_for_rejects_unknown_hardware() -> None:
    with pytest.raises(ConfigError, match="a100"):
        cluster_for("a100", 1)
    assert cluster_for("h200-tp8", 1).instances


def test_run_replay_rejects_unknown_hardware(workload: Workload) -> None:
    with pytest.raises(ConfigError, match="h200-tp8"):
        run_replay(workload.replay, _options(hardware="mi300"), workload.tool_table)


def test_replay_options_validation() -> None:
    with pytest.raises(ConfigError, match="at least one policy"):
        ReplayOptions(())
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="gap_scale"):
            _options(gap_scale=bad)


def test_references_are_computed_beside_the_policies(
    workload: Workload, results: dict[str, Any]
) -> None:
    """isolated: each session alone; model-serial: the groups one after another, shortest
    first, so the first group's sessions finish as in their group's run alone and every
    session of a later group finishes after the whole earlier group."""
    pol = results["policies"]
    iso, serial = pol["isolated"], pol["model-serial"]
    assert iso["reference_policy"] == serial["reference_policy"] == "talaria"
    assert iso["calls"] == serial["calls"] == workload.replay.n_calls
    assert iso["sct_p50_s"] <= serial["sct_p50_s"] and iso["sct_p95_s"] <= serial["sct_p95_s"]
    for name in ("talaria", "round"):
        assert pol[name]["sct_p50_over_model-serial"] == pytest.approx(
            pol[name]["sct_p50_s"] / serial["sct_p50_s"]
        )
        assert pol[name]["sct_p50_over_isolated"] >= 1.0  # nothing beats a session alone
    assert serial["sct_p50_over_model-serial"] == 1.0


def serial_setup(workload: Workload) -> tuple[list[Any], Any, dict[str, list[Any]]]:
    """The workload's scripts, a function simulating a part of them alone under talaria on
    one H200 server, and the scripts grouped by model."""
    scripts = to_scripts(workload.replay, workload.tool_table)
    cluster = cluster_for("h200-tp8", 1)

    def alone(part: Any) -> Any:
        return simulate_scripts(part, cluster)

    groups: dict[str, list[Any]] = {}
    for sc in scripts:
        groups.setdefault(sc.model, []).append(sc)
    return scripts, alone, groups


def test_model_serial_orders_groups_by_makespan(workload: Workload) -> None:
    from talaria.swebench_replay.references import model_serial

    scripts, alone, groups = serial_setup(workload)
    makespans = sorted((alone(g).end_s, m) for m, g in groups.items())
    result = model_serial(scripts, alone)
    ends = {s.session_id: s.end_s for s in result.sessions}
    offset = 0.0
    for makespan, model in makespans:
        own = alone(groups[model])
        for s in own.sessions:
            assert ends[s.session_id] == pytest.approx(s.end_s + offset)
        offset += makespan
    assert result.end_s == pytest.approx(offset)


def test_model_serial_runs_the_groups_in_a_given_order(workload: Workload) -> None:
    from talaria.errors import BadRequest
    from talaria.swebench_replay.references import model_serial

    scripts, alone, groups = serial_setup(workload)
    order = sorted(groups, reverse=True)
    result = model_serial(scripts, alone, order)
    ends = {s.session_id: s.end_s for s in result.sessions}
    offset = 0.0
    for model in order:
        own = alone(groups[model])
        for s in own.sessions:
            assert ends[s.session_id] == pytest.approx(s.end_s + offset)
        offset += own.end_s
    assert result.end_s == pytest.approx(offset)
    for bad in (order[:-1], [*order, order[0]], [*order[:-1], "no-such-model"]):
        with pytest.raises(BadRequest, match="every model of the workload once"):
            model_serial(scripts, alone, bad)


def simulate_scripts(part: Any, cluster: Any) -> Any:
    from talaria.sim.simulator import Simulator
    from talaria.swebench_replay.driver import estimators_for

    return Simulator(cluster, policy("talaria"), estimators_for(cluster)).run(part)
