"""mini-swe-agent on a live Talaria server (talaria.integrations.swe_agent.mini_swe_agent).

One real server per module (uvicorn on 127.0.0.1, SmolLM2-135M, about 13 s to load) over a
``Talaria`` this module owns, wrapped so that the test sees what the server received: the
usage of every call (with its session id) and every hint event. mini-swe-agent's real
``DefaultAgent`` drives the calls, with its ``LocalEnvironment`` running real shell
commands in a temporary directory. Greedy decoding keeps SmolLM2's answers short; the
first fenced block of an answer is the action (``SMALL_MODEL_ACTION_REGEX``), so commands
do run, whatever the tiny model writes.
"""

from __future__ import annotations

import os

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import

import http.server
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import (
    AbstractContextManager,
    aclosing,
    asynccontextmanager,
    contextmanager,
    nullcontext,
)
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import litellm
import pytest
import torch
from fastapi import FastAPI
from minisweagent.agents import get_agent
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models import get_model
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

from talaria.api import ChatChunk, Talaria, TalariaConfig
from talaria.integrations.swe_agent.mini_swe_agent import (
    SMALL_MODEL_ACTION_REGEX,
    TalariaAgent,
    TalariaEnvironment,
    TalariaModel,
)
from talaria.integrations.swe_agent.runs import AgentSessions
from talaria.server.app import create_app
from tests.integrations.live_server import serve_in_thread

MODEL = "smollm2-135m"
SYSTEM = "You are a shell assistant. Answer with exactly one command in a ```bash code block."
INSTANCE = "Task: {{task}}\nExample answer:\n```bash\nls\n```"
TASK = "create hello.txt containing hello"
# Greedy, short answers; stop once a fenced block closes (the action is the first block).
SAMPLING: Mapping[str, Any] = MappingProxyType(
    {"temperature": 0.0, "max_tokens": 24, "stop": ("\n```\n",)}
)


# --------------------------------------------------------------------------- live server
@attrs.frozen
class ServedCall:
    session_id: str
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen
class Event:
    session_id: str
    event: str
    tool: str | None
    expected_s: float | None
    measured_s: float | None


class RecordingBackend:
    """The server's backend: a real ``Talaria`` that also records, as the server handed
    them over, each call's session and usage and each accepted hint event."""

    def __init__(self, talaria: Talaria) -> None:
        self.talaria = talaria
        self.calls: list[ServedCall] = []
        self.events: list[Event] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.talaria, name)

    def chat_stream(
        self, messages: Sequence[Mapping[str, Any]], model: str, **kwargs: Any
    ) -> AsyncIterator[ChatChunk]:
        return self._record(self.talaria.chat_stream(messages, model, **kwargs))

    async def _record(self, stream: AsyncIterator[ChatChunk]) -> AsyncIterator[ChatChunk]:
        async with aclosing(stream):  # type: ignore[type-var]
            async for chunk in stream:
                if chunk.usage is not None:
                    u = chunk.usage
                    self.calls.append(
                        ServedCall(chunk.session_id, u.prompt_tokens, u.cached_tokens)
                    )
                yield chunk

    async def event(self, session_id: str, event: str, **fields: Any) -> Any:
        summary = await self.talaria.event(session_id, event, **fields)
        self.events.append(
            Event(
                session_id,
                event,
                fields.get("tool"),
                fields.get("expected_s"),
                fields.get("measured_s"),
            )
        )
        return summary

    def session_events(self, session_id: str) -> list[Event]:
        return [e for e in self.events if e.session_id == session_id]

    def session_calls(self, session_id: str) -> list[ServedCall]:
        return [c for c in self.calls if c.session_id == session_id]


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, RecordingBackend]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: oversubscribed intra-op threads crawl
    config = TalariaConfig(
        models=(MODEL,), device_memory_bytes=2 * 10**9, host_memory_bytes=2 * 10**9
    )
    backend = RecordingBackend(Talaria(config))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with backend.talaria:
            yield

    try:
        with serve_in_thread(create_app(backend, lifespan=lifespan)) as url:
            yield url, backend
    finally:
        torch.set_num_threads(threads)


def _sessions(backend: RecordingBackend) -> dict[str, int]:
    stats: dict[str, int] = backend.talaria.stats()["sessions"]
    return stats


def _model(url: str, **kwargs: Any) -> TalariaModel:
    return TalariaModel(
        model_name=MODEL,
        base_url=url,
        action_regex=SMALL_MODEL_ACTION_REGEX,
        model_kwargs=dict(SAMPLING),
        **kwargs,
    )


