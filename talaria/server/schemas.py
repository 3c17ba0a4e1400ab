"""Request schemas (pydantic, strict) and response shapes (plain dicts) of the OpenAI API.

Requests are validated strictly: a string where a number belongs is an error, not coerced
(``"0.5"`` for ``temperature`` is rejected; ``1`` for a float is fine).

Which fields do what, on chat and text completions:

- honoured: OpenAI's ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
  ``seed``, ``stop``, ``stream`` / ``stream_options.include_usage``, ``n`` (up to
  :data:`MAX_N` choices; the session continues from choice 0), ``presence_penalty``,
  ``frequency_penalty``, ``logprobs`` / ``top_logprobs`` (chat) and ``logprobs: int`` (text
  completions), ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (calls in
  ``message.tool_calls``, see ``talaria.api.tool_choice``), ``user`` (logged); vLLM's
  ``top_k``, ``min_tokens``,
  ``ignore_eos``, ``repetition_penalty``, ``stop_token_ids`` and ``session_id``.
- known but not honoured: the fields of :data:`UNHONOURED` (OpenAI's and vLLM's), and
  ``logit_bias``, ``response_format`` other than ``text`` (JSON mode needs decoding
  constrained by a grammar over the vocabulary, which Talaria does not have; it does not
  fake it by prompting), ``stream_options.continuous_usage_stats``, and ``echo`` /
  ``suffix`` / ``best_of`` > 1 on text completions. Sent with a value that changes
  nothing (their default: ``null``, ``false``, ``best_of: 1``, ...) they are accepted;
  any other value is a 400 naming the field, so a client never silently loses an option.
- unknown fields (neither of the above) are ignored, as vLLM and the other OpenAI-compatible
  servers do, so clients that send extra options keep working; the server logs a warning
  naming them and answers with the header ``X-Talaria-Ignored-Fields`` listing them.
"""

from __future__ import annotations

import logging
import types
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal, Protocol

import attrs
from pydantic import BaseModel, ConfigDict, Field

from talaria.errors import BadRequest
from talaria.server.errors import HttpError, bad_request
from talaria.session import ids

log = logging.getLogger(__name__)

MAX_STOP = 16  # stop strings per request
MAX_N = 16  # choices per request (``n``; the in-process API's MAX_CHOICES)
MAX_LOGPROBS = 20  # top_logprobs per token (vLLM's default bound)
MAX_STOP_TOKEN_IDS = 256
_NULL: tuple[object, ...] = (None,)
# Known OpenAI / vLLM request fields this server does not honour, each with the values that
# change nothing (accepted); any other value is refused with a 400 naming the field.
UNHONOURED: Mapping[str, tuple[object, ...]] = types.MappingProxyType(
    {
        # vLLM sampling extensions
        "min_p": (None, 0, 0.0),
        "use_beam_search": (None, False),
        "length_penalty": (None, 1, 1.0),
        "include_stop_str_in_output": (None, False),
        "skip_special_tokens": (None, True),
        "spaces_between_special_tokens": (None, True),
        "truncate_prompt_tokens": _NULL,
        "prompt_logprobs": _NULL,
        "allowed_token_ids": _NULL,
        "bad_words": (None, ()),
        "logits_processors": _NULL,
        "return_tokens_as_token_ids": (None, False),
        "return_token_ids": (None, False),
        # vLLM structured output
        "guided_json": _NULL,
        "guided_regex": _NULL,
        "guided_choice": _NULL,
        "guided_grammar": _NULL,
        "guided_decoding_backend": _NULL,
        "guided_whitespace_pattern": _NULL,
        "structural_tag": _NULL,
        "structured_outputs": _NULL,
        # vLLM prompt and engine options
        "add_generation_prompt": (None, True),
        "continue_final_message": (None, False),
        "add_special_tokens": (None, False),
        "chat_template": _NULL,
        "chat_template_kwargs": (None, ()),
        "documents": _NULL,
        "mm_processor_kwargs": _NULL,
        "priority": (None, 0),
        "request_id": _NULL,
        "cache_salt": _NULL,
        "kv_transfer_params": _NULL,
        "vllm_xargs": _NULL,
        # OpenAI
        "store": (None, False),
        "metadata": _NULL,
        "modalities": (None, ("text",)),
        "audio": _NULL,
        "prediction": _NULL,
        "service_tier": (None, "auto", "default"),
        "web_search_options": _NULL,
        "functions": _NULL,
        "function_call": _NULL,
        "reasoning_effort": _NULL,
        "verbosity": _NULL,
        "prompt_cache_key": _NULL,
        "safety_identifier": _NULL,
    }
)


