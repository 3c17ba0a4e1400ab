"""The SWE-agent hook (talaria.integrations.swe_agent.sweagent_hook) against a live Talaria server.

The real SWE-agent 1.1.0 run is ``test_swe_agent_run.py``; these tests drive the hook
without SWE-agent, the way SWE-agent 1.x's ``DefaultAgent`` does (so they run where
SWE-agent is not installed, and cover orders a short real run does not reach: two runs of
one agent, ``RetryAgent``'s order, a dead server), in its order: ``add_hook`` ->
``on_init``; setup callbacks; ``on_run_start``; per step ``on_step_start``,
``on_model_query``, the model query, ``on_actions_generated``, ``on_action_started``, the
command, ``on_action_executed``, ``on_step_done``; ``on_run_done``. The model query repeats
SWE-agent's ``LiteLLMModel._single_query`` call to ``litellm.completion`` argument for
argument, with the model ``talaria/smollm2-135m`` (the LiteLLM provider) and the model
config's own ``completion_kwargs`` dict (where the hook puts the session header). Commands
run in a real shell. One real server per module (SmolLM2-135M, about 13 s to load).
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import

import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import litellm
import pytest
import torch
from fastapi import FastAPI

from talaria.api import ChatChunk, Talaria, TalariaConfig
from talaria.integrations.swe_agent.sweagent_hook import TalariaAgentHook, swe_agent_model_config
from talaria.server.app import create_app
from tests.integrations.live_server import serve_in_thread

MODEL = "smollm2-135m"
COMMAND = "sleep 0.2; echo done"


# --------------------------------------------------------------------------- live server
@attrs.frozen
class ServedCall:
    session_id: str
    cached_tokens: int


@attrs.frozen
class Event:
    session_id: str
    event: str
    tool: str | None
    expected_s: float | None
    measured_s: float | None


class RecordingBackend:
    """A real ``Talaria`` that also records each call's session and cached tokens and each
    accepted hint event, as the server handed them over."""

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
                    self.calls.append(ServedCall(chunk.session_id, chunk.usage.cached_tokens))
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


# --------------------------------------------------------------------------- SWE-agent, as it calls
class ModelConfig:
    """The fields of SWE-agent's ``GenericAPIModelConfig`` that ``_single_query`` reads."""

    def __init__(self, name: str, **fields: Any) -> None:
        self.name = name
        self.api_base: str | None = fields.get("api_base")
        self.completion_kwargs: dict[str, Any] = fields.get("completion_kwargs", {})
        self.temperature = 0.0
        self.top_p: float | None = 1.0
        self.api_version: str | None = None
        self.fallbacks: list[dict[str, Any]] = []

    def choose_api_key(self) -> str | None:
        return None


class LiteLLMModel:
    """SWE-agent's ``LiteLLMModel`` query path (retries left out)."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def query(self, history: list[dict[str, str]]) -> dict[str, Any]:
        extra_args: dict[str, Any] = {}
        if self.config.api_base:
            extra_args["api_base"] = self.config.api_base
        completion_kwargs = self.config.completion_kwargs
        response = litellm.completion(
            model=self.config.name,
            messages=history,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            api_version=self.config.api_version,
            api_key=self.config.choose_api_key(),
            fallbacks=self.config.fallbacks,
            **completion_kwargs,
            **extra_args,
            n=None,
        )
        return {"message": response.choices[0].message.content or "", "response": response}


@attrs.define
class StepOutput:
    """The fields of SWE-agent's ``StepOutput`` used here."""

    output: str = ""
    thought: str = ""
    action: str = ""
    observation: str = ""
    execution_time: float = 0.0
    done: bool = False


