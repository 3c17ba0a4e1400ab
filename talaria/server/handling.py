"""Request handling every endpoint shares: the app's :class:`Context`, parsing a body,
the caller's tenant, the served model a call names, and opening a call's stream up to its
first chunk (with the answer's headers). ``talaria.server.routes`` (chat and text
completions, ...) and ``talaria.server.responses_api`` (the Responses API) build on it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TypeVar

import attrs
from fastapi import Request
from pydantic import ValidationError

from talaria.api.results import ChatChunk, ModelInfo
from talaria.server import streaming
from talaria.server.backend import Backend
from talaria.server.errors import HttpError, from_validation
from talaria.server.metrics import ServerMetrics
from talaria.server.requests import StrictModel

Body = TypeVar("Body", bound=StrictModel)
STATE = "talaria"  # app.state attribute holding the Context
# the output cap granted when max_tokens did not fit beside the prompt (TalariaConfig's
# strict_max_tokens is off): the answer is at most this many tokens
CLAMPED_HEADER = "X-Talaria-Max-Tokens-Clamped"


@attrs.frozen
class Context:
    """What an app's handlers use: the backend (the in-process API) and the app's metrics."""

    backend: Backend
    metrics: ServerMetrics


def context(request: Request) -> Context:
    """The :class:`Context` of the app serving ``request``."""
    ctx: Context = getattr(request.app.state, STATE)
    return ctx


async def parse(
    request: Request, model: type[Body], hints: Mapping[str, str] | None = None
) -> Body:
    """Validate the raw body as ``model`` (strict JSON) and run its ``check``. Raises
    ``HttpError`` (400) naming the field at fault (``hints``: see ``from_validation``)."""
    raw = await request.body()
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation(exc, hints=hints) from None
    check = getattr(body, "check", None)
    if check is not None:
        check()
    return body


def tenant(request: Request) -> str:
    """The caller's tenant: its API key's, or ``default`` when the server has no keys."""
    return str(getattr(request.state, "talaria_tenant", "default"))


def require_model(request: Request, name: str) -> ModelInfo:
    """The served model called ``name``; raises ``HttpError`` (404) listing the served ones."""
    served = list(context(request).backend.models())
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


def header_value(value: str) -> str:
    """``value`` made safe for an HTTP header (printable ASCII)."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in value)[:512]


async def first_chunk(
    request: Request, open_stream: Callable[[], AsyncIterator[ChatChunk]], model: str
) -> tuple[ChatChunk, AsyncIterator[ChatChunk]]:
    """Open a call's stream and await its first chunk before any byte is sent, so errors
    raised before generation starts (unknown model, context too long, overloaded) get their
    own HTTP status; observes time to first token. Closes the stream on failure; raises
    ``HttpError`` (500 ``empty_stream``) for a stream with no chunk at all."""
    stream = open_stream()
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        await streaming.close(stream)
        raise HttpError(500, "The model produced no output; retry.", code="empty_stream") from None
    except BaseException:
        await streaming.close(stream)
        raise
    received = float(request.state.talaria_received)
    context(request).metrics.ttft.labels(model).observe(max(time.perf_counter() - received, 0.0))
    return first, stream


def answer_headers(request: Request, first: ChatChunk) -> dict[str, str]:
    """The headers of an answer: ``X-Talaria-Instance``, ``X-Session-ID``,
    ``X-Talaria-Max-Tokens-Clamped`` when ``max_tokens`` was lowered to what fits, and, when
    the request sent fields the server ignored, ``X-Talaria-Ignored-Fields``."""
    headers = {
        "X-Talaria-Instance": header_value(first.instance),
        "X-Session-ID": header_value(first.session_id),
    }
    if first.max_tokens_clamped is not None:
        headers[CLAMPED_HEADER] = str(first.max_tokens_clamped)
    ignored = getattr(request.state, "talaria_ignored", [])
    if ignored:
        headers["X-Talaria-Ignored-Fields"] = header_value(",".join(ignored))
    return headers