def _neutral(value: object, accepted: tuple[object, ...]) -> bool:
    """Whether ``value`` (parsed JSON) is one of ``accepted``: lists compare as tuples, an
    empty object as ``()``, and booleans only with booleans (``0`` is not ``false``)."""
    if isinstance(value, list):
        value = tuple(value)
    elif isinstance(value, dict) and not value:
        value = ()
    return any(type(value) is type(a) and value == a for a in accepted if a is not None) or (
        value is None and None in accepted
    )


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class StrictModel(BaseModel):
    """Base of the request schemas: strict types, no NaN or infinity, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and empty choices."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: false accepted, true refused


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
    """Fields common to chat and text completions (see the module docstring for which are
    honoured). Extra fields are kept (``model_extra``) for :meth:`check` to judge."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extension; 0 and -1 both mean "off"
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    user: str | None = None
    session_id: str | None = None  # extension; the X-Session-ID header is the other way
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)

    def check(self) -> None:
        """Reject valid-looking options Talaria cannot honour (see the module docstring).
        Raises ``HttpError`` (400) naming the field; logs the unknown fields it ignores."""
        for name, value in (self.model_extra or {}).items():
            accepted = UNHONOURED.get(name)
            if accepted is not None and not _neutral(value, accepted):
                raise bad_request(
                    f"{name} is not supported by this server; leave it out.",
                    name,
                )
        unknown = self.unknown_fields()
        if unknown:
            log.warning("ignored unknown request fields: %s", ", ".join(unknown)[:500])
        if self.logit_bias:
            raise bad_request("logit_bias is not supported; leave it out.", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true.", "stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise bad_request(
                "stream_options.continuous_usage_stats is not supported; usage comes in the "
                "last chunk (include_usage).",
                "stream_options.continuous_usage_stats",
            )
        if any(i < 0 for i in self.stop_token_ids or ()):
            raise bad_request("stop_token_ids must be non-negative token ids.", "stop_token_ids")
        limit = self.output_cap()
        if limit is not None and self.min_tokens > limit:
            raise bad_request(
                f"min_tokens ({self.min_tokens}) must not exceed the output cap ({limit}).",
                "min_tokens",
            )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise bad_request(
                f"stop takes at most {MAX_STOP} non-empty strings, got {stops!r:.200}.", "stop"
            )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def unknown_fields(self) -> list[str]:
        """Fields sent that this server neither honours nor knows (ignored), sorted."""
        return sorted(k for k in (self.model_extra or {}) if k not in UNHONOURED)

    def output_cap(self) -> int | None:
        """The output cap in tokens the request sends (None: the server's default)."""
        return self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        """Top alternatives per token to report (None: no logprobs)."""
        return None

    def sampling_args(self) -> dict[str, Any]:
        """The sampling keyword arguments of the in-process API's calls."""
        return {
            "temperature": self.temperature,  # below GREEDY_BELOW the engine samples greedily
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logprobs": self.top_logprobs_asked(),
            "n": self.n,
        }


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` go to the in-process API, which shows the tools to the model
    and reads its calls into ``message.tool_calls`` (``talaria.api.tool_choice``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        """As :meth:`SamplingFields.check`, plus the chat-only options."""
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise bad_request(
                f"response_format {kind!r} is not supported: JSON output needs decoding "
                "constrained by a grammar over the vocabulary, which this server does not "
                "implement (and it does not fake it by prompting); send {'type': 'text'} or "
                "leave it out.",
                "response_format",
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

    def output_cap(self) -> int | None:
        return self.new_tokens()

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def api_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the in-process API."""
        return [m.to_api(i) for i, m in enumerate(self.messages)]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a raw prompt, no chat template: a text, or token ids (as
    OpenAI and vLLM take them: a list of ids, or a list holding one such list)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def check(self) -> None:
        """As :meth:`SamplingFields.check`, plus the completion-only options."""
        super().check()
        p = self.prompt
        ids = isinstance(p, list) and bool(p) and all(isinstance(t, int) for t in p)
        if isinstance(p, list) and not ids and len(p) != 1:
            raise bad_request(
                f"prompt holds {len(p)} prompts; send one prompt per request.", "prompt"
            )
        value = self.prompt_value()
        if not isinstance(value, str) and any(t < 0 for t in value):
            raise bad_request("prompt token ids must be non-negative.", "prompt")
        if self.echo:
            raise bad_request("echo is not supported; leave it out.", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported; leave it out.", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported; leave it out or send 1.", "best_of")

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_value(self) -> str | list[int]:
        """The single prompt: its text or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p
        first = p[0]
        if isinstance(first, int):
            return [t for t in p if isinstance(t, int)]
        return first


class EventRequest(StrictModel):
    """``POST /v1/sessions/{id}/events``: a tool-gap hint or the end of a session."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    event: Literal["tool_start", "tool_end", "end"]
    tool: str | None = Field(default=None, min_length=1, max_length=200)
    expected_s: float | None = Field(default=None, ge=0.0)
    measured_s: float | None = Field(default=None, ge=0.0)


class TokenizeRequest(StrictModel):
    """``POST /tokenize`` as vLLM serves it: ``prompt`` (a text; ``add_special_tokens``
    defaults to true) or ``messages`` (rendered by the chat template, with the generation
    prompt unless ``add_generation_prompt`` is false; ``add_special_tokens`` defaults to
    false), and ``return_token_strs``. ``model`` may be left out when one model is served.
    Other fields (``chat_template``, ``continue_final_message``, ...) are refused."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str | None = Field(default=None, min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None

    def check(self) -> None:
        """Exactly one of ``prompt`` and ``messages``. Raises ``HttpError`` (400)."""
        if (self.prompt is None) == (self.messages is None):
            raise bad_request(
                "send exactly one of prompt (a text) and messages (a conversation).", "prompt"
            )
        if self.tools is not None and self.messages is None:
            raise bad_request("tools go with messages only.", "tools")


class DetokenizeRequest(StrictModel):
    """``POST /detokenize`` as vLLM serves it: ``tokens`` (ids) to text."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str | None = Field(default=None, min_length=1)
    tokens: list[int] = Field(max_length=1_000_000)


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
class TotalUsage:
    """The usage of a request answered with several choices (what ``total_usage`` makes)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def total_usage(usages: Sequence[UsageLike]) -> UsageLike:
    """OpenAI's count for ``n`` choices: the prompt once (the first choice's prompt and
    cached tokens), the completion tokens of every choice summed."""
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages)
    return TotalUsage(first.prompt_tokens, completion, first.cached_tokens)


class TopLogprobLike(Protocol):
    """A candidate token (``talaria.api.TopLogprob``)."""

    @property
    def token(self) -> str: ...
    @property
    def logprob(self) -> float: ...
    @property
    def bytes(self) -> tuple[int, ...]: ...


class LogprobLike(TopLogprobLike, Protocol):
    """A generated token's logprob and its alternatives (``talaria.api.Logprob``)."""

    @property
    def top(self) -> Sequence[TopLogprobLike]: ...


def _logprob_entry(lp: TopLogprobLike) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.bytes)}


def chat_logprobs(entries: Sequence[LogprobLike] | None) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``
    (None when not asked for)."""
    if entries is None:
        return None
    content = [
        {**_logprob_entry(e), "top_logprobs": [_logprob_entry(t) for t in e.top]} for e in entries
    ]
    return {"content": content}


def text_logprobs(entries: Sequence[LogprobLike] | None, offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (one ``{token: logprob}`` per token) and ``text_offset`` (characters into the completion,
    from ``offset``, counting each token's text). None when not asked for."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


@attrs.frozen
class AnswerChoice:
    """One choice of a finished call."""

    index: int
    text: str
    finish_reason: str
    logprobs: tuple[LogprobLike, ...] | None = None
    tool_calls: tuple[ToolCallLike, ...] = ()


@attrs.frozen
class Answer:
    """A finished call as the server reports it (built from the API's stream)."""

    id: str
    model: str
    created: int  # unix seconds
    choices: tuple[AnswerChoice, ...]
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


def tool_call_dict(call: ToolCallLike, index: int | None = None) -> dict[str, Any]:
    """OpenAI's form of a tool call; with ``index`` (its place in the choice), the streamed
    ``delta.tool_calls`` entry (sent whole: id, name and all the arguments at once)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update(
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
    )
    return out


def chat_message(choice: AnswerChoice) -> dict[str, Any]:
    """The assistant ``message`` of a choice: ``content`` null when the answer only calls
    tools, ``tool_calls`` present when it calls some."""
    if not choice.tool_calls:
        return {"role": "assistant", "content": choice.text}
    return {
        "role": "assistant",
        "content": choice.text or None,
        "tool_calls": [tool_call_dict(c) for c in choice.tool_calls],
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
                "index": c.index,
                "message": chat_message(c),
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in a.choices
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
            {
                "index": c.index,
                "text": c.text,
                "logprobs": text_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in a.choices
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
    head: ChunkHead,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` with one choice; ``usage: null`` when usage is requested."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    out: dict[str, Any] = {
        "id": head.id,
        "object": "chat.completion.chunk",
        "created": head.created,
        "model": head.model,
        "choices": [choice],
    }
    if head.include_usage:
        out["usage"] = None
    return out


