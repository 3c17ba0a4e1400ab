"""A live Talaria server on 127.0.0.1 whose backend records every call's session id and every
hint event, shared by the LangChain and LiteLLM end-to-end tests (``served``)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import torch
import uvicorn
from fastapi import FastAPI

from talaria.api import Talaria, TalariaConfig
from talaria.server.app import create_app

MODEL = "smollm2-135m"
TINY = TalariaConfig(models=(MODEL,), device_memory_bytes=2 * 10**9, host_memory_bytes=2 * 10**9)


class Recorder:
    """``talaria.Talaria`` as the server sees it, recording what arrives: the session id of
    every chat call, and every hint event (with whether Talaria accepted it)."""

    def __init__(self, talaria: Talaria) -> None:
        self.talaria = talaria
        self.calls: list[str | None] = []
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    @property
    def config(self) -> TalariaConfig:
        return self.talaria.config

    def chat_stream(self, messages: Any, model: str, **kwargs: Any) -> Any:
        with self._lock:
            self.calls.append(kwargs.get("session_id"))
        return self.talaria.chat_stream(messages, model, **kwargs)

    async def chat(self, messages: Any, model: str, **kwargs: Any) -> Any:
        with self._lock:
            self.calls.append(kwargs.get("session_id"))
        return await self.talaria.chat(messages, model, **kwargs)

    def complete_stream(self, prompt: str, model: str, **kwargs: Any) -> Any:
        return self.talaria.complete_stream(prompt, model, **kwargs)

    def tokenize(self, model: str, **kwargs: Any) -> Any:
        return self.talaria.tokenize(model, **kwargs)

    def detokenize(self, model: str, token_ids: Any) -> str:
        return self.talaria.detokenize(model, token_ids)

    async def integrity_problems(self) -> list[str]:
        return await self.talaria.integrity_problems()

    async def event(self, session_id: str, event: str, **fields: Any) -> Any:
        record = {"session_id": session_id, "event": event, **fields, "accepted": False}
        with self._lock:
            self.events.append(record)
        result = await self.talaria.event(session_id, event, **fields)
        record["accepted"] = True
        return result

    def models(self) -> Any:
        return self.talaria.models()

    def stats(self) -> Any:
        return self.talaria.stats()

    def events_of(self, session_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["session_id"] == session_id]


@attrs.frozen
class Served:
    url: str
    talaria: Talaria
    recorder: Recorder
    loop: asyncio.AbstractEventLoop


@contextmanager
def serve_recorded() -> Iterator[Served]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: more threads only thrash
    talaria = Talaria(TINY)
    recorder = Recorder(talaria)
    loops: list[asyncio.AbstractEventLoop] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with talaria:
            loops.append(asyncio.get_running_loop())
            yield

    app = create_app(recorder, api_keys=(), lifespan=lifespan)
    try:
        with serve_in_thread(app, start_timeout_s=300) as url:
            yield Served(url, talaria, recorder, loops[0])
    finally:
        torch.set_num_threads(threads)


@contextmanager
def serve_in_thread(app: FastAPI, start_timeout_s: float = 120) -> Iterator[str]:
    """uvicorn on a free 127.0.0.1 port in a daemon thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
