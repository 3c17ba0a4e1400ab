"""``TalariaLLM``: the LiteLLM custom provider (see the package docstring for usage).

LiteLLM routes ``model="talaria/<model>"`` here through ``litellm.custom_provider_map``
(:func:`register`). A call goes to ``api_base`` when given (HTTP, :class:`HttpBackend`),
else to one embedded in-process Talaria per handler (:class:`EmbeddedTalaria`, started on
the first such call). Sessions: the id is read from the call (``X-Session-ID`` header, a
``session_id`` argument, then LiteLLM's ``litellm_session_id`` / ``metadata.session_id``)
and sent as ``X-Session-ID``; tool-gap hints go through :meth:`TalariaLLM.session`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import httpx
import litellm
from litellm import exceptions as lx
from litellm.exceptions import BadRequestError
from litellm.llms.custom_llm import CustomLLM
from litellm.types.utils import (
    ChatCompletionMessageToolCall,
    Choices,
    Function,
    GenericStreamingChunk,
    ModelResponse,
)

from talaria.integrations.litellm.call import Answer, Call, CallError, Piece
from talaria.integrations.litellm.embedded import DEFAULT_STARTUP_TIMEOUT_S, EmbeddedTalaria
from talaria.integrations.litellm.errors import to_litellm_error
from talaria.integrations.litellm.http import HttpBackend, openai_base_url
from talaria.session import (
    GapPredictor,
    HintSender,
    SessionTracker,
    normalize_session_id,
    session_id_from_litellm,
)
from talaria.session.sinks import running_loop_or_none

if TYPE_CHECKING:
    from talaria.api import Talaria, TalariaConfig

__all__ = ["PROVIDER", "TalariaLLM", "register"]

PROVIDER = "talaria"
API_KEY_ENV = "TALARIA_API_KEY"  # the server's key when a call gives none (as `talaria serve`)
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# optional_params LiteLLM hands us that are not body fields of the call
_NOT_FORWARDED = frozenset(
    {"stream", "stream_options", "extra_body", "extra_headers", "session_id", "max_retries"}
)

Backend = HttpBackend | EmbeddedTalaria


_T = TypeVar("_T")


def _chat(backend: Backend, call: Call) -> Answer:
    return backend.chat(call)


def _stream(backend: Backend, call: Call) -> Iterator[Piece]:
    return backend.stream(call)


# LiteLLM calls a handler's four methods with these arguments (by keyword, as of 1.x).
_HANDLER_SIGNATURE = inspect.signature(CustomLLM.completion)


@attrs.frozen
class _LiteLLMArgs:
    """What the provider reads of a LiteLLM handler call (the arguments of
    ``CustomLLM.completion``; the others are LiteLLM's own bookkeeping)."""

    model: str
    messages: Sequence[Any]
    model_response: ModelResponse
    api_base: str | None
    api_key: str | None
    optional_params: Mapping[str, Any] | None
    litellm_params: Mapping[str, Any] | None
    headers: Mapping[str, str] | None
    timeout: float | httpx.Timeout | None

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _LiteLLMArgs:
        """Bound as LiteLLM's signature binds them (a missing argument is a ``TypeError``)."""
        bound = _HANDLER_SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        return cls(**{f.name: bound.arguments[f.name] for f in attrs.fields(cls)})


class TalariaLLM(CustomLLM):
    """The LiteLLM provider for Talaria. Thread-safe; one instance serves any number of
    calls, servers and sessions.

    ``embedded_config``: what the embedded Talaria serves when a call has no ``api_base``
    (default ``TalariaConfig.default()``; ``startup_timeout_s`` bounds its loading).
    ``connect_timeout_s``: the longest wait for a connection, whatever the call's own
    ``timeout`` (so an unreachable server fails fast). Tool calls are the server's
    (``message.tool_calls``, streamed as ``tool_use`` chunks): Talaria reads them from the
    model's answer and renders those of the history for the model's chat template.

    The instance holds what it opened: HTTP clients per server, hint senders per server,
    the embedded Talaria, one gap predictor; :meth:`close` releases them.
    """

    def __init__(
        self,
        *,
        embedded_config: TalariaConfig | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> None:
        super().__init__()
        if not (isinstance(connect_timeout_s, (int, float)) and 0 < connect_timeout_s <= 600):
            raise ValueError(f"connect_timeout_s must be in (0, 600] s, got {connect_timeout_s!r}")
        self.embedded_config = embedded_config
        self.connect_timeout_s = float(connect_timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.RLock()  # the maps below; never held while loading models
        self._start_lock = threading.Lock()  # one embedded start at a time
        self._http: dict[tuple[str, str | None], HttpBackend] = {}
        self._senders: dict[tuple[str, str | None], HintSender] = {}
        self._embedded: EmbeddedTalaria | None = None
        self._predictor: GapPredictor | None = None

    # ------------------------------------------------------------------ backends
    def embedded(self) -> EmbeddedTalaria:
        """The embedded Talaria, started (blocking, tens of seconds) on first use; calls to
        servers are not held up meanwhile."""
        with self._start_lock:
            with self._lock:
                running = self._embedded
            if running is not None:
                return running
            started = EmbeddedTalaria.start(
                self.embedded_config, startup_timeout_s=self.startup_timeout_s
            )
            with self._lock:
                self._embedded = started
            return started

    def attach_embedded(self, talaria: Talaria, loop: asyncio.AbstractEventLoop) -> None:
        """Serve calls without ``api_base`` from ``talaria``, already running on ``loop``
        (in another thread), instead of starting one. Raises ``RuntimeError`` if an
        embedded Talaria is already in use."""
        with self._start_lock, self._lock:
            if self._embedded is not None:
                raise RuntimeError("an embedded Talaria is already in use; close() first")
            self._embedded = EmbeddedTalaria.attach(talaria, loop)

    def _backend(self, api_base: str | None, api_key: str | None) -> Backend:
        if not api_base:
            return self.embedded()
        api_key = api_key or os.environ.get(API_KEY_ENV) or None
        key = (openai_base_url(api_base), api_key)
        with self._lock:
            backend = self._http.get(key)
            if backend is None:
                backend = self._http[key] = HttpBackend(api_base, api_key)
            return backend

    async def _abackend(self, api_base: str | None, api_key: str | None) -> Backend:
        """As ``_backend``; a first embedded start runs on a worker thread."""
        if not api_base and self._embedded is None:
            return await asyncio.to_thread(self._backend, api_base, api_key)
        return self._backend(api_base, api_key)

    # ------------------------------------------------------------------ sessions
    def gap_predictor(self) -> GapPredictor:
        """The tool-gap predictor shared by this handler's sessions (made on first use)."""
        with self._lock:
            if self._predictor is None:
                self._predictor = GapPredictor.default()
            return self._predictor

    def hint_sender(self, api_base: str | None = None, api_key: str | None = None) -> HintSender:
        """The hint sender for a server (``api_base``) or, without one, the embedded Talaria
        (started if needed). One per target, shared by every session of this handler."""
        target = openai_base_url(api_base) if api_base else ""
        api_key = (api_key or os.environ.get(API_KEY_ENV) or None) if api_base else None
        embedded = None if api_base else self.embedded()  # before the lock: it may load
        with self._lock:
            sender = self._senders.get((target, api_key))
            if sender is None:
                if embedded is None:
                    sender = HintSender.http(str(api_base), api_key=api_key)
                else:
                    sender = HintSender.in_process(embedded.event)
                self._senders[(target, api_key)] = sender
            return sender

    def session(
        self,
        api_base: str | None = None,
        *,
        session_id: str | None = None,
        api_key: str | None = None,
    ) -> SessionTracker:
        """A :class:`~talaria.session.SessionTracker` for one agent run whose hints go where
        its calls go (``api_base``, or the embedded Talaria). Pass
        ``litellm_session_id=tracker.session_id`` with each call; report tools with
        ``tool_started`` / ``tool_ended``; leaving ``with`` sends ``end``. Never blocks on
        the network, never raises for it."""
        hints = self.hint_sender(api_base, api_key)
        kwargs: dict[str, Any] = {"predictor": self.gap_predictor(), "hints": hints}
        if session_id is not None:
            kwargs["session_id"] = session_id
        return SessionTracker(**kwargs)

    def close(self) -> None:
        """Deliver queued hints (up to 1 s per target), close HTTP clients, stop an embedded
        Talaria this handler started. The handler stays usable (it reopens on demand)."""
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
            backends, self._http = list(self._http.values()), {}
            embedded, self._embedded = self._embedded, None
        for sender in senders:
            sender.close()
        for backend in backends:
            backend.close()
        if embedded is not None:
            embedded.close()

    # ------------------------------------------------------------------ LiteLLM API
    def completion(self, *args: Any, **kwargs: Any) -> ModelResponse:
        """A whole answer (``litellm.completion``)."""
        r = _LiteLLMArgs.of(args, kwargs)
        answer = self._started(r, self._call(r), _chat)
        return self._response(r.model_response, r.model, answer)

    def streaming(self, *args: Any, **kwargs: Any) -> Iterator[GenericStreamingChunk]:
        """The answer as LiteLLM's generic chunks (``litellm.completion(stream=True)``).
        The call starts here, so an error answer raises from ``litellm.completion``."""
        r = _LiteLLMArgs.of(args, kwargs)
        pieces = self._started(r, self._call(r), _stream)
        return _generic_chunks(pieces, r.model)

    async def acompletion(self, *args: Any, **kwargs: Any) -> ModelResponse:
        """A whole answer (``litellm.acompletion``), on the caller's event loop."""
        r = _LiteLLMArgs.of(args, kwargs)
        call = self._call(r)
        try:
            backend = await self._abackend(r.api_base, r.api_key)
            answer = await backend.achat(call)
        except CallError as exc:
            raise to_litellm_error(exc, r.model, PROVIDER) from exc
        return self._response(r.model_response, r.model, answer)

    def astreaming(  # type: ignore[override]  # LiteLLM only iterates the result
        self, *args: Any, **kwargs: Any
    ) -> AsyncIterator[GenericStreamingChunk]:
        """The answer as generic chunks (``litellm.acompletion(stream=True)``).

        LiteLLM calls this on a worker thread (``acompletion`` runs ``completion`` in an
        executor): there the call starts at once, so an error answer raises from
        ``await litellm.acompletion(...)`` as with LiteLLM's built-in providers, and the
        pieces are then read on worker threads. Called inside a running event loop, the
        call starts at the first chunk instead (LiteLLM then reports an error before the
        first chunk as its ``MidStreamFallbackError``, holding ours as
        ``original_exception``).
        """
        r = _LiteLLMArgs.of(args, kwargs)
        call = self._call(r)
        if running_loop_or_none() is not None:
            return self._astream_lazy(call, r.model, r.api_base, r.api_key)
        return _agenerics(_in_threads(self._started(r, call, _stream)), r.model)

    def _started(self, r: _LiteLLMArgs, call: Call, start: Callable[[Backend, Call], _T]) -> _T:
        """``start(backend, call)`` on the call's backend, a ``CallError`` raised as
        LiteLLM's exception for it."""
        try:
            return start(self._backend(r.api_base, r.api_key), call)
        except CallError as exc:
            raise to_litellm_error(exc, r.model, PROVIDER) from exc

    async def _astream_lazy(
        self,
        call: Call,
        model: str,
        api_base: str | None,
        api_key: str | None,
    ) -> AsyncIterator[GenericStreamingChunk]:
        backend = await self._abackend(api_base, api_key)
        async for chunk in _agenerics(backend.astream(call), model):
            yield chunk

    # ------------------------------------------------------------------ helpers
    def _call(self, r: _LiteLLMArgs) -> Call:
        """The backend call."""
        model = r.model
        params = dict(r.optional_params or {})
        n = params.get("n")
        if n is not None and n != 1:  # one choice comes back through this provider
            raise lx.BadRequestError(
                f"n={n}: the Talaria provider returns one choice per call; send n=1 (or ask "
                "the server's OpenAI API for several choices directly)",
                model=model,
                llm_provider=PROVIDER,
            )
        if params.get("logprobs") or params.get("top_logprobs"):  # an Answer is text only
            raise lx.BadRequestError(
                "logprobs: the Talaria provider returns text and tool calls, not logprobs; "
                "leave it out (or ask the server's OpenAI API for them directly)",
                model=model,
                llm_provider=PROVIDER,
            )
        extra = params.get("extra_body")
        extra = dict(extra) if isinstance(extra, Mapping) else {}
        session_id, hdrs = _session_and_headers(params, extra, r.litellm_params, r.headers)
        body = {k: v for k, v in params.items() if k not in _NOT_FORWARDED and v is not None}
        body.update({k: v for k, v in extra.items() if k != "session_id"})
        plain = [_plain_message(m) for m in r.messages]
        total, connect = self._timeouts(r.timeout)
        return Call(model, plain, body, session_id, hdrs, total, connect)

    def _timeouts(self, timeout: float | httpx.Timeout | None) -> tuple[float, float]:
        total: float | None = None
        connect: float | None = None
        if isinstance(timeout, httpx.Timeout):
            total, connect = timeout.read, timeout.connect
        elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            total = float(timeout)
        if total is None or not math.isfinite(total) or total <= 0:
            total = DEFAULT_TIMEOUT_S
        connect = min(connect or self.connect_timeout_s, self.connect_timeout_s, total)
        return total, connect

    def _response(
        self,
        response: ModelResponse,
        model: str,
        answer: Answer,
    ) -> ModelResponse:
        """Fill LiteLLM's ``model_response`` with ``answer``."""
        choice = response.choices[0]
        if not isinstance(choice, Choices):
            raise TypeError(f"LiteLLM passed a {type(choice).__name__} to fill, not Choices")
        message = choice.message
        message.content = answer.text or (None if answer.tool_calls else "")
        if answer.tool_calls:
            message.tool_calls = [
                ChatCompletionMessageToolCall(
                    function=Function(name=c.name, arguments=c.arguments),
                    id=c.id,
                    type="function",
                )
                for c in answer.tool_calls
            ]
        choice.finish_reason = answer.finish_reason  # type: ignore[assignment]  # LiteLLM's Literal; ours are OpenAI's
        response.model = model
        response.created = int(time.time())
        if answer.usage is not None:
            setattr(response, "usage", litellm.Usage(**answer.usage.to_openai()))  # noqa: B010
        response._hidden_params["talaria"] = {
            "session_id": answer.session_id,
            "instance": answer.instance,
        }
        return response


def register(handler: TalariaLLM | None = None, provider: str = PROVIDER) -> TalariaLLM:
    """Install ``handler`` (default: the module-level ``talaria_llm`` of
    :mod:`talaria.integrations.litellm`) as LiteLLM's provider ``provider``, replacing an earlier
    entry for that name; returns it. Mutates ``litellm.custom_provider_map``, the global
    registry LiteLLM reads on every call."""
    if handler is None:
        from talaria.integrations.litellm import talaria_llm

        handler = talaria_llm
    entries = [e for e in litellm.custom_provider_map if e.get("provider") != provider]
    entries.append({"provider": provider, "custom_handler": handler})
    litellm.custom_provider_map = entries
    from litellm.utils import custom_llm_setup

    custom_llm_setup()  # type: ignore[no-untyped-call]
    return handler


# --- pure helpers ----------------------------------------------------------------------------


def _plain_message(message: Any) -> dict[str, Any]:
    """An OpenAI message as a plain dict (LiteLLM ``Message`` objects are dumped)."""
    if isinstance(message, Mapping):
        return dict(message)
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        out: dict[str, Any] = dump(exclude_none=True)
        return out
    raise BadRequestError(
        f"a message must be a dict, got {type(message).__name__}", model="", llm_provider=PROVIDER
    )


def _session_and_headers(
    params: Mapping[str, Any],
    extra: Mapping[str, Any],
    litellm_params: Mapping[str, Any] | None,
    headers: Mapping[str, str] | None,
) -> tuple[str | None, dict[str, str]]:
    """The call's session id and its other headers. Precedence: an ``X-Session-ID``
    header, a ``session_id`` argument (or in ``extra_body``), then LiteLLM's
    ``litellm_session_id`` / ``metadata.session_id``."""
    hdrs: dict[str, str] = {}
    from_header: str | None = None
    for name, value in (headers or {}).items():
        if name.lower() == "x-session-id":
            from_header = str(value).strip() or None
        else:
            hdrs[str(name)] = str(value)
    if from_header is not None:
        return from_header, hdrs
    for given in (params.get("session_id"), extra.get("session_id")):
        if isinstance(given, (str, int)) and not isinstance(given, bool) and str(given).strip():
            return normalize_session_id(str(given).strip()), hdrs
    return session_id_from_litellm({"litellm_params": litellm_params or {}}), hdrs


def _generic(
    text: str = "",
    *,
    finish_reason: str = "",
    usage: dict[str, Any] | None = None,
    tool_use: dict[str, Any] | None = None,
) -> GenericStreamingChunk:
    chunk: dict[str, Any] = {
        "text": text,
        "is_finished": bool(finish_reason),
        "finish_reason": finish_reason,
        "usage": usage,
        "index": 0,
        "tool_use": tool_use,
    }
    return chunk  # type: ignore[return-value]  # the TypedDict, built as a dict


def _chunks_of(piece: Piece) -> Iterator[GenericStreamingChunk]:
    """Generic chunks for one piece: its text, each tool call, then the finish."""
    if piece.text:
        yield _generic(piece.text)
    for call in piece.tool_calls:
        yield _generic(tool_use=call.to_openai())
    if piece.finish_reason is not None:
        usage = piece.usage.to_openai() if piece.usage is not None else None
        yield _generic(finish_reason=piece.finish_reason, usage=usage)


async def _agenerics(
    pieces: AsyncIterator[Piece], model: str
) -> AsyncIterator[GenericStreamingChunk]:
    try:
        async for piece in pieces:
            for chunk in _chunks_of(piece):
                yield chunk
    except CallError as exc:
        raise to_litellm_error(exc, model, PROVIDER) from exc
    finally:
        aclose = getattr(pieces, "aclose", None)
        if aclose is not None:
            await aclose()


async def _in_threads(pieces: Iterator[Piece]) -> AsyncIterator[Piece]:
    """``pieces`` (a blocking iterator) read on a daemon thread of its own and handed to
    the caller's loop. Closing this iterator stops the reader after the piece it is
    waiting for (or the call's timeout); the reader then closes ``pieces``. A daemon, so
    an abandoned stream never holds up the interpreter's exit."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stop = threading.Event()

    def put(kind: str, value: object) -> None:
        with contextlib.suppress(RuntimeError):  # the consumer's loop has closed
            loop.call_soon_threadsafe(items.put_nowait, (kind, value))

    def read() -> None:
        try:
            for piece in pieces:
                if stop.is_set():
                    break
                put("piece", piece)
            put("end", None)
        except BaseException as exc:
            put("error", exc)
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()

    threading.Thread(target=read, name="talaria-stream", daemon=True).start()
    try:
        while True:
            kind, value = await items.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()


def _generic_chunks(pieces: Iterator[Piece], model: str) -> Iterator[GenericStreamingChunk]:
    try:
        for piece in pieces:
            yield from _chunks_of(piece)
    except CallError as exc:
        raise to_litellm_error(exc, model, PROVIDER) from exc
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
