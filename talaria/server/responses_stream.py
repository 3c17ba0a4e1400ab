"""The answers of ``POST /v1/responses``: a ``response`` object, whole or streamed as the
Responses API's server-sent events, built from the API's chunks
(``talaria.api.results.ChatChunk``).

One :class:`OutputBuilder` serves both: it turns chunks into output items (an assistant
``message`` with one ``output_text`` part per stretch of text, a ``function_call`` per
tool call, in the order the model wrote them) and yields the events of each step, which
:func:`sse` sends and :func:`whole` drops, so a streamed answer and the same answer whole
carry the same items. Events, each with its ``sequence_number`` (from 0):
``response.created``, ``response.in_progress``; per message ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (one per chunk of text),
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; per call ``response.output_item.added``,
``response.function_call_arguments.delta`` (the arguments whole: calls are read once the
model closed them), ``response.function_call_arguments.done``,
``response.output_item.done``; then ``response.completed``, or ``response.incomplete``
(``incomplete_details.reason: "max_output_tokens"``) when the answer hit its token cap. An
error after the stream began is an ``error`` event followed by ``response.failed``. There
is no ``[DONE]`` line (the Responses API has none).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

import anyio
import attrs
from fastapi import Request

from talaria.api.results import ChatChunk, ToolCall, Usage
from talaria.errors import TalariaError
from talaria.server import streaming
from talaria.server.errors import HttpError, from_talaria, internal


@attrs.frozen
class FunctionName:
    """A function's name as the client knows it (``namespace`` None for a top-level
    function) and as the model is shown it (:attr:`exposed`)."""

    namespace: str | None
    name: str

    @property
    def exposed(self) -> str:
        """``NAMESPACE.NAME``, or ``NAME`` outside a namespace."""
        return self.name if self.namespace is None else f"{self.namespace}.{self.name}"


@attrs.frozen
class ResponseHead:
    """What every ``response`` object of one answer repeats."""

    id: str
    created_at: int
    model: str
    echo: Mapping[str, Any]
    names: Mapping[str, FunctionName]  # model-facing name -> the client's


def usage_dict(usage: Usage | None) -> dict[str, Any] | None:
    """The Responses API's ``usage``; ``cached_tokens`` counts the prompt's tokens the
    prefix cache served."""
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def response_object(
    head: ResponseHead,
    status: str,
    output: list[dict[str, Any]],
    usage: Usage | None = None,
    error: HttpError | None = None,
) -> dict[str, Any]:
    """A ``response`` object with ``status`` (``in_progress``, ``completed``,
    ``incomplete`` or ``failed``)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": head.id,
        "object": "response",
        "created_at": head.created_at,
        "status": status,
        "error": None if error is None else {"code": error.code, "message": error.message},
        "incomplete_details": incomplete,
        "model": head.model,
        "output": output,
        "usage": usage_dict(usage),
        **head.echo,
    }


