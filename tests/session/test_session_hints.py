"""Hint events, the background sender, and its HTTP and in-process sinks.

The HTTP tests run a real ``http.server`` on 127.0.0.1 in a thread that records requests.
The tests that agent-facing calls never wait hold delivery back at a gate the test opens
(``tests.gates``), rather than timing the calls.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from talaria.errors import BadRequest, ConfigError
from talaria.session import (
    MAX_TOOL_NAME_LEN,
    CallableSink,
    EventKind,
    HintEvent,
    HintSender,
    HintStats,
    HttpSink,
    SessionTracker,
)
from talaria.types import SessionEvent
from tests.gates import BACKSTOP_S, LIVENESS_S, GatedSink, returns_while_held

TIMEOUT_S = 0.2


# --------------------------------------------------------------------------- events


def test_event_json_bodies() -> None:
    start = HintEvent("s1", EventKind.TOOL_START, tool="bash", expected_s=0.4)
    assert start.to_json() == {"event": "tool_start", "tool": "bash", "expected_s": 0.4}
    end = HintEvent("s1", EventKind.TOOL_END, measured_s=0.123456)
    assert end.to_json() == {"event": "tool_end", "measured_s": 0.1235}
    assert HintEvent("s1", EventKind.TOOL_END).to_json() == {"event": "tool_end"}
    assert HintEvent("s1", EventKind.END).to_json() == {"event": "end"}
    assert start.to_session_event() == SessionEvent("s1", EventKind.TOOL_START, "bash", 0.4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"session_id": "", "kind": EventKind.END},
        {"session_id": "s", "kind": "end"},
        {"session_id": "s", "kind": EventKind.TOOL_START},
        {"session_id": "s", "kind": EventKind.TOOL_START, "tool": "b", "expected_s": -1},
        {"session_id": "s", "kind": EventKind.TOOL_START, "tool": "b", "expected_s": 86400},
        {"session_id": "s", "kind": EventKind.TOOL_START, "tool": "b", "expected_s": float("nan")},
        {"session_id": "s", "kind": EventKind.END, "tool": "b"},
        {"session_id": "s", "kind": EventKind.TOOL_START, "tool": "b" * 201},
        {"session_id": "a b", "kind": EventKind.END},
        {"session_id": "s", "kind": EventKind.END, "measured_s": 1.0},
        {"session_id": "s", "kind": EventKind.TOOL_END, "measured_s": -0.1},
    ],
)
def test_event_rejects(kwargs: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        HintEvent(**kwargs)


# --------------------------------------------------------------------------- HTTP server


class _Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        self.status = 200
        self.answer = threading.Event()  # cleared: take requests but answer none until set
        self.answer.set()
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Recorder

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with self.server.lock:
            self.server.requests.append((self.path, dict(self.headers), json.loads(body)))
        self.server.answer.wait(BACKSTOP_S)
        try:
            self.send_response(self.server.status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
        except OSError:  # the client gave up (timeout)
            pass

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[_Recorder]:
    srv = _Recorder()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield srv
    srv.answer.set()
    srv.shutdown()
    srv.server_close()
    thread.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_http_sink_urls() -> None:
    assert HttpSink("http://h:8000/").url_for("s1") == "http://h:8000/v1/sessions/s1/events"
    assert HttpSink("http://h:8000/v1").url_for("a/b c") == (
        "http://h:8000/v1/sessions/a%2Fb%20c/events"
    )
    assert HttpSink("https://h/api/v1/").url_for("s") == "https://h/api/v1/sessions/s/events"
    for bad in ("h:8000", "ftp://h", "", "http://"):
        with pytest.raises(ConfigError):
            HttpSink(bad)
    with pytest.raises(ConfigError):
        HttpSink("http://h", timeout_s=0)


def test_http_delivery_in_order_with_bearer_key(server: _Recorder) -> None:
    sender = HintSender.http(server.base_url + "/v1", api_key="k-123", timeout_s=TIMEOUT_S)
    with SessionTracker("sess/1", hints=sender) as tracker:
        assert tracker.tool_started("bash", command="pytest -q") == 0.406
        tracker.tool_ended()
    assert sender.flush(2.0)
    assert sender.close(1.0)
    paths = {p for p, _, _ in server.requests}
    assert paths == {"/v1/sessions/sess%2F1/events"}
    bodies = [b for _, _, b in server.requests]
    assert bodies[0] == {"event": "tool_start", "tool": "bash", "expected_s": 0.406}
    assert bodies[1]["event"] == "tool_end" and bodies[1]["measured_s"] >= 0
    assert bodies[2] == {"event": "end"}
    assert all(h["Authorization"] == "Bearer k-123" for _, h, _ in server.requests)
    assert sender.stats() == HintStats(sent=3) == tracker.stats()


def test_http_no_auth_header_without_key(server: _Recorder) -> None:
    with HintSender.http(server.base_url) as sender:
        sender.submit(HintEvent("s", EventKind.END))
        assert sender.flush(2.0)
    assert "Authorization" not in server.requests[0][1]


def test_http_server_unreachable() -> None:
    gate = GatedSink(HttpSink(f"http://127.0.0.1:{_free_port()}", timeout_s=TIMEOUT_S))
    sender = HintSender(gate)
    tracker = SessionTracker(hints=sender)

    def agent() -> None:
        tracker.tool_started("bash")
        tracker.tool_ended()
        tracker.end()

    returns_while_held(agent, "tool_started / tool_ended / end", gate.open)
    assert gate.entered.wait(LIVENESS_S)  # the worker holds the first event at the gate
    assert sender.pending == 3 and tracker.stats() == HintStats()  # none delivered yet
    gate.open.set()
    assert sender.flush(LIVENESS_S)
    assert tracker.stats() == HintStats(failed=3)  # connection refused, counted, not raised
    assert sender.close(LIVENESS_S)


def test_http_server_slow(server: _Recorder) -> None:
    server.answer.clear()  # the server takes every request and answers none (until teardown)
    gate = GatedSink(HttpSink(server.base_url, timeout_s=TIMEOUT_S))
    sender = HintSender(gate)
    tracker = SessionTracker(hints=sender)

    def agent() -> None:
        for _ in range(3):
            tracker.tool_started("bash", command="ls")
            tracker.tool_ended()
        tracker.end()

    returns_while_held(agent, "3 tool runs and end", gate.open)  # 7 events, none waited for
    assert gate.entered.wait(LIVENESS_S)
    assert sender.pending == 7 and tracker.stats() == HintStats() and not server.requests
    assert not sender.flush(0.05)  # still delivering
    gate.open.set()
    assert sender.flush(LIVENESS_S)
    assert tracker.stats() == HintStats(failed=7)  # every request timed out
    assert sender.close(LIVENESS_S)


def test_http_server_500(server: _Recorder) -> None:
    server.status = 500
    with HintSender.http(server.base_url, timeout_s=TIMEOUT_S) as sender:
        tracker = SessionTracker(hints=sender)
        tracker.end()
        assert sender.flush(2.0)
        assert tracker.stats() == HintStats(failed=1)
        assert len(server.requests) == 1
        server.status = 200
        sender.submit(HintEvent(tracker.session_id, EventKind.END))
        assert sender.flush(2.0)
        assert sender.stats() == HintStats(sent=1, failed=1)


# --------------------------------------------------------------------------- queue, close


class Recorder:
    """A sync in-process callable of the ``Talaria.event`` shape, recording what it got."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, session_id: str, event: str, **fields: Any) -> None:
        self.calls.append((session_id, {"event": event, **fields}))

    @property
    def session_ids(self) -> list[str]:
        return [sid for sid, _ in self.calls]


