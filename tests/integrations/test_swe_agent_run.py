"""A real SWE-agent 1.1.0 run on a live Talaria server (issue 17, part 1).

``examples/swe_agent_hook_example.py`` runs SWE-agent's own ``RunSingle`` (SWE-ReX's
``local`` deployment, a tiny git repository made here, a one-line problem statement, the
model ``talaria/smollm2-135m`` through the LiteLLM provider, ``TalariaAgentHook`` on the
agent) in its own process, against a uvicorn server in this process whose backend records
what arrives: each call's session id and usage, each hint event. SWE-agent comes from the
current interpreter when it imports, else from ``third_party/SWE-agent-1.1.0-src.tar.gz``
(``$TALARIA_SWE_AGENT_SRC``) installed into a throwaway virtual environment that sees this
environment's packages and changes nothing in it (``$TALARIA_SWE_AGENT_VENV`` keeps it
between runs). About 20 s to install, 15 s to load the model, 15 s for the run.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import

import itertools
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from fastapi import FastAPI

from talaria.api import Talaria
from talaria.integrations.swe_agent.sweagent_hook import swe_agent_model_config
from talaria.integrations.swe_agent.sweagent_run import (
    FINISHED_STATUSES,
    ROOT_LEFTOVERS,
    demo_repository,
    local_deployment_cleanup,
    overlay_environment,
    small_model_agent_config,
    sweagent_importable,
)
from talaria.server.app import create_app
from tests.integrations.live_server import TINY, Recorder, serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "swe_agent_hook_example.py"
VENDORED = ROOT / "third_party" / "SWE-agent-1.1.0-src.tar.gz"
CALLS = 3  # SWE-agent's per_instance_call_limit: the run ends on call CALLS + 1


# --------------------------------------------------------------------------- fast checks
def test_swe_agent_model_config_refuses_arguments_swe_agent_passes_itself() -> None:
    # SWE-agent calls litellm.completion(temperature=..., **completion_kwargs): a
    # temperature in completion_kwargs failed every query with a TypeError.
    with pytest.raises(ValueError, match=r"'temperature' \(use the temperature field\)"):
        swe_agent_model_config("smollm2-135m", completion_kwargs={"temperature": 0.0})
    with pytest.raises(ValueError, match=r"'n'.*'top_p'"):
        swe_agent_model_config("m", completion_kwargs={"top_p": 1.0, "n": 2, "stop": ["x"]})
    config = swe_agent_model_config("m", temperature=0.0, completion_kwargs={"max_tokens": 8})
    assert config["temperature"] == 0.0 and config["completion_kwargs"] == {"max_tokens": 8}


def test_the_small_model_agent_config_bounds_the_run_and_installs_nothing() -> None:
    agent = small_model_agent_config("smollm2-135m", "http://127.0.0.1:9", calls=2)
    assert agent["model"]["name"] == "talaria/smollm2-135m"
    assert agent["model"]["per_instance_call_limit"] == 2
    assert agent["model"]["per_instance_cost_limit"] == 0.0
    # tools/edit_anthropic (in SWE-agent's default.yaml) runs `pip install` on this machine.
    assert [b["path"] for b in agent["tools"]["bundles"]] == ["tools/registry", "tools/submit"]
    assert "pip" in agent["tools"]["filter"]["blocklist"]
    with pytest.raises(ValueError, match="calls must be at least 1"):
        small_model_agent_config("m", "http://127.0.0.1:9", calls=0)


def _root_writable() -> bool:
    return os.access("/", os.W_OK) and os.access("/root", os.W_OK)


@pytest.mark.skipif(not _root_writable(), reason="/ and /root are not writable here")
def test_local_deployment_cleanup_removes_only_what_the_run_created() -> None:
    name = f"talaria-cleanup-{uuid.uuid4().hex[:8]}"
    before = {p for p in ROOT_LEFTOVERS if os.path.lexists(p)}
    with local_deployment_cleanup(name):
        Path("/", name, "sub").mkdir(parents=True)
        with pytest.raises(FileExistsError, match="unique name"), local_deployment_cleanup(name):
            pass
    assert not Path("/", name).exists()
    assert {p for p in ROOT_LEFTOVERS if os.path.lexists(p)} == before
    with (
        pytest.raises(ValueError, match="plain directory name"),
        local_deployment_cleanup("../etc"),
    ):
        pass


def test_the_example_explains_itself_and_how_to_get_swe_agent() -> None:
    env = dict(os.environ, PYTHONPATH="")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "--serve" in done.stdout and "--sweagent-src" in done.stdout
    if sweagent_importable():
        return
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--calls", "1"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2
    assert "SWE-agent is not installed here. Pass --sweagent-src" in done.stderr


# --------------------------------------------------------------------------- the real run
@attrs.frozen
class ServedCall:
    session_id: str
    prompt_tokens: int
    cached_tokens: int


class UsageRecorder(Recorder):
    """``Recorder`` that also keeps every answered call's session id and usage."""

    def __init__(self, talaria: Talaria) -> None:
        super().__init__(talaria)
        self.answered: list[ServedCall] = []
        self._usage_lock = threading.Lock()

    def chat_stream(self, messages: Any, model: str, **kwargs: Any) -> Any:
        return self._watch(super().chat_stream(messages, model, **kwargs))

    async def _watch(self, stream: Any) -> AsyncIterator[Any]:
        async with aclosing(stream):
            async for chunk in stream:
                if chunk.usage is not None:
                    call = ServedCall(
                        chunk.session_id, chunk.usage.prompt_tokens, chunk.usage.cached_tokens
                    )
                    with self._usage_lock:
                        self.answered.append(call)
                yield chunk


