"""Server-sent events: how one streamed answer goes out on the wire.

:func:`sse` turns the API's chunks (``talaria.server.schemas.ChunkLike``) into OpenAI's SSE
events, shaped by ``schemas``; errors after the stream began become an SSE error event
(``talaria.server.errors``). :class:`SameTaskStream` sends them from the request's own task.
The routes (``talaria.server.routes``) decide whether a call streams at all.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from talaria.errors import TalariaError
from talaria.server import schemas as s
from talaria.server.errors import from_talaria, internal


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def sse(
    request: Request,
    first: s.ChunkLike,
    stream: AsyncIterator[s.ChunkLike],
    head: s.ChunkHead,
    chat: bool,
) -> AsyncIterator[bytes]:
    """Server-sent events of one answer: (chat) a role chunk, content chunks, a chunk with
    ``finish_reason``, a usage chunk if asked, then ``data: [DONE]``. An error after the
    stream began is sent as an ``{"error": ...}`` event followed by ``[DONE]``. Records the
    outcome (200, the error's status, or 499 if the client left) for metrics; always closes
    ``stream``."""
    status = 499
    try:
        if chat:
            yield _data(s.chat_chunk(head, {"role": "assistant", "content": ""}))
        chunk = first
        while True:
            done = chunk.finish_reason is not None
            if chat and chunk.text:
                yield _data(s.chat_chunk(head, {"content": chunk.text}))
            elif not chat and (chunk.text or done):
                yield _data(s.text_chunk(head, chunk.text, chunk.finish_reason))
            if done:
                break
            nxt = await anext(stream, None)
            if nxt is None:
                break
            chunk = nxt
        if chat:
            yield _data(s.chat_chunk(head, {}, chunk.finish_reason or "stop"))
        if head.include_usage and chunk.usage is not None:
            yield _data(s.usage_chunk(head, chunk.usage, chat))
        status = 200
    except TalariaError as exc:
        err = from_talaria(exc)
        status = err.status
        yield err.sse_event()
    except Exception as exc:
        err = internal(exc)
        status = err.status
        yield err.sse_event()
    finally:
        request.state.talaria_stream_status = status
        with anyio.CancelScope(shield=True):
            await close(stream)
    yield b"data: [DONE]\n\n"


async def close(stream: object) -> None:
    """Close an async generator (releases the call on the API side); a no-op for other
    iterators."""
    aclose: Callable[[], Awaitable[None]] | None = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class SameTaskStream(StreamingResponse):
    """A streaming response that iterates its body in the request's own task (Starlette
    moves it to a child task), so the API's stream is consumed by the task that opened it;
    a client disconnect cancels the iteration."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self.stream_response(send)
            finally:
                with anyio.CancelScope(shield=True):
                    await close(self.body_iterator)
            tg.cancel_scope.cancel()
