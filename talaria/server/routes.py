"""The HTTP endpoints and how each request is turned into an API call and answered.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both stream with
``stream: true``, see ``talaria.server.streaming``), ``GET /v1/models[/{id}]``, ``POST
/v1/sessions/{id}/events``, ``POST /tokenize`` and ``POST /detokenize`` (vLLM's),
``GET /health`` and ``GET /metrics``. Bodies are validated by ``talaria.server.requests``
and answered in the shapes of ``talaria.server.responses``; failures raise
``talaria.server.errors.HttpError``. Each app
holds its :class:`Context` (the backend and the app's metrics) on ``app.state``, put there
by ``talaria.server.app.create_app``.

Sessions: a call names its session in the ``X-Session-ID`` header or the body field
``session_id``; if both are sent they must be equal (a 400 otherwise, rather than silently
preferring one); else in what coding agents send (``talaria.server.session_ids`` gives the
precedence). Without any, the call is a one-call session. Answers carry the headers
``X-Session-ID`` (the session the call ran in, generated for one-call sessions) and
``X-Talaria-Instance``, and ``X-Talaria-Max-Tokens-Clamped`` when the call's
``max_tokens`` did not fit the context beside its prompt and was lowered to what fits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import attrs
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from talaria.api.results import ChatChunk, Logprob, ModelInfo, ToolCall, Usage
from talaria.server import openapi, streaming
from talaria.server import requests as req
from talaria.server import responses as resp
from talaria.server.backend import Backend
from talaria.server.errors import ErrorShape, HttpError, bad_request, from_validation
from talaria.server.metrics import ServerMetrics
from talaria.server.session_ids import session_of

log = logging.getLogger(__name__)

Body = TypeVar("Body", bound=req.StrictModel)
STATE = "talaria"  # app.state attribute holding the Context
# the output cap granted when max_tokens did not fit beside the prompt (TalariaConfig's
# strict_max_tokens is off): the answer is at most this many tokens
CLAMPED_HEADER = "X-Talaria-Max-Tokens-Clamped"


@attrs.frozen
class Context:
    backend: Backend
    metrics: ServerMetrics


def context_of(request: Request) -> Context:
    ctx: Context = getattr(request.app.state, STATE)
    return ctx


Post = tuple[str, Callable[..., Any], type[req.StrictModel]]  # path, handler, body schema


def add_routes(app: FastAPI, extra: tuple[Post, ...] = ()) -> None:
    """Every endpoint (and the ``extra`` POST endpoints: the Messages API's, see
    ``talaria.server.messages``), with its request body and error answers in the OpenAPI
    document (:mod:`talaria.server.openapi`)."""
    posts: tuple[Post, ...] = (
        ("/v1/chat/completions", _chat_completions, req.ChatCompletionRequest),
        ("/v1/completions", _completions, req.CompletionRequest),
        ("/v1/sessions/{session_id:path}/events", _session_event, req.EventRequest),
        ("/tokenize", _tokenize, req.TokenizeRequest),
        ("/detokenize", _detokenize, req.DetokenizeRequest),
        *extra,
    )
    for path, handler, model in posts:
        app.add_api_route(
            path,
            handler,
            methods=["POST"],
            openapi_extra=openapi.body(model),
            responses=openapi.errors(anthropic=ErrorShape.for_path(path) is ErrorShape.ANTHROPIC),
        )
    reads = openapi.errors((401, 404, 503))
    app.add_api_route("/v1/models", _list_models, methods=["GET"], responses=reads)
    app.add_api_route("/v1/models/{model:path}", _get_model, methods=["GET"], responses=reads)
    app.add_api_route("/health", _health, methods=["GET"], responses=openapi.errors((503,)))
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    openapi.install(app, [model for _, _, model in posts])


async def _chat_completions(request: Request) -> Response:
    """OpenAI chat completions (streamed or not) through the model's chat template."""
    body = await parse_body(request, req.ChatCompletionRequest)
    args = _call_args(request, body, body.new_tokens())
    messages = body.api_messages()
    ctx = context_of(request)

    def open_stream() -> AsyncIterator[ChatChunk]:
        return ctx.backend.chat_stream(
            messages,
            body.model,
            tools=body.tools,
            tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            **args,
        )

    return await _answer(request, open_stream, chat=True, body=body)


async def _completions(request: Request) -> Response:
    """OpenAI (legacy) text completions of a raw prompt, no chat template."""
    body = await parse_body(request, req.CompletionRequest)
    args = _call_args(request, body, body.max_tokens)
    prompt = body.prompt_value()
    ctx = context_of(request)

    def open_stream() -> AsyncIterator[ChatChunk]:
        return ctx.backend.complete_stream(prompt, body.model, **args)

    return await _answer(request, open_stream, chat=False, body=body)


