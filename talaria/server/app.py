"""The OpenAI-compatible HTTP server over the in-process API (``talaria.api.Talaria``).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both stream with
``stream: true``), ``POST /v1/responses`` (OpenAI's Responses API, for Codex CLI),
``GET /v1/models[/{id}]``, ``POST /v1/sessions/{id}/events``, ``GET
/health`` and ``GET /metrics``. Every error is OpenAI's ``{"error": {...}}`` shape.

Sessions: a call names its session in the ``X-Session-ID`` header or the body field
``session_id``; if both are sent they must be equal (a 400 otherwise, rather than silently
preferring one). Without either, the call is a one-call session. Answers carry the headers
``X-Session-ID`` (the session the call ran in, generated for one-call sessions) and
``X-Talaria-Instance``.

API keys: when keys are configured every ``/v1/...`` request needs ``Authorization: Bearer
KEY``; ``/health`` and ``/metrics`` stay open (as vLLM does). Bodies over ``max_body_bytes``
are refused with 413 before parsing, whether sent with ``Content-Length`` or chunked.

This module builds the app (:func:`create_app`, :func:`app_for_config`) and runs it
(:func:`serve`). The pieces: ``routes`` (endpoints and request handling), ``streaming``
(SSE), ``handling`` (request handling the endpoints share), ``responses_api`` and
``responses_stream`` (the Responses API), ``middleware`` (metrics observation, API keys
and tenants, body limit), ``error_handlers`` (exceptions to responses), ``errors`` (the
error shapes), ``requests`` and ``responses`` (request schemas, answer shapes), ``backend``
(what the server needs from the in-process API) and ``metrics`` (the Prometheus registry).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import uvicorn
from fastapi import FastAPI

from talaria.server import handling, messages, routes
from talaria.server.backend import Backend
from talaria.server.error_handlers import GuardedRoute, install_error_handlers
from talaria.server.metrics import ServerMetrics
from talaria.server.middleware import ApiKeys, BodyLimit, Observe, tenant_of_key

if TYPE_CHECKING:
    from talaria.api import Talaria, TalariaConfig

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
log = logging.getLogger("talaria.server")


def create_app(
    talaria: Backend,
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
    setattr(app.state, handling.STATE, handling.Context(talaria, metrics))
    app.router.route_class = GuardedRoute
    install_error_handlers(app)
    routes.add_routes(app, messages.POSTS)
    # Outermost first at run time: observe -> API keys -> body limit -> routes.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(ApiKeys, keys=keys, tenants=tenants)
    app.add_middleware(Observe, metrics=metrics)
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
    return app_and_talaria(config, api_keys=api_keys, max_body_bytes=max_body_bytes)[0]


def app_and_talaria(
    config: TalariaConfig,
    *,
    api_keys: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> tuple[FastAPI, Talaria]:
    """:func:`app_for_config`'s app and the ``Talaria`` it owns (running while the app's
    lifespan is: from startup to shutdown), for callers that drain or inspect it."""
    from talaria.api import Talaria

    keys = tuple(dict.fromkeys((*config.api_keys, *api_keys)))
    talaria = Talaria(with_tenant_share(config, keys))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with talaria:
            log.info("serving %s", ", ".join(m.name for m in talaria.models()))
            for line in talaria.mechanisms():
                log.info("backend %s: %s", config.backend, line)
            yield

    app = create_app(talaria, api_keys=keys, max_body_bytes=max_body_bytes, lifespan=lifespan)
    return app, talaria


TENANT_SHARE = 0.5
"""With two or more tenants and no ``max_calls_per_tenant`` set, the most of the server's
``max_calls`` one tenant may hold: whoever floods the server, the other tenants always find
half of it free (and a tenant alone at night still gets half). One tenant gets it all."""


def with_tenant_share(config: TalariaConfig, keys: Sequence[str]) -> TalariaConfig:
    """``config`` with the multi-tenant default of ``max_calls_per_tenant``
    (:data:`TENANT_SHARE` of ``max_calls``) when the keys name two or more tenants and it
    is unset; otherwise ``config`` itself."""
    tenants = {tenant_of_key(k, config.tenants) for k in keys}
    if config.max_calls_per_tenant is not None or len(tenants) < 2:
        return config
    share = max(1, int(config.max_calls * TENANT_SHARE))
    return attrs.evolve(config, max_calls_per_tenant=share)


# Seconds uvicorn waits past the drain's grace for the last answers (the ShuttingDown errors
# of calls that did not finish) to reach their clients before it cuts connections.
FLUSH_S = 3


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown (SIGINT / SIGTERM) also drains Talaria at once:
    uvicorn stops accepting connections while ``drain`` refuses new calls on open ones, lets
    calls in flight finish within the grace period and then fails the rest cleanly (a stream
    ends with an error event and ``[DONE]``). Without it, uvicorn would cut the streams
    still running when its own timeout ends, and Talaria would drain only afterwards."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.warning("shutting down: draining calls in flight")
        drain = asyncio.ensure_future(self._drain())
        try:
            await super().shutdown(sockets)
        finally:
            await drain


def _log_to_stderr(level: str) -> None:
    """Talaria's own loggers (``talaria.*``: the call log, warnings) on stderr at ``level``,
    beside uvicorn's lines; once per process."""
    root = logging.getLogger("talaria")
    root.setLevel(level.upper())
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)-9s %(name)s: %(message)s"))
        root.addHandler(handler)


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
    accepting connections and new calls, let running calls finish for up to
    ``config.shutdown_grace_s``, fail those still running with a clean ``ShuttingDown`` error,
    then shut Talaria down (see :class:`DrainingServer`). As uvicorn does, the process then
    ends by the signal it got (exit status 143 for SIGTERM in a shell)."""
    app, talaria = app_and_talaria(config, api_keys=api_keys, max_body_bytes=max_body_bytes)
    _log_to_stderr(log_level)
    grace = max(1, math.ceil(config.shutdown_grace_s)) + FLUSH_S
    uv = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace
    )
    DrainingServer(uv, talaria.drain).run()