class _Gate(Recorder):
    """A recorder that blocks until released."""

    def __init__(self) -> None:
        super().__init__()
        self.open = threading.Event()
        self.entered = threading.Event()

    def __call__(self, session_id: str, event: str, **fields: Any) -> None:
        self.entered.set()
        self.open.wait(BACKSTOP_S)
        super().__call__(session_id, event, **fields)


def _ev(i: int) -> HintEvent:
    return HintEvent(f"s{i}", EventKind.END)


@pytest.mark.parametrize(("drop", "kept"), [("oldest", [0, 3, 4]), ("newest", [0, 1, 2])])
def test_full_queue_drops_and_counts(drop: str, kept: list[int]) -> None:
    gate = _Gate()
    sender = HintSender(CallableSink(gate), max_queue=2, drop=drop)  # type: ignore[arg-type]
    assert sender.submit(_ev(0))
    assert gate.entered.wait(2.0)  # event 0 is being delivered; the queue is empty
    results = [sender.submit(_ev(i)) for i in range(1, 5)]
    assert results == ([True] * 4 if drop == "oldest" else [True, True, False, False])
    assert sender.stats() == HintStats(dropped=2)
    assert sender.pending == 3
    gate.open.set()
    assert sender.flush(2.0)
    assert gate.session_ids == [f"s{i}" for i in kept]
    assert sender.stats() == HintStats(sent=3, dropped=2)
    assert sender.close()


def test_close_drains_then_refuses() -> None:
    rec = Recorder()
    sender = HintSender.in_process(rec)
    for i in range(5):
        sender.submit(_ev(i))
    assert sender.close(2.0)
    assert rec.session_ids == [f"s{i}" for i in range(5)]
    assert not sender.submit(_ev(9))
    assert sender.stats() == HintStats(sent=5, dropped=1)
    assert sender.close()  # idempotent
    assert sender.flush(0.1)


def test_close_timeout_drops_rest() -> None:
    gate = _Gate()
    sender = HintSender(CallableSink(gate))
    queued = returns_while_held(
        lambda: [sender.submit(_ev(i)) for i in range(4)], "submit", gate.open
    )
    assert queued == [True] * 4
    assert gate.entered.wait(LIVENESS_S)
    # the worker is stuck in the sync callable: close gives up after its timeout, not waiting
    closed = returns_while_held(lambda: sender.close(0.1), "close(0.1)", gate.open)
    assert closed is False
    assert gate.calls == [] and sender.stats() == HintStats()  # event 0 still at the gate
    gate.open.set()  # after the close deadline: the worker finishes event 0, drops the rest
    assert sender.flush(LIVENESS_S)
    assert gate.session_ids == ["s0"]
    assert sender.stats() == HintStats(sent=1, dropped=3)