def text_chunk(
    head: ChunkHead,
    text: str,
    finish_reason: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streamed ``text_completion`` object with one choice."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    out: dict[str, Any] = {
        "id": head.id,
        "object": "text_completion",
        "created": head.created,
        "model": head.model,
        "choices": [choice],
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


class ToolCallLike(Protocol):
    """A tool call the model wrote (``talaria.api.ToolCall``); ``arguments`` is JSON text."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def arguments(self) -> str: ...


class ChunkLike(Protocol):
    """One streamed piece of an answer (``talaria.api.ChatChunk``): ``finish_reason`` and
    ``usage`` are set on the last chunk of each choice (``index``; ``n`` > 1 interleaves
    them) only; ``logprobs`` (None unless asked for) has one entry per token of the chunk;
    ``tool_calls`` are whole calls, numbered within the choice from ``first_call``."""

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
    @property
    def index(self) -> int: ...
    @property
    def logprobs(self) -> Sequence[LogprobLike] | None: ...
    @property
    def tool_calls(self) -> Sequence[ToolCallLike]: ...
    @property
    def first_call(self) -> int: ...


class TokenizedLike(Protocol):
    """A tokenization (``talaria.api.Tokenized``); ``max_model_len`` in tokens."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def token_strs(self) -> Sequence[str]: ...
    @property
    def max_model_len(self) -> int: ...


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
        stop_token_ids: Sequence[int] = ...,
        ignore_eos: bool = ...,
        min_tokens: int = ...,
        repetition_penalty: float = ...,
        presence_penalty: float = ...,
        frequency_penalty: float = ...,
        logprobs: int | None = ...,
        n: int = ...,
        tenant: str = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        parallel_tool_calls: bool | None = ...,
    ) -> AsyncIterator[ChunkLike]: ...

    def complete_stream(
        self,
        prompt: str | Sequence[int],
        model: str,
        *,
        session_id: str | None = ...,
        max_tokens: int | None = ...,
        temperature: float = ...,
        top_p: float = ...,
        top_k: int = ...,
        seed: int | None = ...,
        stop: str | list[str] | None = ...,
        stop_token_ids: Sequence[int] = ...,
        ignore_eos: bool = ...,
        min_tokens: int = ...,
        repetition_penalty: float = ...,
        presence_penalty: float = ...,
        frequency_penalty: float = ...,
        logprobs: int | None = ...,
        n: int = ...,
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

    def tokenize(
        self,
        model: str,
        *,
        prompt: str | None = ...,
        messages: Sequence[Mapping[str, Any]] | None = ...,
        add_special_tokens: bool | None = ...,
        add_generation_prompt: bool = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
    ) -> TokenizedLike: ...

    def detokenize(self, model: str, token_ids: Sequence[int]) -> str: ...

    def models(self) -> Sequence[ModelInfoLike]: ...

    def stats(self) -> Mapping[str, Any]: ...

    async def integrity_problems(self) -> list[str]: ...
