"""The HTTP backend: a Talaria server (or any OpenAI-compatible one) through the ``openai``
client (a dependency of LiteLLM).

The client never retries (``max_retries=0``: retrying is LiteLLM's ``num_retries``).
Every failure leaves as a :class:`~talaria.integrations.litellm.call.CallError`: an HTTP error
answer or an error event inside a stream as :class:`ServerError`, no connection as
:class:`Unreachable`, a timeout as :class:`TimedOut`.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_usage import CompletionUsage

from talaria.integrations.litellm.call import (
    Answer,
    Call,
    CallError,
    Piece,
    ServerError,
    TimedOut,
    ToolCall,
    Unreachable,
    Usage,
)
from talaria.integrations.openai_chat import create_options

__all__ = ["HttpBackend", "openai_base_url", "translate_errors"]

_T = TypeVar("_T")

# Talaria's error codes (talaria.errors) whose status a streamed error event does not carry.
_CODE_STATUS = {
    "model_not_found": 404,
    "session_not_found": 404,
    "invalid_request_error": 400,
    "invalid_value": 400,
    "context_length_exceeded": 400,
    "overloaded": 503,
    "instance_failed": 503,
    "shutting_down": 503,
}


def openai_base_url(api_base: str) -> str:
    """``api_base`` as the ``openai`` client wants it: ``http://host:port/v1`` (a ``/v1``
    is added when missing; a trailing ``/`` dropped)."""
    base = api_base.strip().rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _error_fields(exc: openai.APIError) -> tuple[str, str | None, str | None, str | None]:
    body = exc.body if isinstance(exc.body, dict) else {}
    message = body.get("message") if isinstance(body.get("message"), str) else None
    code = exc.code if isinstance(exc.code, str) else None
    param = exc.param if isinstance(exc.param, str) else None
    kind = exc.type if isinstance(exc.type, str) else None
    return message or exc.message, code, param, kind


def _stream_error_status(code: str | None, kind: str | None) -> int:
    if code in _CODE_STATUS:
        return _CODE_STATUS[code]
    if kind == "overloaded_error":
        return 503
    return 400 if kind == "invalid_request_error" else 500


@contextmanager
def translate_errors() -> Iterator[None]:
    """Turn the ``openai`` client's exceptions into :class:`CallError` s."""
    try:
        yield
    except CallError:
        raise
    except openai.APITimeoutError as exc:
        raise TimedOut(f"the server did not answer in time ({exc.message})") from exc
    except openai.APIConnectionError as exc:
        url = str(exc.request.url) if getattr(exc, "request", None) is not None else "the server"
        raise Unreachable(
            f"cannot connect to the Talaria server at {url}: {exc.__cause__ or exc.message}. "
            "Is `talaria serve` running there?"
        ) from exc
    except openai.APIStatusError as exc:
        message, code, param, kind = _error_fields(exc)
        raise ServerError(exc.status_code, message, code=code, param=param, type=kind) from exc
    except openai.APIError as exc:  # an error event inside a stream
        message, code, param, kind = _error_fields(exc)
        status = _stream_error_status(code, kind)
        raise ServerError(status, message, code=code, param=param, type=kind) from exc


def _usage(usage: CompletionUsage | None) -> Usage | None:
    if usage is None:
        return None
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    return Usage(usage.prompt_tokens, usage.completion_tokens, int(cached or 0))


def _options(call: Call, stream: bool) -> dict[str, Any]:
    """Keyword arguments of ``chat.completions.create`` for ``call`` (:func:`create_options`)."""
    return create_options(
        call.model,
        call.messages,
        call.params,
        call.headers,
        stream=stream,
        session_id=call.session_id,
        timeout_s=call.timeout_s,
        connect_timeout_s=call.connect_timeout_s,
    )


def _answer(completion: ChatCompletion, headers: Any) -> Answer:
    if not completion.choices:
        raise ServerError(502, "the server answered without a choice", code="empty_answer")
    choice = completion.choices[0]
    calls = tuple(
        ToolCall(i, c.id, c.function.name, c.function.arguments)
        for i, c in enumerate(choice.message.tool_calls or ())
        if c.type == "function"
    )
    return Answer(
        text=choice.message.content or "",
        finish_reason=choice.finish_reason or "stop",
        usage=_usage(completion.usage),
        session_id=headers.get("x-session-id"),
        instance=headers.get("x-talaria-instance"),
        tool_calls=calls,
    )


