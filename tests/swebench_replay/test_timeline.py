"""The replay timeline: the timings it draws from (per call, per slot) and the PNG it makes.

The timings are checked exactly on a hand-sized workload priced with round-number costs,
and for their invariants on simulated replays (one and two instances) and on the real-engine
player with tiny random-weight models.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import anyio
import pytest

from talaria.cli import main
from talaria.config import ClusterConfig, InstanceSpec
from talaria.policy.baselines import POLICIES, policy
from talaria.sim.simulator import CallRecord, SimResult, Simulator, SlotRecord
from talaria.swebench_replay.driver import ReplayOptions, run_replay, to_scripts
from talaria.swebench_replay.live_replay import _play
from talaria.swebench_replay.setup import load_workload
from talaria.swebench_replay.timeline import plot_timeline, timeline_policies
from talaria.types import ScriptedCall, SessionScript, TokenSeq
from tests.helpers import RoundNumberEstimator, tiny_cluster, tiny_spec

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EPS = 1e-9


# ---------------------------------------------------------------------- a hand-sized run
def _session(sid: str, model: str, n_calls: int, base: int) -> SessionScript:
    """Calls of a 40-token first prompt, 2-token answers, 8 new tokens per turn, 0.5 s
    tools; token ids from ``base`` up, so sessions share no KV."""
    fresh = itertools.count(base)
    prompt = TokenSeq(next(fresh) for _ in range(40))
    calls = []
    for i in range(n_calls):
        history = prompt.extend(next(fresh) for _ in range(2))
        tool = 0.5 if i < n_calls - 1 else 0.0
        calls.append(ScriptedCall(prompt, history, 2, 4, tool, "bash", None))
        prompt = history.extend(next(fresh) for _ in range(8))
    return SessionScript(sid, model, 0.0, tuple(calls))


def _tiny_run() -> SimResult:
    """Session ``a`` (model A, two calls) and ``b`` (model B, one call), both at t=0, on
    one instance whose device holds one model's 1000-byte weights, under ``round``."""
    spec = InstanceSpec(
        name="tiny",
        hardware="fake",
        device_memory_bytes=1000 + 96 * 128,
        host_memory_bytes=2000 + 128 * 128,
        block_size=4,
        memory_utilization=1.0,
    )
    cluster = ClusterConfig(models=(tiny_spec("A"), tiny_spec("B")), instances=(spec,))
    sim = Simulator(cluster, POLICIES["round"], {"tiny": RoundNumberEstimator()})
    return sim.run([_session("a", "A", 2, 1_000_000), _session("b", "B", 1, 2_000_000)])


def test_tiny_run_records_exact_slot_and_call_times() -> None:
    """Round-number costs: a weight copy 1000 B / 1e9 B/s = 1 us, prefill 1000 tok/s, one
    decode step 10 ms. A's slot opens first (its call arrived first); B's call waits for
    A's to finish; A's second call arrives after its 0.5 s tool and waits for the switch
    back; it reuses the 40 tokens of its first prompt and prefills the other 10."""
    r = _tiny_run()
    us = 1e-6
    slots = [(s.instance, s.model) for s in r.slots]
    assert slots == [("tiny", "A"), ("tiny", "B"), ("tiny", "A")]
    times = [(s.switch_s, s.open_s, s.until_s) for s in r.slots]
    assert times == [  # switch began, slot opened, next switch began (or the run ended)
        pytest.approx((0.0, us, 0.05 + us), abs=1e-12),
        pytest.approx((0.05 + us, 0.05 + 2 * us, 0.55 + us), abs=1e-12),
        pytest.approx((0.55 + us, 0.55 + 2 * us, 0.57 + 2 * us), abs=1e-12),
    ]
    calls = {(c.session_id, c.index): c for c in r.calls}
    expected = {  # arrival, admitted (= start), first token, finish
        ("a", 0): (0.0, us, 0.04 + us, 0.05 + us),
        ("b", 0): (0.0, 0.05 + 2 * us, 0.09 + 2 * us, 0.10 + 2 * us),
        ("a", 1): (0.55 + us, 0.55 + 2 * us, 0.56 + 2 * us, 0.57 + 2 * us),
    }
    for key, want in expected.items():
        c = calls[key]
        got = (c.arrival_s, c.admitted_s, c.first_token_s, c.finish_s)
        assert got == pytest.approx(want, abs=1e-12), key
    assert calls[("a", 1)].reused_tokens == 40 and calls[("a", 1)].prompt_tokens == 50
    # b waits out A's whole first call; a's second call waits for the switch back only
    assert calls[("b", 0)].admitted_s - calls[("b", 0)].arrival_s == pytest.approx(0.05 + 2 * us)
    assert calls[("a", 1)].admitted_s - calls[("a", 1)].arrival_s == pytest.approx(us)
    assert r.end_s == pytest.approx(0.57 + 2 * us, abs=1e-12)
    assert len(r.slots) == r.counters["model_switches"] == 3
    check_timings(r)