async def _tokenize(request: Request) -> Response:
    """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``
    (``token_strs`` null unless ``return_token_strs``)."""
    body = await parse_body(request, req.TokenizeRequest)
    model = _default_model(request, body.model)
    messages = None if body.messages is None else [m.to_api(i) for i, m in enumerate(body.messages)]
    out = context_of(request).backend.tokenize(
        model,
        prompt=body.prompt,
        messages=messages,
        add_special_tokens=body.add_special_tokens,
        add_generation_prompt=body.add_generation_prompt,
        tools=body.tools,
    )
    return JSONResponse(
        {
            "count": len(out.token_ids),
            "max_model_len": out.max_model_len,
            "tokens": list(out.token_ids),
            "token_strs": list(out.token_strs) if body.return_token_strs else None,
        }
    )


async def _detokenize(request: Request) -> Response:
    """vLLM's ``/detokenize``: ``{"prompt": text}`` (special tokens kept)."""
    body = await parse_body(request, req.DetokenizeRequest)
    model = _default_model(request, body.model)
    return JSONResponse({"prompt": context_of(request).backend.detokenize(model, body.tokens)})


def _default_model(request: Request, name: str | None) -> str:
    """``name`` if served (404 otherwise), or the one served model when ``name`` is None
    (a 400 asking for ``model`` when several are served)."""
    if name is not None:
        return require_model(request, name).name
    served = [m.name for m in context_of(request).backend.models()]
    if len(served) != 1:
        raise bad_request(
            f"model is required: this server serves {', '.join(served) or 'no models'}.",
            "model",
        )
    return served[0]


async def _list_models(request: Request) -> Response:
    """``{"object": "list", "data": [model cards]}``."""
    cards = [_card(m) for m in context_of(request).backend.models()]
    return JSONResponse({"object": "list", "data": cards})


async def _get_model(request: Request, model: str) -> Response:
    """One model card; 404 naming the served models when ``model`` is not one of them."""
    info = require_model(request, model)
    return JSONResponse(_card(info))


async def _session_event(request: Request, session_id: str) -> Response:
    """A tool-gap hint or the end of a session. Answers ``{"session_id", "event"}``, plus
    ``"summary": {"sct_s", "calls"}`` for ``end`` (and observes SCT). 404 for a session the
    server never saw."""
    sid = req.check_session_id(session_id, "the session id in the path")
    event = await parse_body(request, req.EventRequest)
    summary = await context_of(request).backend.event(
        sid,
        event.event,
        tool=event.tool,
        expected_s=event.expected_s,
        measured_s=event.measured_s,
        tenant=tenant_of(request),
    )
    out: dict[str, Any] = {"session_id": sid, "event": event.event}
    if summary is not None:
        context_of(request).metrics.sct.observe(max(summary.sct_s, 0.0))
        out["summary"] = {"sct_s": summary.sct_s, "calls": summary.calls}
    return JSONResponse(out, headers={"X-Session-ID": header_value(sid)})


async def _health(request: Request) -> Response:
    """200 ``{"status": "ok", "models": [...], "instances": {name: healthy}}`` while at least
    one instance is healthy; 503 with ``"status": "unavailable"`` when none is or the API
    does not answer (not started, failed). With ``?integrity=true`` it also checks every
    invariant of the runtime and its memory managers between engine steps (a deep check for
    operators and soak tests, not for a load balancer's probe): ``"integrity": "ok"``, or 503
    with ``"integrity"`` listing what is broken."""
    backend = context_of(request).backend
    try:
        names = [m.name for m in backend.models()]
        instances = {
            str(name): bool(info.get("healthy", True)) if isinstance(info, dict) else True
            for name, info in dict(backend.stats().get("instances", {})).items()
        }
    except Exception as exc:
        return JSONResponse({"status": "unavailable", "error": type(exc).__name__}, 503)
    ok = any(instances.values()) or not instances
    body: dict[str, object] = {
        "status": "ok" if ok else "unavailable",
        "models": names,
        "instances": instances,
    }
    deep = request.query_params.get("integrity", "false").lower()
    if deep not in ("true", "1", "false", "0"):
        raise bad_request("integrity must be true or false", "integrity")
    if deep in ("true", "1"):
        problems = await backend.integrity_problems()
        body["integrity"] = problems or "ok"
        ok = ok and not problems
    return JSONResponse(body, 200 if ok else 503)


async def _metrics(request: Request) -> Response:
    """Prometheus exposition text of this app's registry."""
    data, content_type = context_of(request).metrics.render()
    return Response(data, media_type=content_type)


# --- request handling --------------------------------------------------------------------------


