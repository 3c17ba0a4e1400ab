"""Failed calls as LiteLLM's own exceptions, so an agent catches what it always catches.

LiteLLM passes its own exception types through its error mapping unchanged
(``litellm.LITELLM_EXCEPTION_TYPES``); the provider raises them directly:

=====================================  =============================================
failure                                LiteLLM exception
=====================================  =============================================
400 ``context_length_exceeded``        ``ContextWindowExceededError``
400, 413 and other 4xx                 ``BadRequestError``
401 / 403                              ``AuthenticationError`` / ``PermissionDeniedError``
404 (unknown model)                    ``NotFoundError``
422                                    ``UnprocessableEntityError``
429                                    ``RateLimitError``
503 (overloaded, shutting down)        ``ServiceUnavailableError``
500 and other 5xx                      ``InternalServerError``
no connection                          ``APIConnectionError``
timeout                                ``Timeout``
=====================================  =============================================
"""

from __future__ import annotations

import httpx
from litellm import exceptions as lx

from talaria.integrations.litellm.call import CallError, ServerError, TimedOut

__all__ = ["to_litellm_error"]


def _response(status: int) -> httpx.Response:
    return httpx.Response(
        status, request=httpx.Request("POST", "http://talaria/v1/chat/completions")
    )


def to_litellm_error(exc: CallError, model: str, provider: str) -> Exception:
    """The LiteLLM exception for ``exc`` (see the module docstring); ``model`` and
    ``provider`` are what LiteLLM records on it."""
    message = exc.message
    if isinstance(exc, TimedOut):
        return lx.Timeout(message, model=model, llm_provider=provider)
    if not isinstance(exc, ServerError):
        return lx.APIConnectionError(message, llm_provider=provider, model=model)
    status = exc.status
    if status == 400 and exc.code == "context_length_exceeded":
        return lx.ContextWindowExceededError(message, model=model, llm_provider=provider)
    if status == 401:
        return lx.AuthenticationError(message, llm_provider=provider, model=model)
    if status == 403:
        return lx.PermissionDeniedError(
            message, llm_provider=provider, model=model, response=_response(status)
        )
    if status == 404:
        return lx.NotFoundError(message, model=model, llm_provider=provider)
    if status == 422:
        return lx.UnprocessableEntityError(
            message, model=model, llm_provider=provider, response=_response(status)
        )
    if status == 429:
        return lx.RateLimitError(message, llm_provider=provider, model=model)
    if 400 <= status < 500:
        return lx.BadRequestError(message, model=model, llm_provider=provider)
    if status == 503:
        return lx.ServiceUnavailableError(message, llm_provider=provider, model=model)
    return lx.InternalServerError(message, llm_provider=provider, model=model)
