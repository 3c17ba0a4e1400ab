"""``ChatTalaria``: a LangChain chat model served by a Talaria server (OpenAI protocol).

See the package docstring for usage. Requests go through the ``openai`` client, so errors
are the ``openai`` exceptions LangChain's OpenAI models raise (``openai.NotFoundError`` for
an unknown model, ``openai.BadRequestError``, ``openai.APIConnectionError`` when the
server is unreachable, ``openai.APITimeoutError``), and are retried ``max_retries`` times
where the ``openai`` client retries (connection errors, 408/409/429/5xx).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import openai
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils import secret_from_env
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field, PrivateAttr, SecretStr

from talaria.integrations.langchain.convert import (
    ai_message,
    final_chunk,
    openai_messages,
    stream_tool_chunks,
)
from talaria.integrations.openai_chat import create_options
from talaria.session import normalize_session_id, session_id_from_langchain

__all__ = ["API_KEY_ENV", "DEFAULT_BASE_URL", "DEFAULT_MODEL", "SESSION_KWARG", "ChatTalaria"]

API_KEY_ENV = "TALARIA_API_KEY"  # the key `talaria serve` also reads
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_MODEL = "smollm2-135m"
SESSION_KWARG = "talaria_session_id"  # the session id found in a run's config, passed down
_NOT_FORWARDED = frozenset({"stream", "stream_options", "session_id", SESSION_KWARG})


@attrs.frozen
class _Request:
    messages: list[dict[str, Any]]
    params: dict[str, Any]
    session_id: str | None


@contextmanager
def _friendly_errors(base_url: str) -> Iterator[None]:
    """Re-raise a connection failure (not a timeout) with a message saying where and what
    to check; same exception type."""
    try:
        yield
    except openai.APITimeoutError:
        raise
    except openai.APIConnectionError as exc:
        raise openai.APIConnectionError(
            message=f"cannot connect to the Talaria server at {base_url}: "
            f"{exc.__cause__ or exc.message}. Is `talaria serve` running there?",
            request=exc.request,
        ) from exc


def _openai_base_url(base_url: str) -> str:
    base = base_url.strip().rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class _StreamState:
    """What a streamed answer leaves for its last chunk: finish reason and usage."""

    def __init__(self) -> None:
        self.finish: str | None = None
        self.usage: Any = None

    def feed(self, chunk: Any) -> Iterator[AIMessageChunk]:
        """The message chunks of one ``ChatCompletionChunk``."""
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices[:1]:
            delta = choice.delta
            calls = stream_tool_chunks(getattr(delta, "tool_calls", None))
            if delta.content or calls:
                yield AIMessageChunk(content=delta.content or "", tool_call_chunks=calls)
            if choice.finish_reason:
                self.finish = choice.finish_reason


class ChatTalaria(BaseChatModel):
    """A chat model on a Talaria server (``talaria serve``), OpenAI-compatible.

    ``api_key``: sent as a bearer token (default ``$TALARIA_API_KEY``; none needed when the
    server has no keys). Sampling fields left ``None`` are not sent (the server's defaults
    apply);
    ``model_kwargs`` adds any other request field. ``timeout`` bounds a call and
    ``connect_timeout`` the wait for a connection (seconds), so an unreachable server fails
    within about ``connect_timeout`` per attempt.

    Sessions (docs/design.md): each call's ``X-Session-ID`` is, in order, a ``session_id=``
    call argument, the run config's ``session_id`` then ``thread_id`` (top level, in
    ``metadata`` or in ``configurable``; LangGraph's ``thread_id`` thus names the session),
    the run's callback metadata, then the ``session_id`` field; with none, each call is a
    one-call session.

    Tools: :meth:`bind_tools` sends OpenAI-format ``tools`` (and ``tool_choice``); tool
    calls are the answer's ``tool_calls``, which the server reads from the model's output
    (and it renders the history's calls for the model's chat template).
    """

    model: str = DEFAULT_MODEL
    base_url: str = DEFAULT_BASE_URL
    api_key: SecretStr | None = Field(default_factory=secret_from_env(API_KEY_ENV, default=None))
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: list[str] | None = None
    timeout: float = Field(default=600.0, gt=0)
    connect_timeout: float = Field(default=5.0, gt=0)
    max_retries: int = Field(default=2, ge=0)
    session_id: str | None = None
    streaming: bool = False
    model_kwargs: dict[str, Any] = Field(default_factory=dict)

    _client: openai.OpenAI | None = PrivateAttr(default=None)

    @property
    def _llm_type(self) -> str:
        return "talaria"

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": API_KEY_ENV}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "base_url": self.base_url}

    # ------------------------------------------------------------------ tools
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind ``tools`` (LangChain tools, functions, pydantic classes or OpenAI tool dicts)
        as OpenAI ``tools``. ``tool_choice``: "auto", "none", "required" ("any" is taken as
        "required"), a tool's name, or an OpenAI tool_choice object."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = _tool_choice(tool_choice)
        return super().bind(tools=formatted, **kwargs)

    # ------------------------------------------------------------------ session ids
    def _with_session(
        self, config: RunnableConfig | None, kwargs: dict[str, Any]
    ) -> tuple[RunnableConfig | None, dict[str, Any]]:
        """The config and kwargs of a call, with its session id (see the class docstring)
        passed down as ``SESSION_KWARG`` and recorded as ``session_id`` in the run's
        metadata (callback handlers and tracers see it there)."""
        ensured = ensure_config(config)
        sid = _session_id(kwargs, ensured, self.session_id)
        if sid is None:
            return config, kwargs
        ensured["metadata"] = {**(ensured.get("metadata") or {}), "session_id": sid}
        rest = {k: v for k, v in kwargs.items() if k != "session_id"}
        return ensured, {**rest, SESSION_KWARG: sid}

    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        cfg, kw = self._with_session(config, kwargs)
        return super().invoke(input, cfg, stop=stop, **kw)

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        cfg, kw = self._with_session(config, kwargs)
        return await super().ainvoke(input, cfg, stop=stop, **kw)

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        cfg, kw = self._with_session(config, kwargs)
        return super().stream(input, cfg, stop=stop, **kw)

    def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        cfg, kw = self._with_session(config, kwargs)
        return super().astream(input, cfg, stop=stop, **kw)

    # ------------------------------------------------------------------ requests
    def _request(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: Mapping[str, Any],
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
    ) -> _Request:
        params: dict[str, Any] = dict(self.model_kwargs)
        for name in ("temperature", "top_p", "max_tokens", "seed"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        params.update({k: v for k, v in kwargs.items() if k not in _NOT_FORWARDED})
        stops = stop if stop is not None else kwargs.get("stop", self.stop)
        if stops:
            params["stop"] = list(stops)
        else:
            params.pop("stop", None)
        metadata = run_manager.metadata if run_manager is not None else None
        sid = _session_id(kwargs, metadata, self.session_id)
        return _Request(openai_messages(messages), params, sid)

    def _options(self, request: _Request, stream: bool) -> dict[str, Any]:
        return create_options(
            self.model,
            request.messages,
            request.params,
            {},  # no headers of its own: the session id is the only one
            stream=stream,
            session_id=request.session_id,
            timeout_s=self.timeout,
            connect_timeout_s=self.connect_timeout,
        )

    def _key(self) -> str:
        return self.api_key.get_secret_value() if self.api_key is not None else "EMPTY"

    def _sync_client(self) -> openai.OpenAI:
        if self._client is None:
            self._client = openai.OpenAI(
                base_url=_openai_base_url(self.base_url),
                api_key=self._key(),
                max_retries=self.max_retries,
            )
        return self._client

    def _async_client(self) -> openai.AsyncOpenAI:
        """A client per call: its connections never outlive the caller's event loop."""
        return openai.AsyncOpenAI(
            base_url=_openai_base_url(self.base_url),
            api_key=self._key(),
            max_retries=self.max_retries,
        )

    # ------------------------------------------------------------------ LangChain API
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(messages, stop, kwargs, run_manager)
        with _friendly_errors(self.base_url):
            raw = self._sync_client().chat.completions.with_raw_response.create(
                **self._options(request, False)
            )
            completion = raw.parse()
        message = ai_message(completion, raw.headers)
        return _result(message)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(messages, stop, kwargs, run_manager)
        with _friendly_errors(self.base_url):
            async with self._async_client() as client:
                raw = await client.chat.completions.with_raw_response.create(
                    **self._options(request, False)
                )
                completion = raw.parse()
        message = ai_message(completion, raw.headers)
        return _result(message)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs, run_manager)
        state = _StreamState()
        with _friendly_errors(self.base_url):
            raw = self._sync_client().chat.completions.with_raw_response.create(
                **self._options(request, True)
            )
            with raw.parse() as chunks:
                for chunk in chunks:
                    for message in state.feed(chunk):
                        yield ChatGenerationChunk(message=message)
        yield self._last(state, raw.headers)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs, run_manager)
        state = _StreamState()
        with _friendly_errors(self.base_url):
            async with self._async_client() as client:
                raw = await client.chat.completions.with_raw_response.create(
                    **self._options(request, True)
                )
                async with raw.parse() as chunks:
                    async for chunk in chunks:
                        for message in state.feed(chunk):
                            yield ChatGenerationChunk(message=message)
        yield self._last(state, raw.headers)

    def _last(self, state: _StreamState, headers: Any) -> ChatGenerationChunk:
        last = final_chunk(state.finish, state.usage, self.model)
        last.response_metadata["session_id"] = headers.get("x-session-id")
        last.response_metadata["talaria_instance"] = headers.get("x-talaria-instance")
        info = {"finish_reason": last.response_metadata.get("finish_reason")}
        return ChatGenerationChunk(message=last, generation_info=info)


def _result(message: AIMessage) -> ChatResult:
    info = {"finish_reason": message.response_metadata.get("finish_reason")}
    usage = dict(message.usage_metadata) if message.usage_metadata else {}
    return ChatResult(
        generations=[ChatGeneration(message=message, generation_info=info)],
        llm_output={"model_name": message.response_metadata.get("model_name"), "usage": usage},
    )


def _session_id(
    kwargs: Mapping[str, Any], run: Mapping[str, Any] | None, default: str | None
) -> str | None:
    """A call's session id: a ``session_id`` argument, one already resolved
    (``SESSION_KWARG``), the run's config or callback metadata (``session_id`` then
    ``thread_id``), then ``default``."""
    for key in ("session_id", SESSION_KWARG):
        value = kwargs.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
            return normalize_session_id(str(value).strip())
    found = session_id_from_langchain(dict(run)) if run else None
    if found is not None:
        return found
    return normalize_session_id(default.strip()) if default and default.strip() else None


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        return choice
    if choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}
