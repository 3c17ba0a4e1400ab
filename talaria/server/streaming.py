"""Server-sent events: how one streamed answer goes out on the wire.

:func:`sse` turns the API's chunks (``talaria.api.results.ChatChunk``) into OpenAI's SSE
events, shaped by ``talaria.server.responses``; errors after the stream began become an SSE
error event (``talaria.server.errors``). :class:`SameTaskStream` sends them from the
request's own task. The routes (``talaria.server.routes``) decide whether a call streams at
all.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from talaria.api.results import ChatChunk, Usage
from talaria.errors import TalariaError
from talaria.server import responses as resp
from talaria.server.errors import from_talaria, internal


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def sse(
    request: Request,
    first: ChatChunk,
    stream: AsyncIterator[ChatChunk],
    head: resp.ChunkHead,
    chat: bool,
    n: int = 1,
) -> AsyncIterator[bytes]:
    """Server-sent events of one answer of ``n`` choices: (chat) a role chunk per choice,
    content chunks (with their tokens' ``logprobs`` when asked for), a ``tool_calls`` delta
    per batch of whole tool calls, a chunk with
    ``finish_reason`` per choice, a usage chunk if asked (the request's, see
    ``Usage.of_choices``), then ``data: [DONE]``. An error after the stream began is sent
    as an ``{"error": ...}`` event followed by ``[DONE]``. Records the outcome (200, the
    error's status, or 499 if the client left) for metrics; always closes ``stream``."""
    status = 499
    try:
        async with aclosing(_answer_events(first, stream, head, chat, n)) as events:
            async for event in events:
                yield event
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


async def _answer_events(
    first: ChatChunk, stream: AsyncIterator[ChatChunk], head: resp.ChunkHead, chat: bool, n: int
) -> AsyncGenerator[bytes]:
    """The events of :func:`sse` up to ``[DONE]``, without its error handling."""
    if chat:
        for i in range(n):
            yield _data(resp.chat_chunk(head, {"role": "assistant", "content": ""}, index=i))
    usages: dict[int, Usage] = {}
    offsets = [0] * n  # text_offset of each choice's next token (legacy logprobs)
    finished: set[int] = set()
    chunk: ChatChunk | None = first
    while chunk is not None:
        for event in _chunk_events(head, chunk, chat, offsets):
            yield event
        if chunk.finish_reason is not None:
            finished.add(chunk.index)
            if chunk.usage is not None:
                usages[chunk.index] = chunk.usage
            if len(finished) == n:
                break
        chunk = await anext(stream, None)
    if chat:  # a stream that ended early: its open choices end with "stop"
        for i in sorted(set(range(n)) - finished):
            yield _data(resp.chat_chunk(head, {}, "stop", i))
    if head.include_usage and len(usages) == n:
        total = Usage.of_choices(tuple(usages[i] for i in range(n)))
        yield _data(resp.usage_chunk(head, total, chat))


def _chunk_events(
    head: resp.ChunkHead, chunk: ChatChunk, chat: bool, offsets: list[int]
) -> Iterator[bytes]:
    """The events of one chunk: its content (and logprobs), its whole tool calls, and the
    choice's finishing chunk; advances the choice's legacy ``text_offset`` in ``offsets``."""
    i, done = chunk.index, chunk.finish_reason is not None
    if chat and (chunk.text or chunk.logprobs):
        lps = resp.chat_logprobs(chunk.logprobs)
        yield _data(resp.chat_chunk(head, {"content": chunk.text}, None, i, lps))
    if chat and chunk.tool_calls:
        base = chunk.first_call
        calls = [resp.tool_call_dict(c, base + k) for k, c in enumerate(chunk.tool_calls)]
        yield _data(resp.chat_chunk(head, {"tool_calls": calls}, None, i))
    elif not chat and (chunk.text or chunk.logprobs or done):
        lps = resp.text_logprobs(chunk.logprobs, offsets[i])
        offsets[i] += sum(len(e.token) for e in chunk.logprobs or ())
        yield _data(resp.text_chunk(head, chunk.text, chunk.finish_reason, i, lps))
    if done and chat:
        yield _data(resp.chat_chunk(head, {}, chunk.finish_reason, i))


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
