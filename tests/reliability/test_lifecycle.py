"""``talaria serve`` across its lifecycle, as its own process: SIGTERM drains (calls in flight
finish, or fail cleanly past the grace period; new ones are refused), and after a restart
clients' next calls work (their KV is recomputed) while hints for sessions the new process
never saw are answered 404 as documented."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serve_process import KEY, TINY, Server, serving, start, stop
from benchmarks.serve_process import tiny_fields as fields
from tests.reliability.inprocess import requires_tiny_model

pytestmark = requires_tiny_model

CHAT = "/v1/chat/completions"
AUTH = {"Authorization": f"Bearer {KEY}"}
STORY = [{"role": "user", "content": "Tell me a long story"}]  # greedy: no end-of-text for 6,000


def body(max_tokens: int, stream: bool, messages: list[dict[str, str]] = STORY) -> dict[str, Any]:
    return {
        "model": TINY,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def refused(server: Server, timeout_s: float = 30.0) -> bool:
    """Whether the server stops taking connections within ``timeout_s`` (polled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(server.url + "/health", timeout=2)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def stream_through_sigterm(server: Server, max_tokens: int) -> tuple[list[Any], bool]:
    """Start a streamed call, SIGTERM the server once its first chunk has arrived, read the
    stream to its end. Returns the SSE payloads and whether new connections were refused
    while the stream was still open."""
    payloads: list[Any] = []
    refused_meanwhile = False
    with (
        httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c,
        c.stream("POST", CHAT, json=body(max_tokens, True)) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            payloads.append(data if data == "[DONE]" else json.loads(data))
            if len(payloads) == 1:
                server.signal(signal.SIGTERM)
                refused_meanwhile = refused(server)
    return payloads, refused_meanwhile


def test_sigterm_lets_a_call_in_flight_finish_and_refuses_new_ones(tmp_path: Path) -> None:
    server = start(tmp_path, fields(shutdown_grace_s=60))
    try:
        payloads, refused_meanwhile = stream_through_sigterm(server, max_tokens=300)
        assert refused_meanwhile, "the server kept taking connections after SIGTERM"
        assert payloads[-1] == "[DONE]"
        chunks = payloads[:-1]
        assert not any("error" in c for c in chunks)
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
        assert finishes[-1] == "length" and finishes.count("length") == 1
        text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
        assert text
        # uvicorn ends the process by the signal it handled once the drain is done
        assert server.wait_exit(60) in (0, -signal.SIGTERM)
    finally:
        stop(server)


def test_past_the_grace_period_a_stream_ends_with_a_clean_error(tmp_path: Path) -> None:
    server = start(tmp_path, fields(shutdown_grace_s=1))
    try:
        payloads, _ = stream_through_sigterm(server, max_tokens=2000)  # tens of seconds
        assert payloads[-1] == "[DONE]"  # not a cut connection
        error = payloads[-2]["error"]
        assert error["code"] == "shutting_down" and "shut down" in error["message"]
        assert len(payloads) < 2000  # it was stopped, not finished
        assert server.wait_exit(60) in (0, -signal.SIGTERM)
    finally:
        stop(server)


def test_after_a_restart_sessions_go_on_and_their_kv_is_recomputed(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Repeat after me: 7, 8, 9"}]

    def turn(c: httpx.Client, k: int) -> int:
        nonlocal messages
        r = c.post(CHAT, json=body(6, False, messages), headers={"X-Session-ID": "agent-1"})
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": f"And {k}"})
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    with serving(tmp_path / "first", fields()) as first, first.client() as c:
        assert turn(c, 1) == 0
        assert turn(c, 2) > 0
        port = first.port
    assert first.proc.returncode is not None  # gone, and its port free again
    second = start(tmp_path / "second", fields(), port=port)
    try:
        with second.client() as c:
            hint = c.post("/v1/sessions/agent-1/events", json={"event": "tool_start"})
            assert hint.status_code == 404  # the new process never saw the session
            assert "send a call with this session id first" in hint.json()["error"]["message"]
            assert turn(c, 3) == 0  # served; its KV was lost with the old process
            assert turn(c, 4) > 0
            assert c.post("/v1/sessions/agent-1/events", json={"event": "end"}).status_code == 200
        assert second.integrity().json()["integrity"] == "ok"
    finally:
        stop(second)
