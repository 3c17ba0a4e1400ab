"""Request schemas (pydantic, strict) and response shapes (plain dicts) of the OpenAI API.

Requests are validated strictly: a string where a number belongs is an error, not coerced
(``"0.5"`` for ``temperature`` is rejected; ``1`` for a float is fine). Unknown fields are
ignored, as OpenAI-compatible servers do, so clients that send extra options keep working;
known options Talaria cannot honour (``n > 1``, penalties, logprobs, ...) are rejected by
:meth:`SamplingFields.check` with a message naming them, rather than silently dropped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal, Protocol

import attrs
from pydantic import BaseModel, ConfigDict, Field

from talaria.errors import BadRequest
from talaria.server.errors import HttpError, bad_request
from talaria.session import ids

MAX_STOP = 16  # stop strings per request
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class StrictModel(BaseModel):
    """Base of the request schemas: strict types, no NaN or infinity, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and empty choices."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # accepted, ignored (vLLM extension)


class ContentPart(StrictModel):
    """One part of a list-valued message content; only ``text`` parts are supported."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    """One chat message. Content may be a string, a list of text parts, or null (an assistant
    message that only calls tools). Other fields (``tool_calls``, ``name``, ...) pass through
    to the chat template unchanged."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    role: Role
    content: str | list[ContentPart] | None = None

    def to_api(self, index: int) -> dict[str, Any]:
        """The message as the in-process API takes it, text parts joined into one string.
        Raises ``HttpError`` (400) for non-text parts."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts: list[str] = []
            for j, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{index}].content[{j}] is a {part.type!r} part; this server "
                        "accepts text only (a string, or parts of type 'text').",
                        param=f"messages.{index}.content",
                    )
                texts.append(part.text)
            out["content"] = "".join(texts)
        elif self.content is None:
            out["content"] = ""
        return out


class SamplingFields(StrictModel):
    """Fields common to chat and text completions."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extension; 0 and -1 both mean "off"
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    session_id: str | None = None  # extension; the X-Session-ID header is the other way
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def check(self) -> None:
        """Reject valid-looking options Talaria cannot honour. Raises ``HttpError`` (400)."""
        if self.n != 1:
            raise bad_request(f"n={self.n} is not supported; send n=1 (one choice).", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise bad_request(f"{name} is not supported; leave it out or send 0.", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported; leave it out.", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true.", "stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise bad_request(
                f"stop takes at most {MAX_STOP} non-empty strings, got {stops!r:.200}.", "stop"
            )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``tools`` go to the model's chat template (unless
    ``tool_choice`` is ``"none"``); other ``tool_choice`` values are accepted but not
    enforced, and tool calls come back as text."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        """As :meth:`SamplingFields.check`, plus the chat-only options."""
        super().check()
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs are not supported; leave them out.", "logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request(
                "response_format other than {'type': 'text'} is not supported.", "response_format"
            )
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise bad_request(
                "max_tokens and max_completion_tokens disagree; send only one of them.",
                "max_completion_tokens",
            )

    def new_tokens(self) -> int | None:
        """The output cap in tokens (``max_completion_tokens`` or ``max_tokens``)."""
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def api_tools(self) -> list[dict[str, Any]] | None:
        """Tool definitions for the chat template, or None."""
        return None if self.tool_choice == "none" or not self.tools else self.tools

    def api_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the in-process API."""
        return [m.to_api(i) for i, m in enumerate(self.messages)]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a raw prompt, no chat template."""

    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def check(self) -> None:
        """As :meth:`SamplingFields.check`, plus the completion-only options."""
        super().check()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise bad_request(
                f"prompt holds {len(self.prompt)} strings; send one prompt per request.",
                "prompt",
            )
        if self.echo:
            raise bad_request("echo is not supported; leave it out.", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported; leave it out.", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported; leave it out or send 1.", "best_of")
        if self.logprobs is not None:
            raise bad_request("logprobs are not supported; leave them out.", "logprobs")

    def prompt_text(self) -> str:
        """The single prompt string."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class EventRequest(StrictModel):
    """``POST /v1/sessions/{id}/events``: a tool-gap hint or the end of a session."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    event: Literal["tool_start", "tool_end", "end"]
    tool: str | None = Field(default=None, min_length=1, max_length=200)
    expected_s: float | None = Field(default=None, ge=0.0)
    measured_s: float | None = Field(default=None, ge=0.0)


def check_session_id(value: str, source: str) -> str:
    """Return ``value`` if it is a usable session id (``talaria.session.ids``' rule: 1..256
    printable ASCII characters, no spaces); raise ``HttpError`` (400) naming ``source``."""
    try:
        return ids.check_session_id(value)
    except BadRequest as exc:
        raise HttpError(
            400, f"{source}: {exc}.", code="invalid_session_id", param="session_id"
        ) from None


# --- response shapes -------------------------------------------------------------------------


class UsageLike(Protocol):
    """Token counts of one call (``talaria.api.Usage``)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...


