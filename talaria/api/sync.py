"""``SyncTalaria``: ``talaria.api.talaria.Talaria`` for synchronous scripts.

The async API runs on a background thread (an anyio blocking portal); each method blocks
until the async call it forwards to returns.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Unpack

import anyio
import anyio.abc
import anyio.from_thread

from talaria.api.config import TalariaConfig
from talaria.api.results import ChatChunk, ChatResult, ModelInfo, Tokenized
from talaria.api.talaria import CallArgs, ChatArgs, Talaria
from talaria.runtime.sessions import SessionSummary


class SyncTalaria(AbstractContextManager["SyncTalaria"]):
    """``Talaria`` for synchronous scripts: its loop runs on a background thread (an anyio
    blocking portal) in one long-lived task that holds the ``async with``."""

    def __init__(self, config: TalariaConfig | None = None) -> None:
        self.talaria = Talaria(config)
        self._portal_cm: Any = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._held: Any = None
        self._stop: anyio.Event | None = None

    async def _hold(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with self.talaria:
            self._stop = anyio.Event()
            task_status.started()
            await self._stop.wait()

    def __enter__(self) -> SyncTalaria:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        portal = self._portal_cm.__enter__()
        try:
            self._held, _ = portal.start_task(self._hold)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._portal = portal
        return self

    def __exit__(self, *exc_info: Any) -> None:
        portal = self._require()
        try:
            if self._stop is not None:
                portal.call(self._stop.set)
            self._held.result()
        finally:
            self._portal = None
            self._portal_cm.__exit__(*exc_info)

    def _require(self) -> anyio.from_thread.BlockingPortal:
        if self._portal is None:
            raise RuntimeError("use `with SyncTalaria(config) as t:`")
        return self._portal

    def chat(
        self, messages: Sequence[Mapping[str, Any]], model: str, **kwargs: Unpack[ChatArgs]
    ) -> ChatResult:
        portal = self._require()
        return portal.call(lambda: self.talaria.chat(messages, model, **kwargs))

    def chat_stream(
        self, messages: Sequence[Mapping[str, Any]], model: str, **kwargs: Unpack[ChatArgs]
    ) -> Iterator[ChatChunk]:
        portal = self._require()
        stream = portal.call(
            lambda: _aiter_ready(self.talaria.chat_stream(messages, model, **kwargs))
        )
        while True:
            try:
                yield portal.call(stream.__anext__)
            except StopAsyncIteration:
                return

    def complete(
        self, prompt: str | Sequence[int], model: str, **kwargs: Unpack[CallArgs]
    ) -> ChatResult:
        portal = self._require()
        return portal.call(lambda: self.talaria.complete(prompt, model, **kwargs))

    def event(self, session_id: str, event: str, **kwargs: Any) -> SessionSummary | None:
        portal = self._require()
        return portal.call(lambda: self.talaria.event(session_id, event, **kwargs))

    def stats(self) -> dict[str, Any]:
        return self.talaria.stats()

    def tokenize(self, model: str, **kwargs: Any) -> Tokenized:
        return self.talaria.tokenize(model, **kwargs)

    def detokenize(self, model: str, token_ids: Sequence[int]) -> str:
        return self.talaria.detokenize(model, token_ids)

    def models(self) -> list[ModelInfo]:
        return self.talaria.models()


async def _aiter_ready(it: AsyncIterator[ChatChunk]) -> AsyncIterator[ChatChunk]:
    return it