# ---------------------------------------------------------------------- invariants
def check_timings(r: SimResult, tool_s: dict[tuple[str, int], float] | None = None) -> None:
    """What the timeline relies on: every call's wait is non-negative and its times are
    ordered; one session's calls never overlap (the next arrives ``tool_s`` after the
    last finished, when given); one instance's slots are contiguous and disjoint; every
    call runs inside one slot of its own model on its own instance."""
    for c in r.calls:
        assert c.arrival_s - EPS <= c.admitted_s <= c.first_token_s + EPS
        assert c.first_token_s <= c.finish_s + EPS and c.finish_s <= r.end_s + EPS
    by_session: dict[str, list[CallRecord]] = {}
    for c in r.calls:
        by_session.setdefault(c.session_id, []).append(c)
    for calls in by_session.values():
        calls.sort(key=lambda c: c.index)
        for prev, nxt in itertools.pairwise(calls):
            assert nxt.arrival_s >= prev.finish_s - EPS
            if tool_s is not None:
                gap = tool_s[(prev.session_id, prev.index)]
                assert nxt.arrival_s == pytest.approx(prev.finish_s + gap, abs=1e-6)
    by_instance: dict[str, list[SlotRecord]] = {}
    for s in r.slots:
        assert s.switch_s <= s.open_s <= s.until_s + EPS
        by_instance.setdefault(s.instance, []).append(s)
    for slots in by_instance.values():
        for before, after in itertools.pairwise(slots):
            assert after.switch_s == pytest.approx(before.until_s, abs=1e-9)
        assert slots[-1].until_s == pytest.approx(r.end_s)
    for c in r.calls:
        home = [
            s
            for s in by_instance.get(c.instance, [])
            if s.open_s - EPS <= c.admitted_s and c.finish_s <= s.until_s + EPS
        ]
        assert len(home) == 1, c
        assert home[0].model == c.model


def _replay(n_instances: int, names: str) -> tuple[dict[str, Any], dict[str, SimResult], Any]:
    workload = load_workload(synthetic=True, n_sessions=5, target_calls=40, seed=2)
    runs: dict[str, SimResult] = {}
    options = ReplayOptions(
        tuple(policy(n) for n in names.split(",")), n_instances=n_instances, references=False
    )
    doc = run_replay(workload.replay, options, workload.tool_table, on_result=runs.__setitem__)
    return doc, runs, workload


@pytest.mark.parametrize("n_instances", [1, 2])
def test_simulated_replay_timings_hold_together(n_instances: int) -> None:
    doc, runs, workload = _replay(n_instances, "talaria,round,least-loaded")
    assert set(runs) == {"talaria", "round", "least-loaded", "talaria-no-hints"}
    scripts = {
        s.session_id: s for s in to_scripts(workload.replay, workload.tool_table, hints=True)
    }
    tool_s = {(sid, i): c.tool_seconds for sid, s in scripts.items() for i, c in enumerate(s.calls)}
    for name, r in runs.items():
        assert len(r.calls) == doc["policies"][name]["calls"] == workload.replay.n_calls
        assert len(r.slots) == doc["policies"][name]["model_switches"] > 0
        check_timings(r, tool_s)
        for s in r.sessions:  # each session's first call arrives at its start
            first = min((c for c in r.calls if c.session_id == s.session_id), key=lambda c: c.index)
            assert first.arrival_s == pytest.approx(s.start_s)


def test_live_replay_records_slots_the_calls_ran_in() -> None:
    workload = load_workload(
        synthetic=True,
        n_sessions=2,
        target_calls=10,
        seed=1,
        models=("llama-tiny", "qwen-tiny"),
        max_context=240,
        token_scale=0.01,
        vocab_size=128,
    )
    scripts = to_scripts(workload.replay, workload.tool_table, gap_scale=0.02)
    result, _ = anyio.run(_play, tiny_cluster(device_bytes=4 * 10**6), scripts, "round", _no_tick)
    assert len(result.calls) == workload.replay.n_calls
    assert result.slots and len(result.slots) == result.counters["model_switches"]
    assert result.slots[0].switch_s >= 0.0
    check_timings(result)


def _no_tick(_n: int) -> None:
    return None


# ---------------------------------------------------------------------- which panels
def _doc(**p50: float) -> dict[str, Any]:
    policies = {n: {"sct_p50_s": v, "sct_mean_s": v} for n, v in p50.items()}
    policies["model-serial"] = {"sct_p50_s": 1.0, "sct_mean_s": 1.0, "reference": True}
    return {"policies": policies}


def test_timeline_shows_every_policy_when_few_and_references_never() -> None:
    doc = _doc(talaria=5.0, round=9.0)
    assert timeline_policies(doc, {"talaria", "round", "model-serial"}) == ["talaria", "round"]


def test_timeline_picks_talaria_round_and_the_best_per_request_baseline() -> None:
    scts = {n: 10.0 + i for i, n in enumerate(POLICIES)}
    scts["cache-affinity"] = 11.5
    scts["sticky"] = 11.5  # a tie on p50 and mean: by name
    scts["talaria-no-sp"] = 3.0  # an ablation is no per-request baseline
    doc = _doc(**scts)
    assert timeline_policies(doc, set(scts)) == ["talaria", "round", "cache-affinity"]
    assert timeline_policies(doc, set(scts) - {"round"}) == [
        "talaria",
        "cache-affinity",
        "talaria-no-sp",
    ]


# ---------------------------------------------------------------------- the picture
def test_plot_timeline_writes_a_png(tmp_path: Path) -> None:
    doc, runs, _ = _replay(2, "talaria,round")
    path = plot_timeline(doc, runs, tmp_path / "timeline.png")
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    one = plot_timeline(doc, runs, tmp_path / "one.png", policies=["round"])
    assert one.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="no policy"):
        plot_timeline(doc, {}, tmp_path / "none.png")


def test_cli_replay_writes_the_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    argv = ["replay", "--synthetic", "--sessions", "3", "--calls", "24"]
    assert main([*argv, "--policies", "talaria,round", "--out", str(out)]) == 0
    assert (out / "timeline.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "timeline.png" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    assert "timeline.png" in " ".join(capsys.readouterr().out.split())