def _pieces(chunk: ChatCompletionChunk, finish: list[str | None]) -> Iterator[Piece]:
    """Text and tool call pieces of one chunk; remembers the finish reason in
    ``finish[0]``; a usage chunk (sent last) yields the final piece."""
    for choice in chunk.choices[:1]:
        if choice.delta.content:
            yield Piece(choice.delta.content)
        deltas = choice.delta.tool_calls or ()
        calls = tuple(
            ToolCall(
                d.index,
                d.id,
                d.function.name if d.function else None,
                (d.function.arguments if d.function else None) or "",
            )
            for d in deltas
        )
        if calls:
            yield Piece("", tool_calls=calls)
        if choice.finish_reason:
            finish[0] = choice.finish_reason
    if chunk.usage is not None:
        yield Piece("", finish[0] or "stop", _usage(chunk.usage))
        finish[0] = None


class HttpBackend:
    """Calls to one server (``api_base``) with one API key. Thread-safe.

    The synchronous ``openai.OpenAI`` client is made on first use and kept (its connection
    pool serves every thread). Async calls open an ``openai.AsyncOpenAI`` per call, so that
    no connection outlives the event loop that opened it (``asyncio.run`` per call is
    common in agent code).
    """

    def __init__(self, api_base: str, api_key: str | None = None) -> None:
        self.base_url = openai_base_url(api_base)
        self._api_key = api_key or "EMPTY"
        self._client: openai.OpenAI | None = None
        self._lock = threading.Lock()

    def _sync(self) -> openai.OpenAI:
        with self._lock:
            if self._client is None:
                self._client = openai.OpenAI(
                    base_url=self.base_url, api_key=self._api_key, max_retries=0
                )
            return self._client

    def _async(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self._api_key, max_retries=0)

    # ------------------------------------------------------------------ sync
    def chat(self, call: Call) -> Answer:
        """One whole answer."""
        with translate_errors():
            raw = self._sync().chat.completions.with_raw_response.create(**_options(call, False))
            return _answer(raw.parse(), raw.headers)

    def stream(self, call: Call) -> Iterator[Piece]:
        """The answer in pieces. The request is sent (and an error answer raised) here,
        before the iterator is returned; closing the iterator closes the connection."""
        with translate_errors():
            stream = self._sync().chat.completions.create(**_options(call, True))
        return _guarded(_sync_pieces(stream), stream.close)

    # ------------------------------------------------------------------ async
    async def achat(self, call: Call) -> Answer:
        """One whole answer, on the caller's event loop."""
        with translate_errors():
            async with self._async() as client:
                raw = await client.chat.completions.with_raw_response.create(
                    **_options(call, False)
                )
                return _answer(raw.parse(), raw.headers)

    async def astream(self, call: Call) -> AsyncIterator[Piece]:
        """The answer in pieces, on the caller's event loop (the request is sent at the
        first ``__anext__``)."""
        finish: list[str | None] = [None]
        with translate_errors():
            async with self._async() as client:
                stream = await client.chat.completions.create(**_options(call, True))
                async with stream:
                    async for chunk in stream:
                        for piece in _pieces(chunk, finish):
                            yield piece
        if finish[0] is not None:  # the server sent no usage chunk
            yield Piece("", finish[0])

    def close(self) -> None:
        """Close the pooled connections (idempotent)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _sync_pieces(stream: openai.Stream[ChatCompletionChunk]) -> Iterator[Piece]:
    finish: list[str | None] = [None]
    for chunk in stream:
        yield from _pieces(chunk, finish)
    if finish[0] is not None:  # the server sent no usage chunk
        yield Piece("", finish[0])


def _guarded(pieces: Iterator[_T], close: Callable[[], object]) -> Iterator[_T]:
    """``pieces`` with errors translated and ``close`` called at the end, on error, or
    when the consumer closes the iterator."""
    guard: AbstractContextManager[None] = translate_errors()
    try:
        with guard:
            yield from pieces
    finally:
        close()
