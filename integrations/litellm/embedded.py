"""The embedded backend: a ``talaria.Talaria`` in this process, on its own event loop.

:meth:`EmbeddedTalaria.start` loads the models on a daemon thread that runs an asyncio
loop holding ``async with Talaria(config)`` for the backend's lifetime (a daemon, so a
process that forgets :meth:`~EmbeddedTalaria.close` still exits). :meth:`EmbeddedTalaria.attach`
serves calls from a ``Talaria`` that already runs on some loop (a server's, a test's).

Calls are validated exactly as the HTTP server validates them (``talaria.server.requests``),
so a call that the server would refuse fails here with the same status and message, as a
:class:`~talaria.integrations.litellm.call.ServerError`. Each call runs as one task on the
Talaria loop; a streamed call is pumped by one task into a queue that the caller drains
(from a thread or from its own event loop), and is cancelled when the caller stops early.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from pydantic import ValidationError

from talaria.errors import TalariaError
from talaria.integrations.litellm.call import (
    Answer,
    Call,
    Piece,
    ServerError,
    TimedOut,
    ToolCall,
    Usage,
)
from talaria.server import requests
from talaria.server.errors import HttpError, from_talaria, from_validation

if TYPE_CHECKING:
    from talaria.api import ChatChunk, Talaria, TalariaConfig

__all__ = ["EmbeddedTalaria"]

_T = TypeVar("_T")
DEFAULT_STARTUP_TIMEOUT_S = 600.0


@attrs.frozen
class _End:
    """The stream finished."""


@attrs.frozen
class _Failed:
    error: BaseException


_Item = Any  # a ChatChunk, _End or _Failed


def _server_error(exc: HttpError) -> ServerError:
    return ServerError(exc.status, exc.message, code=exc.code, param=exc.param)


def _as_call_error(exc: BaseException) -> BaseException:
    """The error the caller sees for a failure inside Talaria."""
    if isinstance(exc, HttpError):
        return _server_error(exc)
    if isinstance(exc, TalariaError):
        return _server_error(from_talaria(exc))
    return exc


def _chat_kwargs(call: Call) -> dict[str, Any]:
    """``Talaria.chat`` keyword arguments for ``call``, validated like the server's
    ``/v1/chat/completions`` (raises ``ServerError``)."""
    try:
        raw = json.dumps({**call.body(), "stream": False}, default=_jsonable)
        request = requests.ChatCompletionRequest.model_validate_json(raw)
        request.check()
        sid = call.session_id
        if sid is not None:
            sid = requests.check_session_id(sid, "the session id")
    except ValidationError as exc:
        raise _server_error(from_validation(exc)) from None
    except HttpError as exc:
        raise _server_error(exc) from None
    try:  # the provider refuses logprobs and n > 1 before any backend
        params = attrs.evolve(request.sampling_params(), logprobs=None)
    except TalariaError as exc:
        raise _server_error(from_talaria(exc)) from None
    return {
        "messages": request.api_messages(),
        "model": request.model,
        "tools": request.tools,
        "tool_choice": request.tool_choice,
        "parallel_tool_calls": request.parallel_tool_calls,
        "session_id": sid,
        "params": params,
    }


def _jsonable(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(exclude_none=True)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _usage(chunk_usage: Any) -> Usage | None:
    if chunk_usage is None:
        return None
    u = chunk_usage
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


class EmbeddedTalaria:
    """A running in-process Talaria; use :meth:`start` or :meth:`attach`. Thread-safe."""

    def __init__(
        self,
        talaria: Talaria,
        loop: asyncio.AbstractEventLoop,
        stop: Callable[[], None] | None = None,
        thread: threading.Thread | None = None,
    ) -> None:
        self.talaria = talaria
        self.loop = loop
        self._stop = stop
        self._thread = thread

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        config: TalariaConfig | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> EmbeddedTalaria:
        """Load ``config`` (default ``TalariaConfig.default()``) on a new daemon thread and
        return once the models are loaded. Raises what loading raised (a ``TalariaError``
        for a bad config), or ``TimeoutError`` after ``startup_timeout_s`` seconds."""
        from talaria.api import Talaria

        talaria = Talaria(config)
        ready = threading.Event()
        state: dict[str, Any] = {}

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            async with talaria:
                state["loop"] = loop
                state["stop"] = lambda: loop.call_soon_threadsafe(stop.set)
                ready.set()
                await stop.wait()

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:  # reported to start(); the thread just ends
                state["error"] = exc
            finally:
                ready.set()

        thread = threading.Thread(target=run, name="talaria-embedded", daemon=True)
        thread.start()
        if not ready.wait(startup_timeout_s):
            raise TimeoutError(f"the embedded Talaria did not start in {startup_timeout_s} s")
        if "error" in state:
            raise state["error"]
        return cls(talaria, state["loop"], state["stop"], thread)

    @classmethod
    def attach(cls, talaria: Talaria, loop: asyncio.AbstractEventLoop) -> EmbeddedTalaria:
        """Serve calls from ``talaria``, already entered on ``loop`` (which runs in another
        thread). :meth:`close` then leaves it running."""
        return cls(talaria, loop)

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop a Talaria this object started (calls in flight get its shutdown grace);
        a no-op for an attached one. Idempotent."""
        stop, self._stop = self._stop, None
        if stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                stop()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ helpers
    def _submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:
            coro.close()
            stopped = "the embedded Talaria has stopped"
            raise ServerError(503, stopped, code="shutting_down") from None

    def _result(self, future: concurrent.futures.Future[_T], timeout_s: float) -> _T:
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimedOut(f"the call did not finish in {timeout_s} s") from None
        except (HttpError, TalariaError) as exc:
            raise _as_call_error(exc) from None

    async def _chat(self, kwargs: dict[str, Any]) -> Answer:
        result = await self.talaria.chat(**kwargs)
        u = result.usage
        return Answer(
            text=result.text,
            finish_reason=result.finish_reason,
            usage=Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            session_id=result.session_id,
            instance=result.instance,
            tool_calls=tuple(
                ToolCall(i, c.id, c.name, c.arguments) for i, c in enumerate(result.tool_calls)
            ),
        )

    async def _pump(self, kwargs: dict[str, Any], put: Callable[[_Item], None]) -> None:
        """Run one streamed call in this (one) task, handing every chunk to ``put``."""
        try:
            stream = self.talaria.chat_stream(**kwargs)
            try:
                async for chunk in stream:
                    put(chunk)
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
            put(_End())
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            put(_Failed(exc))

    # ------------------------------------------------------------------ calls
    def chat(self, call: Call) -> Answer:
        """One whole answer (blocks the calling thread, not the Talaria loop)."""
        kwargs = _chat_kwargs(call)
        return self._result(self._submit(self._chat(kwargs)), call.timeout_s)

    async def achat(self, call: Call) -> Answer:
        """One whole answer, awaited from any event loop."""
        kwargs = _chat_kwargs(call)
        future = asyncio.wrap_future(self._submit(self._chat(kwargs)))
        try:
            return await asyncio.wait_for(future, call.timeout_s)
        except TimeoutError:
            raise TimedOut(f"the call did not finish in {call.timeout_s} s") from None
        except (HttpError, TalariaError) as exc:
            raise _as_call_error(exc) from None

    def stream(self, call: Call) -> Iterator[Piece]:
        """The answer in pieces. The call is started, and its first piece awaited (so an
        error before generation raises here), before the iterator is returned."""
        kwargs = _chat_kwargs(call)
        items: queue.Queue[_Item] = queue.Queue()
        future = self._submit(self._pump(kwargs, items.put))

        def get() -> _Item:
            try:
                return items.get(timeout=call.timeout_s)
            except queue.Empty:
                raise TimedOut(f"no output for {call.timeout_s} s") from None

        first = get()
        if isinstance(first, _Failed):
            future.cancel()
            raise _as_call_error(first.error)
        return _drain(first, get, future.cancel)

    async def astream(self, call: Call) -> AsyncIterator[Piece]:
        """The answer in pieces, consumed from the caller's event loop."""
        kwargs = _chat_kwargs(call)
        own = asyncio.get_running_loop()
        items: asyncio.Queue[_Item] = asyncio.Queue()

        def put(item: _Item) -> None:
            own.call_soon_threadsafe(items.put_nowait, item)

        future = self._submit(self._pump(kwargs, put))
        try:
            while True:
                try:
                    item = await asyncio.wait_for(items.get(), call.timeout_s)
                except TimeoutError:
                    raise TimedOut(f"no output for {call.timeout_s} s") from None
                for piece in _pieces(item):
                    yield piece
                if isinstance(item, _End):
                    return
        finally:
            future.cancel()

    def event(self, session_id: str, event: str, **fields: Any) -> object:
        """A hint (``talaria.session.HintCallable``): runs ``Talaria.event`` on the loop and
        waits for it (up to 5 s). For a ``HintSender`` worker thread, never the loop's."""
        future = self._submit(self.talaria.event(session_id, event, **fields))
        return future.result(5.0)


def _pieces(item: _Item) -> Iterator[Piece]:
    """The pieces of one queue item; raises the call's error for ``_Failed``."""
    if isinstance(item, _Failed):
        raise _as_call_error(item.error)
    if isinstance(item, _End):
        return
    chunk: ChatChunk = item
    if chunk.text:
        yield Piece(chunk.text)
    if chunk.tool_calls:
        calls = tuple(
            ToolCall(chunk.first_call + k, c.id, c.name, c.arguments)
            for k, c in enumerate(chunk.tool_calls)
        )
        yield Piece("", tool_calls=calls)
    if chunk.finish_reason is not None:
        yield Piece("", chunk.finish_reason, _usage(chunk.usage))


def _drain(first: _Item, get: Callable[[], _Item], cancel: Callable[[], object]) -> Iterator[Piece]:
    item = first
    try:
        while True:
            yield from _pieces(item)
            if isinstance(item, (_End, _Failed)):
                return
            item = get()
    finally:
        cancel()
