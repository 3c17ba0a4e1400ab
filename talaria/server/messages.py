"""The Anthropic Messages API: ``POST /v1/messages`` (whole or streamed) and ``POST
/v1/messages/count_tokens``, as Claude Code calls them (``?beta=true`` is accepted and
changes nothing).

A request (``talaria.server.anthropic_requests``) becomes an OpenAI-style chat for the
in-process API: the same chat template, tool machinery (``talaria.api.tool_choice``),
sessions (``talaria.server.session_ids``) and tenants (``Authorization: Bearer`` or
``x-api-key``) as ``/v1/chat/completions``; the answer is shaped by
``talaria.server.anthropic_responses``. Errors, before or during a stream, are in
Anthropic's shape (``talaria.server.errors.ErrorShape``). ``count_tokens`` counts the
prompt exactly as the messages call would build it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse

from talaria.api.results import ChatChunk
from talaria.errors import TalariaError
from talaria.server import anthropic_responses as ar
from talaria.server import handling, streaming
from talaria.server.anthropic_requests import HINTS, CountTokensRequest, MessagesRequest
from talaria.server.errors import ErrorShape, from_talaria, internal
from talaria.server.requests import StrictModel
from talaria.server.session_ids import session_of

log = logging.getLogger(__name__)


async def messages(request: Request) -> Response:
    """``POST /v1/messages``: one answer, whole (a ``message``) or as Anthropic's
    server-sent events. Errors raised before the first token keep their own status."""
    body = await handling.parse(request, MessagesRequest, HINTS)
    ctx = handling.context(request)
    handling.require_model(request, body.model)
    request.state.talaria_model = body.model
    user_id = body.metadata.user_id if body.metadata is not None else None
    sid = session_of(request.headers, body.session_id, metadata_user_id=user_id)
    tools, choice = body.chat_tools()
    request.state.talaria_ignored = ignored = body.unknown_fields()
    if ignored:
        log.warning("ignored unknown request fields: %s", ", ".join(ignored)[:500])

    def open_stream() -> AsyncIterator[ChatChunk]:
        return ctx.backend.chat_stream(
            body.chat_messages(),
            body.model,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=body.parallel_tool_calls(),
            session_id=sid,
            tenant=handling.tenant(request),
            params=body.sampling_params(),
        )

    first, stream = await handling.first_chunk(request, open_stream, body.model)
    headers = handling.answer_headers(request, first)
    if body.stream:
        headers["Cache-Control"] = "no-cache"
        events = _sse(request, first, stream, body)
        return streaming.SameTaskStream(events, media_type="text/event-stream", headers=headers)
    builder = ar.BlockBuilder()
    try:
        last = await _build(builder, first, stream)
    finally:
        await streaming.close(stream)
    stops = body.stop_sequences or ()
    return JSONResponse(ar.message(first, body.model, builder.blocks, last, stops), headers=headers)


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the prompt's tokens as
    the same body sent to ``/v1/messages`` would have them (template and tools)."""
    body = await handling.parse(request, CountTokensRequest, HINTS)
    model = handling.require_model(request, body.model).name
    request.state.talaria_model = model
    tools, choice = body.chat_tools()
    out = handling.context(request).backend.tokenize(
        model,
        messages=body.chat_messages(),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls(),
    )
    return JSONResponse({"input_tokens": len(out.token_ids)})


# (path, handler, request schema) of each endpoint, for ``talaria.server.routes.add_routes``
POSTS: tuple[tuple[str, Callable[..., Any], type[StrictModel]], ...] = (
    ("/v1/messages", messages, MessagesRequest),
    ("/v1/messages/count_tokens", count_tokens, CountTokensRequest),
)


async def _build(
    builder: ar.BlockBuilder, first: ChatChunk, stream: AsyncIterator[ChatChunk]
) -> ChatChunk:
    """Feed every chunk up to the finishing one to ``builder`` (a whole answer: the events
    are not needed); returns the finishing chunk. Raises ``TalariaError`` for a stream
    that ends without one."""
    chunk: ChatChunk | None = first
    while chunk is not None:
        builder.feed(chunk)
        if chunk.finish_reason is not None:
            builder.close()
            return chunk
        chunk = await anext(stream, None)
    raise TalariaError("the call ended without a finish")


async def _message_events(
    first: ChatChunk, stream: AsyncIterator[ChatChunk], body: MessagesRequest
) -> AsyncGenerator[dict[str, Any]]:
    """The events of one streamed answer, without error handling: ``message_start``,
    ``ping``, the content blocks' events, ``message_delta``, ``message_stop``."""
    yield {"type": "message_start", "message": ar.message(first, body.model, [], None)}
    yield {"type": "ping"}
    builder = ar.BlockBuilder()
    chunk: ChatChunk | None = first
    while chunk is not None:
        for event in builder.feed(chunk):
            yield event
        if chunk.finish_reason is not None:
            for event in builder.close():
                yield event
            yield ar.message_delta(chunk, body.stop_sequences or ())
            yield {"type": "message_stop"}
            return
        chunk = await anext(stream, None)
    raise TalariaError("the call ended without a finish")


async def _sse(
    request: Request, first: ChatChunk, stream: AsyncIterator[ChatChunk], body: MessagesRequest
) -> AsyncIterator[bytes]:
    """Server-sent events of one answer; a failure after the stream began is an ``error``
    event in Anthropic's shape, and ends the stream. Records the outcome (200, the error's
    status, or 499 if the client left) for metrics; always closes ``stream``."""
    status = 499
    try:
        async with aclosing(_message_events(first, stream, body)) as events:
            async for event in events:
                yield ar.event_bytes(event)
        status = 200
    except TalariaError as exc:
        err = from_talaria(exc)
        status = err.status
        yield err.sse_event(ErrorShape.ANTHROPIC)
    except Exception as exc:
        err = internal(exc)
        status = err.status
        yield err.sse_event(ErrorShape.ANTHROPIC)
    finally:
        request.state.talaria_stream_status = status
        with anyio.CancelScope(shield=True):
            await streaming.close(stream)
