"""SessionTracker: predictions, measured spans, events, parallel tools, misuse, threads."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from talaria.clock import VirtualClock
from talaria.errors import BadRequest
from talaria.session import (
    GapModelConfig,
    GapPredictor,
    HintSender,
    HintStats,
    SessionTracker,
    load_tool_priors,
)


class Recorder:
    """An in-process hint receiver (the ``Talaria.event`` shape) keeping (session, body)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, session_id: str, event: str, **fields: Any) -> None:
        self.calls.append((session_id, {"event": event, **fields}))


def _tracker(**kwargs: Any) -> tuple[SessionTracker, Recorder, HintSender, VirtualClock]:
    seen = Recorder()
    sender = HintSender.in_process(seen)
    clock = VirtualClock()
    tracker = SessionTracker(hints=sender, clock=clock, **kwargs)
    return tracker, seen, sender, clock


def _bodies(sender: HintSender, seen: Recorder) -> list[dict[str, Any]]:
    assert sender.flush(2.0)
    return [body for _, body in seen.calls]


def test_one_tool_gap_exact_values() -> None:
    predictor = GapPredictor(load_tool_priors(), GapModelConfig.plain_ewma(alpha=0.5))
    tracker, seen, sender, clock = _tracker(session_id="s1", predictor=predictor)
    assert tracker.tool_started("bash", command="pytest -x") == 0.406
    assert tracker.running == ("bash",)
    clock.advance_to(1.406)
    assert tracker.tool_ended() == 1.406
    assert predictor.predict("tests") == pytest.approx(0.906)  # 0.406 + 0.5 * (1.406 - 0.406)
    assert tracker.tool_started("bash", command="pytest -x") == pytest.approx(0.906)
    clock.advance_to(2.0)
    tracker.tool_ended("bash")
    tracker.end()
    assert _bodies(sender, seen) == [
        {"event": "tool_start", "tool": "bash", "expected_s": 0.406},
        {"event": "tool_end", "measured_s": 1.406},
        {"event": "tool_start", "tool": "bash", "expected_s": 0.906},
        {"event": "tool_end", "measured_s": 0.594},
        {"event": "end"},
    ]
    assert {sid for sid, _ in seen.calls} == {"s1"}
    assert tracker.stats() == HintStats(sent=5)


def test_parallel_tools_form_one_gap() -> None:
    tracker, seen, sender, clock = _tracker()
    tracker.tool_started("pip", command="pip install numpy")  # install: 2.555 s expected
    clock.advance_to(1.0)
    tracker.tool_started("bash", command="ls")  # 0.241 s, but the gap has 1.555 s left
    clock.advance_to(1.5)
    assert tracker.tool_ended("bash") == 0.5  # install still running: no tool_end yet
    assert tracker.running == ("pip",)
    clock.advance_to(4.0)
    assert tracker.tool_ended() == 4.0
    assert not tracker.running
    assert _bodies(sender, seen) == [
        {"event": "tool_start", "tool": "pip", "expected_s": 2.555},
        {"event": "tool_start", "tool": "bash", "expected_s": 1.555},
        {"event": "tool_end", "measured_s": 4.0},
    ]
    assert tracker.predictor.observations("install") == 1
    assert tracker.predictor.observations("shell_read_edit") == 1


def test_end_is_idempotent_and_context_manager_ends() -> None:
    tracker, seen, sender, _ = _tracker()
    with tracker as t:
        t.tool_started("bash")
    assert tracker.ended
    tracker.end()
    assert _bodies(sender, seen) == [
        {"event": "tool_start", "tool": "bash", "expected_s": 0.261},
        {"event": "end"},
    ]
    assert tracker.running == ()
    assert tracker.predictor.estimates() == {}  # an unfinished tool teaches nothing


def test_exception_in_block_still_ends() -> None:
    tracker, seen, sender, _ = _tracker()
    with pytest.raises(KeyError), tracker:
        raise KeyError("agent bug")
    assert _bodies(sender, seen) == [{"event": "end"}]


@pytest.mark.parametrize("tool", ["", "  ", None, 3])
def test_bad_tool_names(tool: object) -> None:
    tracker, seen, sender, _ = _tracker()
    with pytest.raises(BadRequest):
        tracker.tool_started(tool)  # type: ignore[arg-type]
    with pytest.raises(BadRequest):
        tracker.tool_started("bash", command=b"ls")  # type: ignore[arg-type]
    assert tracker.running == ()
    assert _bodies(sender, seen) == []


def test_misuse_raises_bad_request_and_changes_nothing() -> None:
    tracker, seen, sender, _ = _tracker()
    with pytest.raises(BadRequest, match="no running tool"):
        tracker.tool_ended()
    tracker.tool_started("bash")
    with pytest.raises(BadRequest, match="'python'"):
        tracker.tool_ended("python")
    assert tracker.running == ("bash",)
    tracker.end()
    with pytest.raises(BadRequest, match="has ended"):
        tracker.tool_started("bash")
    assert len(_bodies(sender, seen)) == 2


def test_bad_session_id() -> None:
    with pytest.raises(BadRequest):
        SessionTracker(" padded ")
    assert SessionTracker().session_id.startswith("sess-")


def test_without_hints_predicts_and_learns() -> None:
    clock = VirtualClock()
    tracker = SessionTracker(clock=clock)
    assert tracker.tool_started("run_tests") == 0.406
    clock.advance_to(0.812)
    assert tracker.tool_ended() == 0.812
    assert tracker.predictor.predict("tests") == pytest.approx(0.406 * 2**0.2)
    tracker.end()
    assert tracker.stats() == HintStats()


def test_shared_predictor_learns_across_sessions() -> None:
    predictor = GapPredictor.default()
    clock = VirtualClock()
    a = SessionTracker(predictor=predictor, clock=clock)
    b = SessionTracker(predictor=predictor, clock=clock)
    a.tool_started("web_search")
    clock.advance_to(10.0)
    a.tool_ended()
    assert b.tool_started("web_search") == pytest.approx(0.261 * 2**0.2)


def test_threads_share_one_tracker() -> None:
    rec = Recorder()
    sender = HintSender.in_process(rec, max_queue=100_000)
    tracker = SessionTracker(hints=sender)
    n_threads, n_calls = 4, 200

    def work(i: int) -> None:
        for _ in range(n_calls):
            tracker.tool_started(f"tool{i}")
            tracker.tool_ended(f"tool{i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracker.end()
    assert sender.flush(5.0)
    assert tracker.running == ()
    seen = [body["event"] for _, body in rec.calls]
    starts = seen.count("tool_start")
    ends = seen.count("tool_end")
    assert starts == n_threads * n_calls
    assert 1 <= ends <= starts
    assert seen[-1] == "end"
    # a tool_end always closes a gap that a tool_start opened
    open_tools = 0
    for e in seen[:-1]:
        if e == "tool_start":
            open_tools += 1
        else:
            assert open_tools >= 1
    total = sum(tracker.predictor.observations(f"other:tool{i}") for i in range(n_threads))
    assert total == n_threads * n_calls
    assert tracker.stats() == HintStats(sent=starts + ends + 1)
    sender.close()