class OutputBuilder:
    """The output items of one answer, built chunk by chunk; each step returns its events
    (see the module docstring)."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.output: list[dict[str, Any]] = []
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self._sequence = 0
        self._text: list[str] | None = None  # the open message's text, None when none is

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event of type ``kind`` with the next sequence number."""
        out = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [
            self.event(kind, response=response_object(self.head, "in_progress", []))
            for kind in ("response.created", "response.in_progress")
        ]

    def chunk(self, chunk: ChatChunk) -> list[dict[str, Any]]:
        """The events of one chunk: its text, its whole tool calls, and the end of the
        answer when it carries the ``finish_reason``."""
        events: list[dict[str, Any]] = []
        if chunk.text:
            if self._text is None:
                events += self._open_message()
                self._text = []
            self._text.append(chunk.text)
            events.append(
                self._text_event("response.output_text.delta", delta=chunk.text, logprobs=[])
            )
        for call in chunk.tool_calls:
            events += self._close_message("completed")
            events += self._call(call)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.usage = chunk.usage
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Close the open message (an answer with no item gets an empty message), then
        ``response.completed`` or, cut by the token cap, ``response.incomplete``."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events: list[dict[str, Any]] = []
        if not self.output and self._text is None:
            events += self._open_message()
            self._text = []
        events += self._close_message(status)
        events.append(self.event(f"response.{status}", response=self.response(status)))
        return events

    def failed(self, error: HttpError) -> list[dict[str, Any]]:
        """An ``error`` event and ``response.failed`` (with the items finished so far)."""
        return [
            self.event("error", code=error.code, message=error.message, param=error.param),
            self.event(
                "response.failed",
                response=response_object(self.head, "failed", self.finished(), error=error),
            ),
        ]

    def response(self, status: str) -> dict[str, Any]:
        """The ``response`` object of the finished answer."""
        return response_object(self.head, status, self.finished(), self.usage)

    def finished(self) -> list[dict[str, Any]]:
        """The output items that are done (an open message is not)."""
        return [item for item in self.output if item["status"] != "in_progress"]

    def _open_message(self) -> list[dict[str, Any]]:
        item = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.output.append(item)
        index = len(self.output) - 1
        return [
            self.event("response.output_item.added", output_index=index, item=dict(item)),
            self._text_event("response.content_part.added", part=_text_part("")),
        ]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self._text is None:
            return []
        text, self._text = "".join(self._text), None
        item = self.output[-1]
        item.update(status=status, content=[_text_part(text)])
        index = len(self.output) - 1
        return [
            self._text_event("response.output_text.done", index, text=text, logprobs=[]),
            self._text_event("response.content_part.done", index, part=_text_part(text)),
            self.event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def _text_event(self, kind: str, index: int | None = None, **fields: Any) -> dict[str, Any]:
        """An event about the text part of the message at ``index`` (default: the last
        item, the open message)."""
        index = len(self.output) - 1 if index is None else index
        item_id = self.output[index]["id"]
        return self.event(kind, item_id=item_id, output_index=index, content_index=0, **fields)

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        name = self.head.names.get(call.name, FunctionName(None, call.name))
        item: dict[str, Any] = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call.id,
            "name": name.name,
            "arguments": "",
            "status": "in_progress",
        }
        if name.namespace is not None:
            item["namespace"] = name.namespace
        self.output.append(item)
        index, where = len(self.output) - 1, {"item_id": item["id"]}
        added = self.event("response.output_item.added", output_index=index, item=dict(item))
        item.update(arguments=call.arguments, status="completed")
        return [
            added,
            self.event(
                "response.function_call_arguments.delta",
                output_index=index,
                delta=call.arguments,
                **where,
            ),
            self.event(
                "response.function_call_arguments.done",
                output_index=index,
                arguments=call.arguments,
                name=name.name,
                **where,
            ),
            self.event("response.output_item.done", output_index=index, item=dict(item)),
        ]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def whole(
    first: ChatChunk, stream: AsyncIterator[ChatChunk], head: ResponseHead
) -> dict[str, Any]:
    """The finished ``response`` object of a call (closes ``stream``). Errors raise (the
    HTTP error answers them)."""
    builder = OutputBuilder(head)
    try:
        async for chunk in _chunks(first, stream):
            builder.chunk(chunk)
    finally:
        await streaming.close(stream)
    builder.finish()
    return builder.response("incomplete" if builder.finish_reason == "length" else "completed")


async def sse(
    request: Request, first: ChatChunk, stream: AsyncIterator[ChatChunk], head: ResponseHead
) -> AsyncIterator[bytes]:
    """The server-sent events of one answer (see the module docstring). Records the
    outcome (200, the error's status, or 499 if the client left) for metrics; always
    closes ``stream``."""
    builder = OutputBuilder(head)
    status = 499
    try:
        for event in builder.start():
            yield _encode(event)
        async with aclosing(_chunks(first, stream)) as chunks:
            async for chunk in chunks:
                for event in builder.chunk(chunk):
                    yield _encode(event)
        for event in builder.finish():
            yield _encode(event)
        status = 200
    except TalariaError as exc:
        err = from_talaria(exc)
        status = err.status
        for event in builder.failed(err):
            yield _encode(event)
    except Exception as exc:
        err = internal(exc)
        status = err.status
        for event in builder.failed(err):
            yield _encode(event)
    finally:
        request.state.talaria_stream_status = status
        with anyio.CancelScope(shield=True):
            await streaming.close(stream)


async def _chunks(first: ChatChunk, stream: AsyncIterator[ChatChunk]) -> AsyncGenerator[ChatChunk]:
    """``first`` and the rest of ``stream`` up to the chunk that finishes the answer."""
    chunk: ChatChunk | None = first
    while chunk is not None:
        yield chunk
        if chunk.finish_reason is not None:
            return
        chunk = await anext(stream, None)


def _encode(event: Mapping[str, Any]) -> bytes:
    """One event on the wire: its ``event:`` line (the type) and its ``data:`` line."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
