"""A fake ``talaria.api.Talaria`` for server unit tests, and a live uvicorn server helper.

The fake answers deterministically: one token per whitespace-separated word; the answer is
``"echo"`` followed by the words of the last message, in order, up to ``max_tokens``. Magic
words in the last message trigger failures: ``overload`` (Overloaded before the first chunk),
``crash-early`` (RuntimeError before the first chunk), ``fail-midstream`` (a 503
TalariaError after the first chunk), ``crash-midstream`` (RuntimeError after it).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
import attrs
import uvicorn
from fastapi import FastAPI

from talaria.errors import (
    BadRequest,
    ContextTooLong,
    Overloaded,
    TalariaError,
    UnknownModel,
    UnknownSession,
)

SECRET = "secret-internal-detail-xyz"  # must never reach a client


class InstanceFailed(TalariaError):
    http_status = 503
    code = "instance_failed"


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@attrs.frozen
class Chunk:
    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    instance: str
    session_id: str
    created: int
    index: int = 0
    logprobs: tuple[Any, ...] | None = None
    tool_calls: tuple[Any, ...] = ()
    first_call: int = 0
    prompt_tokens: int = 0
    max_tokens_clamped: int | None = None
    stop_sequence: str | None = None


@attrs.frozen
class ModelInfo:
    name: str
    context_length: int
    source: str
    created: int


@attrs.frozen
class Summary:
    session_id: str
    sct_s: float
    calls: int


@attrs.frozen
class FakeConfig:
    models: tuple[str, ...] = ("tiny",)
    api_keys: tuple[str, ...] = ()


class FakeTalaria:
    """Implements the server-facing contract of ``talaria.api.Talaria`` in memory."""

    def __init__(
        self, config: FakeConfig | None = None, context_length: int = 64, delay_s: float = 0.0
    ) -> None:
        self.config = config or FakeConfig()
        self.context_length = context_length
        self.delay_s = delay_s  # sleep before each chunk, seconds
        self.finished = 0  # streams that yielded their last chunk
        self.history: dict[str, list[str]] = {}  # session -> tokens computed so far
        self.calls: list[dict[str, Any]] = []
        self.closed = 0  # streams closed (finished, failed or abandoned)
        self.ended: list[str] = []
        self.broken: list[str] = []  # what integrity_problems reports

    def models(self) -> list[ModelInfo]:
        return [
            ModelInfo(m, self.context_length, "fake", 1_700_000_000) for m in self.config.models
        ]

    async def integrity_problems(self) -> list[str]:
        return list(self.broken)

    def stats(self) -> dict[str, Any]:
        kv = {"device_used": 3, "device_free": 5, "host_used": 1, "host_free": 7}
        inst = {
            "kv_blocks": kv,
            "reservations_held": 2,
            "queue_depth": 4,
            "active_model": "tiny",
            "counters": {"sp_admissions": 6, "weird": "not a number"},
        }
        return {
            "instances": {"i0": inst},
            "sessions": {"active": len(self.history), "ended": len(self.ended), "total": 9},
            "calls": {"total": len(self.calls)},
            "events": {"end": len(self.ended)},
            "model_switches": 11,
            "bytes_moved": 12345,
        }

    def chat_stream(
        self, messages: list[dict[str, Any]], model: str, **kw: Any
    ) -> AsyncIterator[Chunk]:
        tokens: list[str] = []
        for m in messages:
            tokens += [f"<{m['role']}>", *str(m.get("content") or "").split()]
        last = str(messages[-1].get("content") or "").split()
        return self._generate(tokens, last, model, kw)

    def complete_stream(
        self, prompt: str | Sequence[int], model: str, **kw: Any
    ) -> AsyncIterator[Chunk]:
        words = prompt.split() if isinstance(prompt, str) else [str(t) for t in prompt]
        return self._generate(words, words, model, kw)

    async def _generate(
        self, prompt: list[str], last: list[str], model: str, kw: dict[str, Any]
    ) -> AsyncIterator[Chunk]:
        self.calls.append({"model": model, **kw})
        if model not in self.config.models:
            raise UnknownModel(f"unknown model {model}")
        params = kw.get("params")
        max_tokens = (params.max_tokens if params is not None else None) or 16
        if len(prompt) + max_tokens > self.context_length:
            raise ContextTooLong(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceed the "
                f"context of {model} ({self.context_length} tokens)"
            )
        if "overload" in last:
            raise Overloaded("all instances are full")
        if "crash-early" in last:
            raise RuntimeError(SECRET)
        sid = kw.get("session_id") or f"one-{uuid.uuid4().hex[:8]}"
        seen = self.history.get(sid, [])
        cached = 0
        while cached < min(len(seen), len(prompt)) and seen[cached] == prompt[cached]:
            cached += 1
        answer = ["echo", *last][:max_tokens]
        finish = "length" if len(answer) < len(last) + 1 else "stop"
        base = dict(
            id=f"chatcmpl-{uuid.uuid4().hex[:8]}",
            model=model,
            instance="i0",
            session_id=sid,
            created=int(time.time()),
        )
        try:
            for i, word in enumerate(answer):
                if self.delay_s:
                    await anyio.sleep(self.delay_s)
                text = word if i == 0 else " " + word
                if i == 1 and "fail-midstream" in last:
                    raise InstanceFailed("instance i0 failed; the call was not completed")
                if i == 1 and "crash-midstream" in last:
                    raise RuntimeError(SECRET)
                if i == len(answer) - 1:
                    self.history[sid] = prompt + answer
                    usage = Usage(len(prompt), len(answer), cached)
                    yield Chunk(text=text, finish_reason=finish, usage=usage, **base)
                    self.finished += 1
                else:
                    yield Chunk(text=text, finish_reason=None, usage=None, **base)
        finally:
            self.closed += 1

    async def event(
        self,
        session_id: str,
        event: str,
        *,
        tool: str | None = None,
        expected_s: float | None = None,
        measured_s: float | None = None,
        tenant: str = "default",
    ) -> Summary | None:
        if event not in ("tool_start", "tool_end", "end"):
            raise BadRequest(f"unknown event {event!r}")
        if session_id not in self.history:
            raise UnknownSession(f"session {session_id!r} was never seen")
        if event == "end":
            self.ended.append(session_id)
            return Summary(session_id, 12.5, 3)
        return None


@contextlib.contextmanager
def live_server(app: FastAPI, startup_timeout_s: float = 120.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free 127.0.0.1 port in a background thread (lifespan
    on); yields the base URL; stops the server (graceful shutdown) on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the test server did not start (see the log above)")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
