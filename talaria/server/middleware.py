"""The ASGI middleware around the routes, outermost first: observe -> API keys -> body limit.

:class:`Observe` stamps request receipt and counts every answered request in the app's
``talaria.server.metrics.ServerMetrics``. :class:`ApiKeys`: when keys are configured every
``/v1/...`` request needs ``Authorization: Bearer KEY`` or (Anthropic's) ``x-api-key:
KEY``; ``/health`` and ``/metrics`` stay open (as vLLM does); a matched key names the
caller's tenant (:func:`tenant_of_key`), which the routes (``talaria.server.routes``) read
from the request state. :class:`BodyLimit`: bodies over ``max_body_bytes`` are refused
with 413 before parsing, whether sent with ``Content-Length`` or chunked. Refusals are
``talaria.server.errors.HttpError`` responses (in Anthropic's shape under
``/v1/messages``).
"""

from __future__ import annotations

import abc
import hashlib
import hmac
import time
from collections.abc import Mapping
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from talaria.server.errors import ErrorShape, HttpError
from talaria.server.metrics import ServerMetrics


def _endpoint(path: str) -> str | None:
    """The metrics label of a path; None for paths not counted (/health, /metrics)."""
    if path in ("/health", "/metrics"):
        return None
    if path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        return path.removeprefix("/v1/").replace("/", "_")
    if path == "/v1/messages/count_tokens":
        return "messages_count_tokens"
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return "models"
    if path.startswith("/v1/sessions/") and path.endswith("/events"):
        return "session_events"
    return "other"


class _HttpMiddleware(abc.ABC):
    """An ASGI middleware that sees HTTP requests only (:meth:`handle`); every other scope
    (lifespan, websockets) goes straight on to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    @abc.abstractmethod
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer or pass on one HTTP request (``scope["type"] == "http"``)."""


class Observe(_HttpMiddleware):
    """Stamps request receipt (``scope["state"]["talaria_received"]``, perf_counter s) and
    counts every answered request with its status and duration, whoever answered it."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
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


class ApiKeys(_HttpMiddleware):
    """401 for ``/v1/...`` requests without a configured bearer key (no keys: open). A
    matched key's tenant is put in the request state (``talaria_tenant``)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], tenants: Mapping[str, str]) -> None:
        super().__init__(app)
        self.keys = tuple(k.encode() for k in keys)
        self.tenants = tuple(tenant_of_key(k, tenants) for k in keys)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys and scope["path"].startswith("/v1"):
            headers = Headers(scope=scope)
            problem, tenant = self._check(headers.get("authorization"), headers.get("x-api-key"))
            if problem is not None:
                err = HttpError(
                    401, problem, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
                )
                await err.response(ErrorShape.for_path(scope["path"]))(scope, receive, send)
                return
            scope.setdefault("state", {})["talaria_tenant"] = tenant
        await self.app(scope, receive, send)

    def _check(self, header: str | None, api_key: str | None) -> tuple[str | None, str]:
        """(problem, tenant): a message for a 401, or None and the key's tenant. The key is
        the ``Authorization: Bearer`` one, else the ``x-api-key`` header's (Anthropic's)."""
        if not header and not api_key:
            return (
                "Missing API key: send the header 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>').",
                "",
            )
        if header:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return "Malformed Authorization header: use 'Authorization: Bearer <key>'.", ""
        else:
            token = api_key or ""
        given = token.strip().encode()
        # Compare with every key (no early exit) so timing does not tell which matched.
        matches = [hmac.compare_digest(given, key) for key in self.keys]
        if not any(matches):
            return "Incorrect API key provided.", ""
        return None, self.tenants[matches.index(True)]


class BodyLimit(_HttpMiddleware):
    """413 for a request body over ``max_bytes``, checked on the raw bytes before any
    parsing: at once from ``Content-Length``, else while reading a chunked body. The body
    is buffered (at most ``max_bytes``) and replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        await err.response(ErrorShape.for_path(scope["path"]))(scope, receive, send)


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