@attrs.frozen
class Answer:
    """A finished call as the server reports it (built from the API's stream)."""

    id: str
    model: str
    created: int  # unix seconds
    text: str
    finish_reason: str
    usage: UsageLike | None
    instance: str
    session_id: str


def usage_dict(usage: UsageLike | None) -> dict[str, Any] | None:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens`` (prefix reused)."""
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_completion(a: Answer) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    return {
        "id": a.id,
        "object": "chat.completion",
        "created": a.created,
        "model": a.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": a.text},
                "logprobs": None,
                "finish_reason": a.finish_reason,
            }
        ],
        "usage": usage_dict(a.usage),
    }


def text_completion(a: Answer) -> dict[str, Any]:
    """A ``text_completion`` object."""
    return {
        "id": a.id,
        "object": "text_completion",
        "created": a.created,
        "model": a.model,
        "choices": [
            {"index": 0, "text": a.text, "logprobs": None, "finish_reason": a.finish_reason}
        ],
        "usage": usage_dict(a.usage),
    }


@attrs.frozen
class ChunkHead:
    """What every chunk of one streamed answer repeats."""

    id: str
    model: str
    created: int
    include_usage: bool


def chat_chunk(
    head: ChunkHead, delta: dict[str, Any], finish_reason: str | None = None
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` with one choice; ``usage: null`` when usage is requested."""
    out: dict[str, Any] = {
        "id": head.id,
        "object": "chat.completion.chunk",
        "created": head.created,
        "model": head.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if head.include_usage:
        out["usage"] = None
    return out


def text_chunk(head: ChunkHead, text: str, finish_reason: str | None = None) -> dict[str, Any]:
    """A streamed ``text_completion`` object with one choice."""
    out: dict[str, Any] = {
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if head.include_usage:
        out["usage"] = None
    return out


def usage_chunk(head: ChunkHead, usage: UsageLike, chat: bool) -> dict[str, Any]:
    """The last data chunk when ``stream_options.include_usage``: empty choices, usage."""
    return {
        "id": head.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [],
        "usage": usage_dict(usage),
    }


def model_card(name: str, context_length: int, source: str, created: int) -> dict[str, Any]:
    """One entry of ``GET /v1/models``; ``context_length`` and ``max_model_len`` (vLLM's
    name) are extensions, in tokens."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "talaria",
        "context_length": context_length,
        "max_model_len": context_length,
        "source": source,
    }


# --- what the server needs from the in-process API (``talaria.api.Talaria``) -----------------


class ChunkLike(Protocol):
    """One streamed piece of an answer (``talaria.api.ChatChunk``): ``finish_reason`` and
    ``usage`` are set on the last chunk only."""

    @property
    def id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def usage(self) -> UsageLike | None: ...
    @property
    def instance(self) -> str: ...
    @property
    def session_id(self) -> str: ...
    @property
    def created(self) -> int: ...


class ModelInfoLike(Protocol):
    """A served model (``talaria.api.ModelInfo``); ``context_length`` in tokens."""

    @property
    def name(self) -> str: ...
    @property
    def context_length(self) -> int: ...
    @property
    def source(self) -> str: ...
    @property
    def created(self) -> int: ...


class SummaryLike(Protocol):
    """An ended session (``talaria.api.SessionSummary``); ``sct_s`` in seconds."""

    @property
    def session_id(self) -> str: ...
    @property
    def sct_s(self) -> float: ...
    @property
    def calls(self) -> int: ...


class Backend(Protocol):
    """The part of ``talaria.api.Talaria`` the server uses. Streams raise ``TalariaError``
    (from the call or from the iterator); ``models`` and ``stats`` do no I/O."""

    def chat_stream(
        self,
        messages: list[dict[str, Any]],
        model: str,
        *,
        session_id: str | None = ...,
        max_tokens: int | None = ...,
        temperature: float = ...,
        top_p: float = ...,
        top_k: int = ...,
        seed: int | None = ...,
        stop: str | list[str] | None = ...,
        tenant: str = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
    ) -> AsyncIterator[ChunkLike]: ...

    def complete_stream(
        self,
        prompt: str,
        model: str,
        *,
        session_id: str | None = ...,
        max_tokens: int | None = ...,
        temperature: float = ...,
        top_p: float = ...,
        top_k: int = ...,
        seed: int | None = ...,
        stop: str | list[str] | None = ...,
        tenant: str = ...,
    ) -> AsyncIterator[ChunkLike]: ...

    async def event(
        self,
        session_id: str,
        event: str,
        *,
        tool: str | None = ...,
        expected_s: float | None = ...,
        measured_s: float | None = ...,
        tenant: str = ...,
    ) -> SummaryLike | None: ...

    def models(self) -> Sequence[ModelInfoLike]: ...

    def stats(self) -> Mapping[str, Any]: ...

    async def integrity_problems(self) -> list[str]: ...