async def parse_body(
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


def tenant_of(request: Request) -> str:
    """The caller's tenant: its API key's, or ``default`` when the server has no keys."""
    return str(getattr(request.state, "talaria_tenant", "default"))


def _call_args(
    request: Request, body: req.SamplingFields, max_tokens: int | None
) -> dict[str, Any]:
    """Keyword arguments for ``chat_stream`` / ``complete_stream``, after checking the model
    and resolving the session id (``talaria.server.session_ids``). Records the model for
    metrics."""
    require_model(request, body.model)
    request.state.talaria_model = body.model
    sid = session_of(request.headers, body.session_id, prompt_cache_key=body.prompt_cache_key)
    if body.user is not None:  # OpenAI's end-user id: recorded, never a tenant or a scope
        log.info(
            "call of tenant %s, session %s, for user %r", tenant_of(request), sid, body.user[:256]
        )
    request.state.talaria_ignored = body.unknown_fields()
    return {
        "session_id": sid,
        "tenant": tenant_of(request),
        "max_tokens": max_tokens,
        **body.sampling_args(),
    }


def require_model(request: Request, name: str) -> ModelInfo:
    """The served model called ``name``; raises ``HttpError`` (404) listing the served ones."""
    served = list(context_of(request).backend.models())
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


def _card(info: ModelInfo) -> dict[str, Any]:
    return resp.model_card(info.name, info.context_length, info.source, info.created)


def header_value(value: str) -> str:
    """``value`` made safe for an HTTP header (printable ASCII)."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in value)[:512]


async def _answer(
    request: Request,
    open_stream: Callable[[], AsyncIterator[ChatChunk]],
    *,
    chat: bool,
    body: req.SamplingFields,
) -> Response:
    """Run one call and answer it, streamed (SSE) or whole.

    The first chunk is awaited before any byte is sent, so errors raised before generation
    starts (unknown model, context too long, overloaded) get their own HTTP status; later
    errors become an SSE error event (streamed) or the HTTP error (not streamed). Time to
    first token is observed here for both kinds.
    """
    ctx = context_of(request)
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
    ctx.metrics.ttft.labels(body.model).observe(max(time.perf_counter() - received, 0.0))
    headers = {
        "X-Talaria-Instance": header_value(first.instance),
        "X-Session-ID": header_value(first.session_id),
    }
    if first.max_tokens_clamped is not None:
        headers[CLAMPED_HEADER] = str(first.max_tokens_clamped)
    ignored = getattr(request.state, "talaria_ignored", [])
    if ignored:
        headers["X-Talaria-Ignored-Fields"] = header_value(",".join(ignored))
    if body.stream:
        head = resp.ChunkHead(first.id, first.model, first.created, body.include_usage)
        events = streaming.sse(request, first, stream, head, chat, body.n)
        headers["Cache-Control"] = "no-cache"
        return streaming.SameTaskStream(events, media_type="text/event-stream", headers=headers)
    answer = await _collect(first, stream, body.n)
    payload = resp.chat_completion(answer) if chat else resp.text_completion(answer)
    return JSONResponse(payload, headers=headers)


async def _collect(first: ChatChunk, stream: AsyncIterator[ChatChunk], n: int) -> resp.Answer:
    """Join the chunks of an answer's ``n`` choices (closing the stream); a stream that ends
    before a choice's ``finish_reason`` came is taken as finished with ``stop`` there."""
    texts: list[list[str]] = [[] for _ in range(n)]
    calls: list[list[ToolCall]] = [[] for _ in range(n)]
    logprobs: list[list[Logprob] | None] = [None] * n
    finish: dict[int, str] = {}
    usages: dict[int, Usage] = {}
    chunk: ChatChunk | None = first
    try:
        while chunk is not None:
            i = chunk.index
            texts[i].append(chunk.text)
            calls[i].extend(chunk.tool_calls)
            if chunk.logprobs is not None:
                logprobs[i] = (logprobs[i] or []) + list(chunk.logprobs)
            if chunk.finish_reason is not None:
                finish[i] = chunk.finish_reason
                if chunk.usage is not None:
                    usages[i] = chunk.usage
                if len(finish) == n:
                    break
            chunk = await anext(stream, None)
    finally:
        await streaming.close(stream)
    choices = tuple(
        resp.AnswerChoice(
            i,
            "".join(texts[i]),
            finish.get(i, "stop"),
            _tuple_or_none(logprobs[i]),
            tuple(calls[i]),
        )
        for i in range(n)
    )
    usage = Usage.of_choices(tuple(usages[i] for i in range(n))) if len(usages) == n else None
    return resp.Answer(
        id=first.id,
        model=first.model,
        created=first.created,
        choices=choices,
        usage=usage,
        instance=first.instance,
        session_id=first.session_id,
    )


def _tuple_or_none(items: list[Logprob] | None) -> tuple[Logprob, ...] | None:
    return None if items is None else tuple(items)
