"""How an exception raised while answering becomes an error response (OpenAI's shape, or
Anthropic's under ``/v1/messages``: ``talaria.server.errors.ErrorShape``).

The errors themselves (shape, status, message) are ``talaria.server.errors``; this module
wires them into a FastAPI app: :class:`GuardedRoute` (unexpected exceptions become a logged
500), :func:`install_error_handlers` (``HttpError``, ``TalariaError``, FastAPI validation
errors and Starlette's 404 / 405). ``talaria.server.app`` installs both.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from talaria.errors import TalariaError
from talaria.server.errors import ErrorShape, HttpError, bad_request, from_talaria, internal


class GuardedRoute(APIRoute):
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
                return internal(exc).response(_shape(request))

        return guarded


def install_error_handlers(app: FastAPI) -> None:
    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HttpError)
        return exc.response(_shape(request))

    async def on_talaria(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, TalariaError)
        return from_talaria(exc).response(_shape(request))

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        err = bad_request(f"Invalid request: {where}: {first.get('msg', 'invalid')}.")
        return err.response(_shape(request))

    async def on_starlette(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _route_error(request, exc.status_code).response(_shape(request))

    app.add_exception_handler(HttpError, on_http_error)
    app.add_exception_handler(TalariaError, on_talaria)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_starlette)


def _shape(request: Request) -> ErrorShape:
    """Anthropic's error shape under ``/v1/messages``, OpenAI's elsewhere."""
    return ErrorShape.for_path(request.url.path)


def _route_error(request: Request, status: int) -> HttpError:
    path = request.url.path
    if status == 404:
        return HttpError(
            404,
            f"No endpoint at {path[:200]}. This server serves POST /v1/chat/completions, "
            "POST /v1/completions, POST /v1/responses, POST /v1/messages, GET /v1/models, "
            "POST /v1/sessions/{id}/events, GET /health "
            "and GET /metrics.",
            code="not_found",
        )
    if status == 405:
        return HttpError(
            405, f"{request.method} is not allowed on {path[:200]}.", code="method_not_allowed"
        )
    return HttpError(status, f"Request failed with HTTP {status}.", code=str(status))
