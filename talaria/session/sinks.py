"""Where hint events go: a Talaria server over HTTP, or a callable in the same process.

A sink's ``deliver`` runs on the :class:`~talaria.session.sender.HintSender`'s worker thread
only; it may block up to its ``timeout_s`` and raises on failure (the sender counts and logs
the failure; the agent never sees it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
from collections.abc import Awaitable, Coroutine
from typing import Any, Protocol, TypeVar, Unpack
from urllib.parse import quote

import attrs
import httpx

from talaria.errors import ConfigError
from talaria.session.hints import HintEvent
from talaria.types import HintFields

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CallableSink",
    "HintCallable",
    "HintSink",
    "HttpSink",
    "running_loop_or_none",
]

DEFAULT_TIMEOUT_S = 0.5
_T = TypeVar("_T")


class HintCallable(Protocol):
    """An in-process receiver of hints, called with the session id, the event name and the
    wire body's other fields as keywords (absent ones omitted):
    ``fn(session_id, "tool_start", tool="bash", expected_s=0.4)``,
    ``fn(session_id, "tool_end", measured_s=0.3)``, ``fn(session_id, "end")``.
    ``talaria.Talaria.event`` has this shape. It may return an awaitable (an async method)."""

    def __call__(self, session_id: str, event: str, **fields: Unpack[HintFields]) -> object: ...


class HintSink(Protocol):
    """Delivers one event (blocking, at most about its timeout) or raises; ``close`` frees
    its resources and is idempotent. Called from one thread at a time."""

    def deliver(self, event: HintEvent) -> None: ...

    def close(self) -> None: ...


def _check_timeout(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0 < value <= 60:
        raise ConfigError(f"{attribute.name} must be in (0, 60] seconds, got {value!r}")


def _normalize_base_url(value: object) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing ``/`` or ``/v1`` (an OpenAI-style
    base URL such as ``http://host:8000/v1`` names the same server)."""
    if not isinstance(value, str):
        raise ConfigError(f"base_url must be a string, got {value!r}")
    try:
        url = httpx.URL(value.strip())
    except (httpx.InvalidURL, TypeError) as e:
        raise ConfigError(f"base_url {value!r} is not a URL: {e}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"base_url must look like http://host:port, got {value!r}")
    text = str(url.copy_with(query=None, fragment=None)).rstrip("/")
    return text.removesuffix("/v1")


@attrs.define(eq=False)
class HttpSink:
    """POSTs each event as JSON to ``{base_url}/v1/sessions/{session_id}/events``.

    ``api_key`` is sent as ``Authorization: Bearer <api_key>``. ``timeout_s`` bounds each
    phase (connect, write, read) of a request. A non-2xx answer raises
    :class:`httpx.HTTPStatusError`, a connection problem another :class:`httpx.HTTPError`.
    The :class:`httpx.Client` is created on first delivery (no I/O at construction).
    """

    base_url: str = attrs.field(converter=_normalize_base_url)
    api_key: str | None = attrs.field(default=None, repr=False)
    timeout_s: float = attrs.field(default=DEFAULT_TIMEOUT_S, validator=_check_timeout)
    _client: httpx.Client | None = attrs.field(init=False, default=None, repr=False)

    def url_for(self, session_id: str) -> str:
        """The events URL of a session (the id percent-encoded as one path segment)."""
        return f"{self.base_url}/v1/sessions/{quote(session_id, safe='')}/events"

    def deliver(self, event: HintEvent) -> None:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.Client(timeout=self.timeout_s, headers=headers)
        response = self._client.post(self.url_for(event.session_id), json=event.to_json())
        response.raise_for_status()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def running_loop_or_none() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop running in this thread, or ``None`` outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _await(awaitable: Awaitable[_T]) -> _T:
    return await awaitable


@attrs.define(eq=False)
class CallableSink:
    """Calls ``fn(session_id, event, **fields)`` in process with what the HTTP sink would post
    (:class:`HintCallable`), so ``CallableSink(tal.event)`` works for a ``talaria.Talaria``
    ``tal``. If ``fn`` returns an awaitable, awaits it.

    The awaitable runs on ``loop`` when given (an agent or server loop in another thread,
    e.g. the one ``talaria.Talaria`` runs on) via ``run_coroutine_threadsafe``; otherwise on
    a private loop of the worker thread. Either way it is cancelled after ``timeout_s``. A
    synchronous ``fn`` runs on the worker thread and cannot be interrupted: it must be quick
    and thread-safe. Do not block ``loop``'s own thread waiting for delivery (``flush``);
    use the sender's ``aflush`` there.
    """

    fn: HintCallable
    loop: asyncio.AbstractEventLoop | None = None
    timeout_s: float = attrs.field(default=DEFAULT_TIMEOUT_S, validator=_check_timeout)
    _own_loop: asyncio.AbstractEventLoop | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(f"fn must be callable, got {self.fn!r}")

    def deliver(self, event: HintEvent) -> None:
        body = event.to_json()
        result = self.fn(
            event.session_id,
            event.kind.value,
            **{k: v for k, v in body.items() if k != "event"},
        )
        if inspect.iscoroutine(result):
            self._run(result)
        elif inspect.isawaitable(result):
            self._run(_await(result))

    def _run(self, coro: Coroutine[Any, Any, Any]) -> None:
        if self.loop is not None:
            try:
                future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            except RuntimeError:  # the loop is closed
                coro.close()
                raise
            try:
                future.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                future.cancel()
                raise
            return
        if self._own_loop is None:
            self._own_loop = asyncio.new_event_loop()
        self._own_loop.run_until_complete(asyncio.wait_for(coro, self.timeout_s))

    def close(self) -> None:
        if self._own_loop is not None:
            self._own_loop.close()
            self._own_loop = None