def _executed(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The observation messages (one per command the environment ran)."""
    return [m for m in messages if m.get("role") == "user" and "returncode" in m.get("extra", {})]


def _outputs(messages: list[dict[str, Any]]) -> str:
    return json.dumps([m.get("content") for m in messages[2:]], indent=1)[:2000]


# --------------------------------------------------------------------------- plugging in
def test_plugs_in_through_mini_swe_agents_config(tmp_path: Path) -> None:
    """``model_class`` / ``agent_class`` import paths, as mini's run scripts resolve them."""
    model = get_model(
        config={
            "model_class": "talaria.integrations.swe_agent.mini_swe_agent.TalariaModel",
            "model_name": "talaria/smollm2-135m",
            "base_url": "http://127.0.0.1:9/v1/",
            "api_key": "secret-key",
            "tool_hints": False,
        }
    )
    assert isinstance(model, TalariaModel)
    assert model.config.base_url == "http://127.0.0.1:9"
    assert model.config.served_model == MODEL
    env = get_environment({"cwd": str(tmp_path)}, default_type="local")
    agent = get_agent(
        model,
        env,
        {
            "agent_class": "talaria.integrations.swe_agent.mini_swe_agent.TalariaAgent",
            "system_template": SYSTEM,
            "instance_template": INSTANCE,
        },
    )
    assert isinstance(agent, TalariaAgent) and isinstance(agent.env, TalariaEnvironment)
    assert agent.env.execute({"command": "echo hi"})["output"] == "hi\n"  # no session: no hint
    assert model.session_id is None
    # The key never reaches a trajectory or a template.
    dumped = json.dumps(agent.serialize())
    assert "secret-key" not in dumped and "talaria" in json.loads(dumped)["info"]
    assert "secret-key" not in str(agent.get_template_vars())
    model.close()


# --------------------------------------------------------------------------- end to end
def test_agent_run_is_one_session_with_cached_prefixes_and_tool_gaps(
    live: tuple[str, RecordingBackend], tmp_path: Path
) -> None:
    url, backend = live
    before = _sessions(backend)
    model = _model(url)
    env = LocalEnvironment(cwd=str(tmp_path), timeout=10, env={"HOME": str(tmp_path)})
    agent = TalariaAgent(
        model, env, system_template=SYSTEM, instance_template=INSTANCE, step_limit=3
    )
    assert isinstance(agent.env, TalariaEnvironment)  # wrapped automatically
    started = time.monotonic()
    info = agent.run(TASK)
    elapsed = time.monotonic() - started
    assert model.sessions.flush(5.0)
    model.close()

    # mini-swe-agent's own exits; the step limit stops the tiny model.
    assert info["exit_status"] in {"LimitsExceeded", "RepeatedFormatError", "Submitted"}
    records = model.sessions.sessions()
    assert len(records) == 1, records
    sid = records[0].session_id
    calls = backend.session_calls(sid)
    assert len(calls) == agent.n_calls >= 3, (calls, agent.n_calls)
    assert records[0].calls == len(calls)
    # Every message that came from a call names the run's one session.
    extras = [m["extra"]["talaria"] for m in agent.messages if "talaria" in m.get("extra", {})]
    assert len(extras) == len(calls) and {e["session_id"] for e in extras} == {sid}
    # The prefix is reused from the second call on, as the server reports it.
    assert all(c.cached_tokens > 0 for c in calls[1:]), calls
    assert [e["cached_tokens"] for e in extras] == [c.cached_tokens for c in calls]

    # One session per agent run, ended when the run ended.
    after = _sessions(backend)
    assert after["total"] - before["total"] == 1
    assert after["ended"] - before["ended"] == 1
    assert after["active"] == before["active"]

    # Each command the local environment ran is one tool gap with its measured span.
    executed = _executed(agent.messages)
    assert executed, f"the agent ran no command; the model wrote:\n{_outputs(agent.messages)}"
    events = backend.session_events(sid)
    starts = [e for e in events if e.event == "tool_start"]
    ends = [e for e in events if e.event == "tool_end"]
    assert len(starts) == len(ends) == len(executed), events
    assert all(e.tool == "bash" and e.expected_s is not None and e.expected_s > 0 for e in starts)
    assert all(e.measured_s is not None and 0 <= e.measured_s < elapsed for e in ends)
    assert sum(e.measured_s or 0.0 for e in ends) > 0
    assert [e.event for e in events][-1] == "end"
    assert [e.event for e in events].count("end") == 1
    assert model.sessions.hint_stats().failed == 0
    json.dumps(agent.serialize())  # the trajectory, usage included, is JSON


def test_plain_default_agent_gets_a_session_per_run_and_model_side_gaps(
    live: tuple[str, RecordingBackend], tmp_path: Path
) -> None:
    """``model_class``-only use: mini's own DefaultAgent and an unwrapped environment."""
    url, backend = live
    before = _sessions(backend)
    model = _model(url, session_id="instance-42")
    env = LocalEnvironment(cwd=str(tmp_path), timeout=10, env={"HOME": str(tmp_path)})
    first = DefaultAgent(
        model, env, system_template=SYSTEM, instance_template=INSTANCE, step_limit=1
    )
    first.run(TASK)
    second = DefaultAgent(
        model, env, system_template=SYSTEM, instance_template=INSTANCE, step_limit=1
    )
    second.run(TASK)
    model.close()  # ends the open session and delivers the queued hints

    records = model.sessions.sessions()
    assert [r.session_id for r in records] == ["instance-42", "instance-42-2"]
    assert [r.calls for r in records] == [1, 1]
    assert len(backend.session_calls("instance-42")) == 1
    assert len(backend.session_calls("instance-42-2")) == 1
    after = _sessions(backend)
    assert after["total"] - before["total"] == 2
    assert after["ended"] - before["ended"] == 2
    # The model inferred the first run's last gap from its own calls: it opened when the
    # call returned an action and closed when the next call (the second run's) began.
    events = [e.event for e in backend.session_events("instance-42")]
    gap = ["tool_start", "tool_end"] if _executed(first.messages) else []
    assert events == [*gap, "end"], events
    assert [e.event for e in backend.session_events("instance-42-2")][-1] == "end"


def test_hints_to_an_unreachable_server_are_dropped_quietly(
    live: tuple[str, RecordingBackend], tmp_path: Path
) -> None:
    url, _ = live
    dead = f"http://127.0.0.1:{_free_port()}"
    model = _model(url, sessions=AgentSessions.http(dead, timeout_s=0.5))
    env = TalariaEnvironment(LocalEnvironment(cwd=str(tmp_path), timeout=10), model)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Task: ls"}]
    try:
        model.query(messages)
    except Exception as e:  # a FormatError is fine: the call itself was answered
        assert type(e).__name__ == "FormatError"
    started = time.monotonic()
    out = env.execute({"command": "echo hi"})
    assert out["returncode"] == 0 and out["output"] == "hi\n"
    model.close(timeout_s=2.0)
    assert time.monotonic() - started < 3.0
    stats = model.sessions.hint_stats()
    assert stats.sent == 0 and stats.failed + stats.dropped == 3  # tool_start, tool_end, end


# --------------------------------------------------------------------------- errors
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _ErrorHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.dumps({"error": {"message": "boom", "type": "server_error", "code": 500}})
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def _erroring_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ErrorHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def _silent_server() -> Iterator[str]:
    """Accepts connections and never answers (a server that is too slow)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(2)
        for conn in held:
            conn.close()
        sock.close()


def _run_agent(model: Any, tmp_path: Path, agent_class: type[DefaultAgent]) -> BaseException:
    env = LocalEnvironment(cwd=str(tmp_path), timeout=10)
    agent = agent_class(
        model, env, system_template=SYSTEM, instance_template=INSTANCE, step_limit=2
    )
    with pytest.raises(Exception) as caught:
        agent.run(TASK)
    return caught.value


@pytest.mark.parametrize("scenario", ["unreachable", "slow", "erroring", "unknown_model"])
def test_server_failures_raise_what_mini_swe_agents_litellm_model_raises(
    scenario: str,
    live: tuple[str, RecordingBackend],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent gets the exception mini-swe-agent's own LiteLLM text model gets for the
    same server, in bounded time, and closing the model afterwards does not wait."""
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")  # mini's retry knob
    url, _ = live
    server: AbstractContextManager[str] = (
        _erroring_server()
        if scenario == "erroring"
        else _silent_server()
        if scenario == "slow"
        else nullcontext(url)
    )
    with server as base:
        if scenario == "unreachable":
            base = f"http://127.0.0.1:{_free_port()}"
        name = "no-such-model" if scenario == "unknown_model" else MODEL
        common = {"temperature": 0.0, "max_tokens": 8, "max_retries": 0, "timeout": 1.0}
        reference = LitellmTextbasedModel(  # type: ignore[no-untyped-call]
            model_name=f"openai/{name}",
            model_kwargs={**common, "api_base": f"{base}/v1", "api_key": "x"},
            cost_tracking="ignore_errors",
        )
        expected = _run_agent(reference, tmp_path, DefaultAgent)
        model = TalariaModel(
            model_name=name, base_url=base, model_kwargs=common, hint_timeout_s=0.5
        )
        started = time.monotonic()
        got = _run_agent(model, tmp_path, TalariaAgent)
        model.close(timeout_s=1.0)
        assert time.monotonic() - started < 10.0
    assert type(got) is type(expected), (got, expected)
    assert type(got).__module__ == litellm.exceptions.__name__, type(got)
