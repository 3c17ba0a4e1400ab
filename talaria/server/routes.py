"""The HTTP endpoints and how each request is turned into an API call and answered.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both stream with
``stream: true``, see ``talaria.server.streaming``), ``POST /v1/responses`` (OpenAI's
Responses API, see ``talaria.server.responses_api``), ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens`` (Anthropic's, see ``talaria.server.messages``), ``GET
/v1/models[/{id}]``, ``POST
/v1/sessions/{id}/events``, ``POST /tokenize`` and ``POST /detokenize`` (vLLM's),
``GET /health`` and ``GET /metrics``. Bodies are validated by ``talaria.server.requests``
and answered in the shapes of ``talaria.server.responses``; failures raise
``talaria.server.errors.HttpError``. Each app holds its ``talaria.server.handling.Context``
(the backend and the app's metrics) on ``app.state``, put there by
``talaria.server.app.create_app``; ``handling`` has the request handling every endpoint
shares.

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
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from talaria.api.results import ChatChunk, Logprob, ModelInfo, ToolCall, Usage
from talaria.server import handling, openapi, responses_api, streaming
from talaria.server import requests as req
from talaria.server import responses as resp
from talaria.server.errors import ErrorShape, bad_request
from talaria.server.session_ids import session_of

if TYPE_CHECKING:
    from talaria.api.talaria import CallArgs
    from talaria.server.backend import Backend

log = logging.getLogger(__name__)


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
        ("/v1/responses", responses_api.create_response, responses_api.ResponsesRequest),
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
    body = await handling.parse(request, req.ChatCompletionRequest)
    messages, tools, choice = body.api_messages(), body.tools, body.tool_choice

    def open_stream(backend: Backend, args: CallArgs) -> AsyncIterator[ChatChunk]:
        parallel = body.parallel_tool_calls
        return backend.chat_stream(
            messages,
            body.model,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            **args,
        )

    return await _answer(request, open_stream, chat=True, body=body)


async def _completions(request: Request) -> Response:
    """OpenAI (legacy) text completions of a raw prompt, no chat template."""
    body = await handling.parse(request, req.CompletionRequest)
    prompt = body.prompt_value()
    return await _answer(
        request,
        lambda backend, args: backend.complete_stream(prompt, body.model, **args),
        chat=False,
        body=body,
    )


async def _tokenize(request: Request) -> Response:
    """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``
    (``token_strs`` null unless ``return_token_strs``)."""
    body = await handling.parse(request, req.TokenizeRequest)
    model = _default_model(request, body.model)
    messages = None if body.messages is None else [m.to_api(i) for i, m in enumerate(body.messages)]
    out = handling.context(request).backend.tokenize(
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
    body = await handling.parse(request, req.DetokenizeRequest)
    model = _default_model(request, body.model)
    backend = handling.context(request).backend
    return JSONResponse({"prompt": backend.detokenize(model, body.tokens)})


def _default_model(request: Request, name: str | None) -> str:
    """``name`` if served (404 otherwise), or the one served model when ``name`` is None
    (a 400 asking for ``model`` when several are served)."""
    if name is not None:
        return handling.require_model(request, name).name
    served = [m.name for m in handling.context(request).backend.models()]
    if len(served) != 1:
        raise bad_request(
            f"model is required: this server serves {', '.join(served) or 'no models'}.",
            "model",
        )
    return served[0]


async def _list_models(request: Request) -> Response:
    """``{"object": "list", "data": [model cards]}``."""
    cards = [_card(m) for m in handling.context(request).backend.models()]
    return JSONResponse({"object": "list", "data": cards})


async def _get_model(request: Request, model: str) -> Response:
    """One model card; 404 naming the served models when ``model`` is not one of them."""
    info = handling.require_model(request, model)
    return JSONResponse(_card(info))


async def _session_event(request: Request, session_id: str) -> Response:
    """A tool-gap hint or the end of a session. Answers ``{"session_id", "event"}``, plus
    ``"summary": {"sct_s", "calls"}`` for ``end`` (and observes SCT). 404 for a session the
    server never saw."""
    sid = req.check_session_id(session_id, "the session id in the path")
    event = await handling.parse(request, req.EventRequest)
    summary = await handling.context(request).backend.event(
        sid,
        event.event,
        tool=event.tool,
        expected_s=event.expected_s,
        measured_s=event.measured_s,
        tenant=handling.tenant(request),
    )
    out: dict[str, Any] = {"session_id": sid, "event": event.event}
    if summary is not None:
        handling.context(request).metrics.sct.observe(max(summary.sct_s, 0.0))
        out["summary"] = {"sct_s": summary.sct_s, "calls": summary.calls}
    return JSONResponse(out, headers={"X-Session-ID": handling.header_value(sid)})


async def _health(request: Request) -> Response:
    """200 ``{"status": "ok", "models": [...], "instances": {name: healthy}}`` while at least
    one instance is healthy; 503 with ``"status": "unavailable"`` when none is or the API
    does not answer (not started, failed). With ``?integrity=true`` it also checks every
    invariant of the runtime and its memory managers between engine steps (a deep check for
    operators and soak tests, not for a load balancer's probe): ``"integrity": "ok"``, or 503
    with ``"integrity"`` listing what is broken."""
    backend = handling.context(request).backend
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
    data, content_type = handling.context(request).metrics.render()
    return Response(data, media_type=content_type)


# --- request handling --------------------------------------------------------------------------


def _call_args(request: Request, body: req.SamplingFields) -> CallArgs:
    """Keyword arguments for ``chat_stream`` / ``complete_stream``, after checking the model
    and resolving the session id (``talaria.server.session_ids``). Records the model for
    metrics."""
    handling.require_model(request, body.model)
    request.state.talaria_model = body.model
    sid = session_of(request.headers, body.session_id, prompt_cache_key=body.prompt_cache_key)
    if body.user is not None:  # OpenAI's end-user id: recorded, never a tenant or a scope
        tenant = handling.tenant(request)
        log.info("call of tenant %s, session %s, for user %r", tenant, sid, body.user[:256])
    request.state.talaria_ignored = body.unknown_fields()
    return {
        "params": body.sampling_params(),
        "session_id": sid,
        "tenant": handling.tenant(request),
        "n": body.n,
    }


def _card(info: ModelInfo) -> dict[str, Any]:
    return resp.model_card(info.name, info.context_length, info.source, info.created)


async def _answer(
    request: Request,
    open_stream: Callable[[Backend, CallArgs], AsyncIterator[ChatChunk]],
    *,
    chat: bool,
    body: req.SamplingFields,
) -> Response:
    """Run one call and answer it, streamed (SSE) or whole: ``open_stream`` opens it on the
    backend with the request's call arguments (:func:`_call_args`).

    The first chunk is awaited before any byte is sent (``handling.first_chunk``), so errors
    raised before generation starts get their own HTTP status; later errors become an SSE
    error event (streamed) or the HTTP error (not streamed).
    """
    args = _call_args(request, body)
    backend = handling.context(request).backend
    first, stream = await handling.first_chunk(
        request, lambda: open_stream(backend, args), body.model
    )
    headers = handling.answer_headers(request, first)
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