def test_close_unused_sender() -> None:
    sender = HintSender.http("http://127.0.0.1:1")
    assert sender.close()
    assert sender.stats() == HintStats()


@pytest.mark.parametrize("kwargs", [{"max_queue": 0}, {"drop": "middle"}])
def test_sender_config_rejects(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        HintSender(CallableSink(Recorder()), **kwargs)


# --------------------------------------------------------------------------- in process


def test_in_process_sync_and_raising() -> None:
    def boom(session_id: str, event: str, **fields: Any) -> None:
        raise RuntimeError("server bug")

    with HintSender.in_process(boom) as sender:
        tracker = SessionTracker(hints=sender)
        tracker.tool_started("bash")
        tracker.end()
        assert sender.flush(1.0)
        assert tracker.stats() == HintStats(failed=2)


def test_in_process_async_without_loop_uses_private_loop() -> None:
    seen: list[tuple[str, str]] = []

    async def on_event(session_id: str, event: str, **fields: Any) -> None:
        await asyncio.sleep(0)
        seen.append((session_id, event))

    with HintSender.in_process(on_event) as sender:
        SessionTracker("x", hints=sender).end()
        assert sender.flush(1.0)
    assert seen == [("x", "end")]


def test_in_process_async_timeout_counted() -> None:
    async def hang(session_id: str, event: str, **fields: Any) -> None:
        await asyncio.sleep(10)

    with HintSender.in_process(hang, timeout_s=0.05) as sender:
        sender.submit(_ev(0))
        assert sender.flush(1.0)
        assert sender.stats() == HintStats(failed=1)


def test_inside_running_loop_delivers_on_that_loop() -> None:
    async def main() -> tuple[int, list[int], HintStats, HintStats]:
        threads: list[int] = []
        entered, gate = asyncio.Event(), asyncio.Event()

        async def on_event(session_id: str, event: str, **fields: Any) -> None:
            entered.set()
            await gate.wait()
            threads.append(threading.get_ident())

        # captures this running loop; the sink's timeout outlasts any wait at the gate
        sender = HintSender.in_process(on_event, timeout_s=60)
        async with SessionTracker(hints=sender) as tracker:
            # on the loop's own thread: waiting here for a delivery to this loop would hang
            tracker.tool_started("bash", command="ls")
            tracker.tool_ended()
            await entered.wait()  # event 1 is at the gate
            assert threads == [] and sender.pending == 2 and sender.stats() == HintStats()
            gate.set()
        assert await sender.aflush(LIVENESS_S)
        assert await sender.aclose(LIVENESS_S)
        return threading.get_ident(), threads, tracker.stats(), sender.stats()

    loop_thread, threads, tracker_stats, sender_stats = returns_while_held(
        lambda: asyncio.run(main()), "tool_started / tool_ended inside the running loop"
    )
    assert threads == [loop_thread] * 3
    assert tracker_stats == sender_stats == HintStats(sent=3)


def test_in_process_closed_loop_is_a_failure() -> None:
    loop = asyncio.new_event_loop()
    loop.close()

    async def on_event(session_id: str, event: str, **fields: Any) -> None:
        pass

    with HintSender.in_process(on_event, loop=loop) as sender:
        sender.submit(_ev(0))
        assert sender.flush(1.0)
        assert sender.stats() == HintStats(failed=1)


def test_in_process_matches_talaria_event_signature() -> None:
    """The keyword shape of ``talaria.Talaria.event`` (async, keyword-only fields)."""
    got: list[tuple[str, str, str | None, float | None, float | None]] = []

    async def event(
        session_id: str,
        event: str,
        *,
        tool: str | None = None,
        expected_s: float | None = None,
        measured_s: float | None = None,
    ) -> None:
        got.append((session_id, event, tool, expected_s, measured_s))

    with HintSender.in_process(event) as sender:
        tracker = SessionTracker("s9", hints=sender)
        tracker.tool_started("t" * 300)
        tracker.tool_ended()
        tracker.end()
        assert sender.flush(1.0)
    assert got[0] == ("s9", "tool_start", "t" * MAX_TOOL_NAME_LEN, 0.261, None)
    assert got[1][:3] == ("s9", "tool_end", None) and got[1][4] is not None
    assert got[2] == ("s9", "end", None, None, None)
    assert sender.stats() == HintStats(sent=3)


def test_inside_running_loop_timeout_cancels_and_counts() -> None:
    cancelled = []

    async def main() -> HintStats:
        async def hang(session_id: str, event: str, **fields: Any) -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append(session_id)
                raise

        sender = HintSender.in_process(hang, timeout_s=0.05)
        sender.submit(_ev(0))
        assert await sender.aflush(1.0)
        await asyncio.sleep(0.01)  # let the loop run the cancellation
        assert await sender.aclose(1.0)
        return sender.stats()

    assert asyncio.run(main()) == HintStats(failed=1)
    assert cancelled == ["s0"]