@pytest.fixture(scope="module")
def sweagent_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python that imports ``sweagent``: this one, or a throwaway overlay environment."""
    if sweagent_importable():
        return Path(sys.executable)
    source = Path(os.getenv("TALARIA_SWE_AGENT_SRC", VENDORED))
    if not source.is_file():
        pytest.skip(f"SWE-agent is not installed and its source is not at {source}")
    venv = os.getenv("TALARIA_SWE_AGENT_VENV")
    target = Path(venv) if venv else tmp_path_factory.mktemp("sweagent") / "venv"
    return overlay_environment(source, target)


@pytest.fixture(scope="module")
def recorded() -> Iterator[tuple[str, UsageRecorder]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: more threads only thrash
    talaria = Talaria(TINY)
    recorder = UsageRecorder(talaria)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with talaria:
            yield

    try:
        app = create_app(recorder, api_keys=(), lifespan=lifespan)
        with serve_in_thread(app, start_timeout_s=300) as url:
            yield url, recorder
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not _root_writable(), reason="SWE-ReX's local deployment writes / and /root")
def test_a_real_swe_agent_run_is_one_session_with_measured_gaps_and_growing_cache(
    sweagent_python: Path, recorded: tuple[str, UsageRecorder], tmp_path: Path
) -> None:
    url, recorder = recorded
    sid = f"swe-run-{uuid.uuid4().hex[:8]}"
    # A unique name: the local deployment copies the repository to /<name>.
    repo = demo_repository(tmp_path, f"talaria-swe-test-{uuid.uuid4().hex[:8]}")
    summary_path = tmp_path / "summary.json"
    leftovers_before = {p for p in ROOT_LEFTOVERS if os.path.lexists(p)}
    calls_before = len(recorder.calls)
    sessions_before = recorder.talaria.stats()["sessions"]
    cmd = [str(sweagent_python), str(EXAMPLE), "--base-url", url, "--calls", str(CALLS)]
    cmd += ["--repo", str(repo), "--session-id", sid, "--summary", str(summary_path)]
    cmd += ["--output-dir", str(tmp_path / "trajectories")]
    started = time.monotonic()
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=""),
    )
    elapsed = time.monotonic() - started
    log = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, log
    report = json.loads(summary_path.read_text())

    # The run finished by SWE-agent's own rules, bounded by the call limit.
    assert report["finished"] and report["exit_status"] in FINISHED_STATUSES, report
    assert report["session_id"] == sid
    assert 1 <= report["api_calls"] <= CALLS + 1, report
    assert elapsed < 300, elapsed
    assert Path(report["trajectory"]).is_file()

    # Every call of the run carried the run's session id: one session, all its calls.
    run_calls = recorder.calls[calls_before:]
    assert run_calls == [sid] * report["api_calls"], run_calls
    answered = [c for c in recorder.answered if c.session_id == sid]
    assert len(answered) == report["api_calls"]
    sessions = recorder.talaria.stats()["sessions"]
    assert sessions["total"] - sessions_before["total"] == 1
    assert sessions["ended"] - sessions_before["ended"] == 1

    # Each command SWE-agent ran is one tool gap: predicted on start, measured on end; the
    # measured spans are SWE-agent's own execution times, give or take scheduling.
    events = recorder.events_of(sid)
    assert all(e["accepted"] for e in events), events
    kinds = [e["event"] for e in events]
    ran = [t for t in report["execution_s"] if t > 0]
    assert len(ran) >= 1, report  # the model's ```bash answers do run
    assert kinds == ["tool_start", "tool_end"] * len(ran) + ["end"], kinds
    for start, end, seconds in zip(events[0:-1:2], events[1:-1:2], ran, strict=True):
        assert start["tool"] == "bash" and start["expected_s"] > 0, start
        assert end["measured_s"] is not None, end
        assert seconds - 0.05 <= end["measured_s"] <= seconds + 1.0, (end, seconds)
    assert report["hints"] == {"sent": len(events), "dropped": 0, "failed": 0}

    # Every call resends the history: the reused prefix grows from call to call.
    cached = [c.cached_tokens for c in answered]
    assert all(b > 0 for b in cached[1:]), cached
    assert all(b >= a for a, b in itertools.pairwise(cached)), cached
    assert cached[-1] > cached[1] if len(cached) > 2 else cached[-1] > cached[0], cached
    assert all(c.cached_tokens < c.prompt_tokens for c in answered), answered

    # What the local deployment wrote outside the output directory is gone.
    assert not Path("/", repo.name).exists()
    assert {p for p in ROOT_LEFTOVERS if os.path.lexists(p)} == leftovers_before
