"""The OpenAI-compatible HTTP server over the in-process API (``talaria.api.Talaria``).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both stream with
``stream: true``), ``GET /v1/models[/{id}]``, ``POST /v1/sessions/{id}/events``, ``GET
/health`` and ``GET /metrics``. Every error is OpenAI's ``{"error": {...}}`` shape.

Sessions: a call names its session in the ``X-Session-ID`` header or the body field
``session_id``; if both are sent they must be equal (a 400 otherwise, rather than silently
preferring one). Without either, the call is a one-call session. Answers carry the headers
``X-Session-ID`` (the session the call ran in, generated for one-call sessions) and
``X-Talaria-Instance``.

API keys: when keys are configured every ``/v1/...`` request needs ``Authorization: Bearer
KEY``; ``/health`` and ``/metrics`` stay open (as vLLM does). Bodies over ``max_body_bytes``
are refused with 413 before parsing, whether sent with ``Content-Length`` or chunked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import attrs
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from talaria.errors import TalariaError
from talaria.server import schemas as s
from talaria.server.errors import HttpError, bad_request, from_talaria, from_validation, internal
from talaria.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from talaria.api import TalariaConfig

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
Body = TypeVar("Body", bound=s.StrictModel)
_STATE = "talaria"  # app.state attribute holding the _Context
log = logging.getLogger("talaria.server")


@attrs.frozen
class _Context:
    backend: s.Backend
    metrics: ServerMetrics


def create_app(
    talaria: s.Backend,
    *,
    api_keys: Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lifespan: Lifespan | None = None,
    tenants: Mapping[str, str] | None = None,
) -> FastAPI:
    """A FastAPI app serving ``talaria``.

    The app does not enter or exit ``talaria`` (the caller owns its lifecycle) unless a
    ``lifespan`` that does is given (see :func:`app_for_config`). ``api_keys``: None means
    ``talaria.config.api_keys`` when the object has a config, else no keys; an empty
    sequence disables keys. Each app has its own metrics registry. Raises ``ValueError``
    for a non-positive ``max_body_bytes`` or an empty key.

    Tenants: with keys, each key is a tenant (``tenants`` maps keys to names, default
    ``talaria.config.tenants``; a key listed there is accepted; any other key's tenant is
    named ``key-`` and a digest of the key). A tenant's sessions, hints and cached prefixes
    are its own (the KV prefix index is salted per tenant). Without keys every caller is
    the tenant ``default``.
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if api_keys is None:
        api_keys = tuple(getattr(getattr(talaria, "config", None), "api_keys", ()) or ())
    if tenants is None:
        tenants = dict(getattr(getattr(talaria, "config", None), "tenants", {}) or {})
    keys = tuple(dict.fromkeys((*api_keys, *tenants)))
    if any(not isinstance(k, str) or not k.strip() for k in keys):
        raise ValueError("API keys must be non-empty strings")
    app = FastAPI(
        title="Talaria",
        summary="OpenAI-compatible server for tool-using agents",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    metrics = ServerMetrics(talaria.stats)
    setattr(app.state, _STATE, _Context(talaria, metrics))
    app.router.route_class = _GuardedRoute
    _install_error_handlers(app)
    _add_routes(app)
    # Outermost first at run time: observe -> API keys -> body limit -> routes.
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(_ApiKeys, keys=keys, tenants=tenants)
    app.add_middleware(_Observe, metrics=metrics)
    return app


def app_for_config(
    config: TalariaConfig,
    *,
    api_keys: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """An app that owns a ``Talaria`` built from ``config``: the app's lifespan loads the
    models at startup and shuts Talaria down gracefully at exit. Accepted keys are
    ``config.api_keys`` plus ``api_keys``. No I/O until the app starts."""
    from talaria.api import Talaria

    talaria = Talaria(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with talaria:
            log.info("serving %s", ", ".join(m.name for m in talaria.models()))
            yield

    keys = tuple(dict.fromkeys((*config.api_keys, *api_keys)))
    return create_app(talaria, api_keys=keys, max_body_bytes=max_body_bytes, lifespan=lifespan)


def serve(
    config: TalariaConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_keys: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
) -> None:
    """Serve ``config`` on ``host:port`` until interrupted (blocks). SIGINT / SIGTERM stop
    accepting connections, let running requests finish (up to ``config.shutdown_grace_s``),
    then shut Talaria down."""
    app = app_for_config(config, api_keys=api_keys, max_body_bytes=max_body_bytes)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=max(1, math.ceil(config.shutdown_grace_s)),
    )


def _ctx(request: Request) -> _Context:
    ctx: _Context = getattr(request.app.state, _STATE)
    return ctx


# --- routes ------------------------------------------------------------------------------------


def _add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/chat/completions", _chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", _completions, methods=["POST"])
    app.add_api_route("/v1/models", _list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", _get_model, methods=["GET"])
    app.add_api_route("/v1/sessions/{session_id:path}/events", _session_event, methods=["POST"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])


async def _chat_completions(request: Request) -> Response:
    """OpenAI chat completions (streamed or not) through the model's chat template."""
    body = await _parse(request, s.ChatCompletionRequest)
    args = _call_args(request, body, body.new_tokens())
    messages = body.api_messages()
    ctx = _ctx(request)

    def open_stream() -> AsyncIterator[s.ChunkLike]:
        return ctx.backend.chat_stream(messages, body.model, tools=body.api_tools(), **args)

    return await _answer(request, open_stream, chat=True, body=body)


async def _completions(request: Request) -> Response:
    """OpenAI (legacy) text completions of a raw prompt, no chat template."""
    body = await _parse(request, s.CompletionRequest)
    args = _call_args(request, body, body.max_tokens)
    prompt = body.prompt_text()
    ctx = _ctx(request)

    def open_stream() -> AsyncIterator[s.ChunkLike]:
        return ctx.backend.complete_stream(prompt, body.model, **args)

    return await _answer(request, open_stream, chat=False, body=body)


async def _list_models(request: Request) -> Response:
    """``{"object": "list", "data": [model cards]}``."""
    cards = [_card(m) for m in _ctx(request).backend.models()]
    return JSONResponse({"object": "list", "data": cards})


async def _get_model(request: Request, model: str) -> Response:
    """One model card; 404 naming the served models when ``model`` is not one of them."""
    info = _require_model(request, model)
    return JSONResponse(_card(info))


async def _session_event(request: Request, session_id: str) -> Response:
    """A tool-gap hint or the end of a session. Answers ``{"session_id", "event"}``, plus
    ``"summary": {"sct_s", "calls"}`` for ``end`` (and observes SCT). 404 for a session the
    server never saw."""
    sid = s.check_session_id(session_id, "the session id in the path")
    event = await _parse(request, s.EventRequest)
    summary = await _ctx(request).backend.event(
        sid,
        event.event,
        tool=event.tool,
        expected_s=event.expected_s,
        measured_s=event.measured_s,
        tenant=_tenant(request),
    )
    out: dict[str, Any] = {"session_id": sid, "event": event.event}
    if summary is not None:
        _ctx(request).metrics.sct.observe(max(summary.sct_s, 0.0))
        out["summary"] = {"sct_s": summary.sct_s, "calls": summary.calls}
    return JSONResponse(out, headers={"X-Session-ID": _header(sid)})


async def _health(request: Request) -> Response:
    """200 ``{"status": "ok", "models": [...], "instances": {name: healthy}}`` while at least
    one instance is healthy; 503 with ``"status": "unavailable"`` when none is or the API
    does not answer (not started, failed)."""
    backend = _ctx(request).backend
    try:
        names = [m.name for m in backend.models()]
        instances = {
            str(name): bool(info.get("healthy", True)) if isinstance(info, dict) else True
            for name, info in dict(backend.stats().get("instances", {})).items()
        }
    except Exception as exc:
        return JSONResponse({"status": "unavailable", "error": type(exc).__name__}, 503)
    ok = any(instances.values()) or not instances
    body = {"status": "ok" if ok else "unavailable", "models": names, "instances": instances}
    return JSONResponse(body, 200 if ok else 503)


async def _metrics(request: Request) -> Response:
    """Prometheus exposition text of this app's registry."""
    data, content_type = _ctx(request).metrics.render()
    return Response(data, media_type=content_type)


# --- request handling --------------------------------------------------------------------------


async def _parse(request: Request, model: type[Body]) -> Body:
    """Validate the raw body as ``model`` (strict JSON) and run its ``check``. Raises
    ``HttpError`` (400) naming the field at fault."""
    raw = await request.body()
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation(exc) from None
    check = getattr(body, "check", None)
    if check is not None:
        check()
    return body


def _tenant(request: Request) -> str:
    """The caller's tenant: its API key's, or ``default`` when the server has no keys."""
    return str(getattr(request.state, "talaria_tenant", "default"))


def _call_args(request: Request, body: s.SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    """Keyword arguments for ``chat_stream`` / ``complete_stream``, after checking the model
    and resolving the session id (header and body must agree). Records the model for
    metrics."""
    _require_model(request, body.model)
    request.state.talaria_model = body.model
    header = request.headers.get("x-session-id")
    sid = body.session_id
    if header is not None:
        header = s.check_session_id(header, "the X-Session-ID header")
        if sid is not None and sid != header:
            raise bad_request(
                f"The X-Session-ID header ({header!r}) and the body's session_id ({sid!r}) "
                "differ; send the session id once, or the same in both.",
                "session_id",
            )
        sid = header
    elif sid is not None:
        sid = s.check_session_id(sid, "session_id")
    return {
        "session_id": sid,
        "tenant": _tenant(request),
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": max(body.top_k, 0),
        "seed": body.seed,
        "stop": body.stop,
    }


def _require_model(request: Request, name: str) -> s.ModelInfoLike:
    """The served model called ``name``; raises ``HttpError`` (404) listing the served ones."""
    served = list(_ctx(request).backend.models())
    for info in served:
        if info.name == name:
            return info
    available = ", ".join(m.name for m in served) or "none"
    raise HttpError(
        404,
        f"The model {name[:100]!r} does not exist on this server. Available models: {available}.",
        code="model_not_found",
        param="model",
    )


def _card(info: s.ModelInfoLike) -> dict[str, Any]:
    return s.model_card(info.name, info.context_length, info.source, info.created)


def _header(value: str) -> str:
    """``value`` made safe for an HTTP header (printable ASCII)."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in value)[:512]


async def _answer(
    request: Request,
    open_stream: Callable[[], AsyncIterator[s.ChunkLike]],
    *,
    chat: bool,
    body: s.SamplingFields,
) -> Response:
    """Run one call and answer it, streamed (SSE) or whole.

    The first chunk is awaited before any byte is sent, so errors raised before generation
    starts (unknown model, context too long, overloaded) get their own HTTP status; later
    errors become an SSE error event (streamed) or the HTTP error (not streamed). Time to
    first token is observed here for both kinds.
    """
    ctx = _ctx(request)
    stream = open_stream()
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        await _close(stream)
        raise HttpError(500, "The model produced no output; retry.", code="empty_stream") from None
    except BaseException:
        await _close(stream)
        raise
    received = float(request.state.talaria_received)
    ctx.metrics.ttft.labels(body.model).observe(max(time.perf_counter() - received, 0.0))
    headers = {
        "X-Talaria-Instance": _header(first.instance),
        "X-Session-ID": _header(first.session_id),
    }
    if body.stream:
        head = s.ChunkHead(first.id, first.model, first.created, body.include_usage)
        events = _sse(request, first, stream, head, chat)
        headers["Cache-Control"] = "no-cache"
        return _SameTaskStream(events, media_type="text/event-stream", headers=headers)
    answer = await _collect(first, stream)
    payload = s.chat_completion(answer) if chat else s.text_completion(answer)
    return JSONResponse(payload, headers=headers)


async def _collect(first: s.ChunkLike, stream: AsyncIterator[s.ChunkLike]) -> s.Answer:
    """Join the chunks of an answer (closing the stream); a stream that ends without a
    ``finish_reason`` is taken as finished with ``stop``."""
    parts = [first.text]
    last = first
    try:
        while last.finish_reason is None:
            nxt = await anext(stream, None)
            if nxt is None:
                break
            last = nxt
            parts.append(last.text)
    finally:
        await _close(stream)
    return s.Answer(
        id=first.id,
        model=first.model,
        created=first.created,
        text="".join(parts),
        finish_reason=last.finish_reason or "stop",
        usage=last.usage,
        instance=first.instance,
        session_id=first.session_id,
    )


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(
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
            await _close(stream)
    yield b"data: [DONE]\n\n"


async def _close(stream: object) -> None:
    """Close an async generator (releases the call on the API side); a no-op for other
    iterators."""
    aclose: Callable[[], Awaitable[None]] | None = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class _SameTaskStream(StreamingResponse):
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
                    await _close(self.body_iterator)
            tg.cancel_scope.cancel()


# --- errors ------------------------------------------------------------------------------------


class _GuardedRoute(APIRoute):
    """Routes whose unexpected exceptions become an OpenAI-shaped 500 (logged with a request
    id), instead of Starlette's plain-text 500."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (HttpError, TalariaError, HTTPException, RequestValidationError):
                raise
            except Exception as exc:
                return internal(exc).response()

        return guarded


def _install_error_handlers(app: FastAPI) -> None:
    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HttpError)
        return exc.response()

    async def on_talaria(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, TalariaError)
        return from_talaria(exc).response()

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return bad_request(f"Invalid request: {where}: {first.get('msg', 'invalid')}.").response()

    async def on_starlette(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _route_error(request, exc.status_code).response()

    app.add_exception_handler(HttpError, on_http_error)
    app.add_exception_handler(TalariaError, on_talaria)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_starlette)


def _route_error(request: Request, status: int) -> HttpError:
    path = request.url.path
    if status == 404:
        return HttpError(
            404,
            f"No endpoint at {path[:200]}. This server serves POST /v1/chat/completions, "
            "POST /v1/completions, GET /v1/models, POST /v1/sessions/{id}/events, GET /health "
            "and GET /metrics.",
            code="not_found",
        )
    if status == 405:
        return HttpError(
            405, f"{request.method} is not allowed on {path[:200]}.", code="method_not_allowed"
        )
    return HttpError(status, f"Request failed with HTTP {status}.", code=str(status))


# --- ASGI middleware ---------------------------------------------------------------------------


def _endpoint(path: str) -> str | None:
    """The metrics label of a path; None for paths not counted (/health, /metrics)."""
    if path in ("/health", "/metrics"):
        return None
    if path in ("/v1/chat/completions", "/v1/completions"):
        return path.removeprefix("/v1/").replace("/", "_")
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return "models"
    if path.startswith("/v1/sessions/") and path.endswith("/events"):
        return "session_events"
    return "other"


class _Observe:
    """Stamps request receipt (``scope["state"]["talaria_received"]``, perf_counter s) and
    counts every answered request with its status and duration, whoever answered it."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state: dict[str, Any] = scope.setdefault("state", {})
        state["talaria_received"] = start
        status = 500

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            endpoint = _endpoint(scope["path"])
            if endpoint is not None:
                final = int(state.get("talaria_stream_status", status))
                model = str(state.get("talaria_model", ""))
                elapsed = time.perf_counter() - start
                self.metrics.observe_request(endpoint, model, final, elapsed)


def tenant_of_key(key: str, names: Mapping[str, str]) -> str:
    """The tenant an API key stands for: its configured name, else ``key-`` and the first
    12 hex digits of its SHA-256 (stable, and says nothing usable about the key)."""
    name = names.get(key)
    return name if name is not None else "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class _ApiKeys:
    """401 for ``/v1/...`` requests without a configured bearer key (no keys: open). A
    matched key's tenant is put in the request state (``talaria_tenant``)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], tenants: Mapping[str, str]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)
        self.tenants = tuple(tenant_of_key(k, tenants) for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys and scope["path"].startswith("/v1"):
            problem, tenant = self._check(Headers(scope=scope).get("authorization"))
            if problem is not None:
                err = HttpError(
                    401, problem, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
                )
                await err.response()(scope, receive, send)
                return
            scope.setdefault("state", {})["talaria_tenant"] = tenant
        await self.app(scope, receive, send)

    def _check(self, header: str | None) -> tuple[str | None, str]:
        """(problem, tenant): a message for a 401, or None and the key's tenant."""
        if not header:
            return "Missing API key: send the header 'Authorization: Bearer <key>'.", ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "Malformed Authorization header: use 'Authorization: Bearer <key>'.", ""
        given = token.strip().encode()
        # Compare with every key (no early exit) so timing does not tell which matched.
        matches = [hmac.compare_digest(given, key) for key in self.keys]
        if not any(matches):
            return "Incorrect API key provided.", ""
        return None, self.tenants[matches.index(True)]


class _BodyLimit:
    """413 for a request body over ``max_bytes``, checked on the raw bytes before any
    parsing: at once from ``Content-Length``, else while reading a chunked body. The body
    is buffered (at most ``max_bytes``) and replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = HttpError(
            413,
            f"Request body exceeds {self.max_bytes} bytes. Send a shorter request, or start "
            "the server with a larger --max-body-bytes.",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await err.response()(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the real one (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