class Agent:
    """Calls a hook as SWE-agent 1.x's ``DefaultAgent`` does (``run`` -> ``step`` ->
    ``forward`` -> ``handle_action``), running ``COMMAND`` in a real shell each step."""

    name = "main"

    def __init__(self, model: LiteLLMModel, cwd: Path) -> None:
        self.model = model
        self.cwd = cwd
        self.hooks: list[Any] = []
        self.history: list[dict[str, str]] = []
        self.steps: list[StepOutput] = []

    def add_hook(self, hook: Any) -> None:
        hook.on_init(agent=self)
        self.hooks.append(hook)

    def _call(self, method: str, **kwargs: Any) -> None:
        for hook in self.hooks:
            getattr(hook, method)(**kwargs)

    def run(self, task: str, steps: int) -> None:
        self.setup(task)
        self._call("on_run_start")
        for _ in range(steps):
            self.step()
        self._call("on_run_done", trajectory=[], info={})

    def setup(self, task: str) -> None:
        self._call("on_tools_installation_started")
        self._call("on_setup_attempt")
        self.history = [
            {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": task},
        ]
        for item in self.history:
            self._call("on_query_message_added", agent=self.name, message_type="x", **item)
        self._call("on_setup_done")

    def step(self) -> None:
        self._call("on_step_start")
        self._call("on_model_query", messages=self.history, agent=self.name)
        output = self.model.query(self.history)
        step = StepOutput(output=output["message"], thought=output["message"], action=COMMAND)
        self._call("on_actions_generated", step=step)
        self._call("on_action_started", step=step)
        started = time.perf_counter()
        done = subprocess.run(
            COMMAND, shell=True, cwd=self.cwd, capture_output=True, text=True, timeout=10
        )
        step.execution_time = time.perf_counter() - started
        step.observation = done.stdout
        self._call("on_action_executed", step=step)
        self.history = [
            *self.history,
            {"role": "assistant", "content": step.output},
            {"role": "user", "content": f"Observation: {step.observation}"},
        ]
        self.steps.append(step)
        self._call("on_step_done", step=step, info={})


def _agent(url: str, tmp_path: Path) -> Agent:
    fields = swe_agent_model_config(MODEL, url, completion_kwargs={"max_tokens": 8, "timeout": 60})
    return Agent(LiteLLMModel(ModelConfig(**fields)), tmp_path)


def _sessions(backend: RecordingBackend) -> dict[str, int]:
    stats: dict[str, int] = backend.talaria.stats()["sessions"]
    return stats


# --------------------------------------------------------------------------- tests
def test_swe_agent_model_config_uses_the_provider_without_cost_limits() -> None:
    config = swe_agent_model_config("smollm2-135m", "http://127.0.0.1:8000", temperature=0.2)
    assert config == {
        "name": "talaria/smollm2-135m",
        "per_instance_cost_limit": 0.0,
        "total_cost_limit": 0.0,
        "max_input_tokens": 0,
        "completion_kwargs": {},
        "api_base": "http://127.0.0.1:8000",
        "temperature": 0.2,
    }
    assert "api_base" not in swe_agent_model_config("talaria/smollm2-135m", None)


def test_each_run_is_one_session_with_cached_prefixes_and_measured_tool_gaps(
    live: tuple[str, RecordingBackend], tmp_path: Path
) -> None:
    url, backend = live
    before = _sessions(backend)
    agent = _agent(url, tmp_path)
    hook = TalariaAgentHook(session_id="swe-instance-1")
    agent.add_hook(hook)
    agent.run("Say hello.", steps=3)
    agent.run("Say hello.", steps=1)  # the same agent runs again: a new session
    hook.close(timeout_s=5.0)

    first, second = "swe-instance-1", "swe-instance-1-2"
    calls = [c for c in backend.calls if c.session_id == first]
    assert len(calls) == 3
    assert all(c.cached_tokens > 0 for c in calls[1:]), calls
    assert [c.session_id for c in backend.calls].count(second) == 1
    after = _sessions(backend)
    assert after["total"] - before["total"] == 2
    assert after["ended"] - before["ended"] == 2

    events = [e for e in backend.events if e.session_id == first]
    assert [e.event for e in events] == ["tool_start", "tool_end"] * 3 + ["end"]
    for start, end, step in zip(events[0::2], events[1::2], agent.steps[:3], strict=False):
        assert start.tool == "bash" and start.expected_s is not None and start.expected_s > 0
        assert end.measured_s is not None
        # The hook's span is the command's, give or take scheduling.
        assert 0.2 <= end.measured_s <= step.execution_time + 0.5
    assert [e.event for e in backend.events if e.session_id == second] == [
        "tool_start",
        "tool_end",
        "end",
    ]
    headers = agent.model.config.completion_kwargs["extra_headers"]
    assert headers == {"X-Session-ID": second}


def test_a_retry_agent_order_still_tags_every_call(
    live: tuple[str, RecordingBackend], tmp_path: Path
) -> None:
    """``RetryAgent`` calls ``on_run_start`` before the attempt's ``on_init``."""
    url, backend = live
    hook = TalariaAgentHook()
    hook.on_run_start()  # nothing to end yet; must not fail
    agent = _agent(url, tmp_path)
    agent.add_hook(hook)  # RetryAgent._setup_agent: add_hook, then the attempt's setup
    agent.setup("Say hello.")
    agent.step()
    sid = hook.current_session_id
    assert sid is not None and sid.startswith("sess-")
    assert backend.calls[-1].session_id == sid
    hook.on_run_done(trajectory=[], info={})
    hook.close(timeout_s=5.0)
    assert [e.event for e in backend.events if e.session_id == sid][-1] == "end"


def test_an_unreachable_server_fails_the_call_not_the_hook(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    agent = _agent(dead, tmp_path)
    hook = TalariaAgentHook()
    agent.add_hook(hook)
    started = time.monotonic()
    with pytest.raises(litellm.exceptions.APIConnectionError):
        agent.run("Say hello.", steps=1)  # the model call fails with LiteLLM's own error
    step = StepOutput(action="ls")
    hook.on_action_started(step=step)  # hints for the dead server are queued, not raised
    hook.on_action_executed(step=step)
    hook.on_run_done(trajectory=[], info={})
    hook.close(timeout_s=2.0)
    assert time.monotonic() - started < 10.0
    assert hook.sessions is not None
    stats = hook.sessions.hint_stats()
    assert stats.sent == 0 and stats.failed >= 1
