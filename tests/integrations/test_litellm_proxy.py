"""The LiteLLM proxy for real: ``litellm --config`` with Talaria in ``custom_provider_map``,
the official ``openai`` client talking to the proxy, and the session ids and hints reaching
the Talaria server behind it (hints through a proxy pass-through route to
``/v1/sessions/{id}/events``).

The proxy needs the ``litellm-proxy`` extra (``pip install -e '.[litellm-proxy]'``, part of
``dev``): LiteLLM's own ``litellm[proxy]`` pins a ``litellm-proxy`` package that the registry
does not serve, so its dependencies are listed by name."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from benchmarks.serve_process import free_port
from tests.integrations.live_server import MODEL, Served

ROOT = Path(__file__).resolve().parents[2]
MASTER_KEY = "sk-talaria-proxy-test-0123456789"  # the proxy refuses to start without one
PROXY_DEPS = ("backoff", "orjson", "apscheduler", "fastapi_sso", "mcp", "semver", "expression")

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in PROXY_DEPS),
    reason="the LiteLLM proxy's dependencies are missing: pip install -e '.[litellm-proxy]'",
)


def proxy_config(talaria_url: str) -> str:
    return f"""
model_list:
  - model_name: smollm2
    litellm_params:
      model: talaria/{MODEL}
      api_base: {talaria_url}
litellm_settings:
  custom_provider_map:
    - provider: talaria
      custom_handler: talaria.integrations.litellm.talaria_llm
general_settings:
  master_key: {MASTER_KEY}
  pass_through_endpoints:
    - path: /talaria/sessions
      target: {talaria_url}/v1/sessions
      include_subpath: true
"""


@pytest.fixture(scope="module")
def proxy(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("litellm-proxy")
    config = home / "config.yaml"
    config.write_text(proxy_config(served.url))
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # offline: the bundled price list
        LITELLM_LOG="ERROR",
    )
    litellm_cli = Path(sys.executable).with_name("litellm")
    log = (home / "proxy.log").open("wb")
    proc = subprocess.Popen(
        [str(litellm_cli), "--config", str(config), "--port", str(port), "--host", "127.0.0.1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=home,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError((home / "proxy.log").read_text()[-3000:])
            try:
                if httpx.get(url + "/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the LiteLLM proxy did not start in 300 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_openai_calls_through_the_proxy_keep_their_session_and_hints(
    proxy: str, served: Served
) -> None:
    client = openai.OpenAI(base_url=proxy + "/v1", api_key=MASTER_KEY, max_retries=0, timeout=300)
    session = "proxy-agent-1"
    messages: list[Any] = [{"role": "user", "content": "Repeat after me: 3, 4, 5"}]
    first = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"litellm_session_id": session},
    )
    answer = first.choices[0].message.content or ""
    assert answer

    hints = httpx.Client(base_url=proxy, headers={"Authorization": f"Bearer {MASTER_KEY}"})
    start = hints.post(
        f"/talaria/sessions/{session}/events",
        json={"event": "tool_start", "tool": "bash", "expected_s": 0.2},
    )
    assert start.status_code == 200, start.text
    done = hints.post(
        f"/talaria/sessions/{session}/events", json={"event": "tool_end", "measured_s": 0.2}
    )
    assert done.status_code == 200, done.text

    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And now 6, 7"},
    ]
    second = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"metadata": {"session_id": session}},  # the other way to name it
    )
    assert second.choices[0].message.content
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) > 0  # the session's KV

    end = hints.post(f"/talaria/sessions/{session}/events", json={"event": "end"})
    assert end.status_code == 200 and end.json()["summary"]["calls"] == 2

    # what reached the server: both calls in the one session, and the three hints
    assert served.recorder.calls.count(session) == 2
    kinds = [(e["event"], e["accepted"]) for e in served.recorder.events_of(session)]
    assert kinds == [("tool_start", True), ("tool_end", True), ("end", True)]
    unknown = hints.post("/talaria/sessions/nobody/events", json={"event": "end"})
    assert unknown.status_code == 404  # Talaria's answer, passed through
