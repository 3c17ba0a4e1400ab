"""Request schemas (pydantic, strict) of the OpenAI API; the answers are shaped in
``talaria.server.responses``.

Requests are validated strictly: a string where a number belongs is an error, not coerced
(``"0.5"`` for ``temperature`` is rejected; ``1`` for a float is fine).

Which fields do what, on chat and text completions:

- honoured: OpenAI's ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
  ``seed``, ``stop``, ``stream`` / ``stream_options.include_usage``, ``n`` (up to
  :data:`MAX_N` choices; the session continues from choice 0), ``presence_penalty``,
  ``frequency_penalty``, ``logprobs`` / ``top_logprobs`` (chat) and ``logprobs: int`` (text
  completions), ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (calls in
  ``message.tool_calls``, see ``talaria.api.tool_choice``), ``user`` (logged),
  ``prompt_cache_key`` (a session id, ``talaria.server.session_ids``),
  ``response_format`` (``json_object`` / ``json_schema``: decoding constrained to the
  schema, :mod:`talaria.grammar`); vLLM's ``top_k``, ``min_tokens``, ``ignore_eos``,
  ``repetition_penalty``, ``stop_token_ids`` and ``session_id``.
- known but not honoured: the fields of :data:`UNHONOURED` (OpenAI's and vLLM's), and
  ``logit_bias``, ``stream_options.continuous_usage_stats``, and ``echo`` /
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
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from talaria.errors import BadRequest
from talaria.generation import SamplingParams
from talaria.grammar import Grammar, check_grammar
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
        "safety_identifier": _NULL,
    }
)


def neutral(value: object, accepted: tuple[object, ...]) -> bool:
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
    # OpenAI's cache key (Codex sends its session there): a session id, see session_ids
    prompt_cache_key: str | None = None
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
            if accepted is not None and not neutral(value, accepted):
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

    def sampling_params(self) -> SamplingParams:
        """The call's sampling parameters for the in-process API (``max_tokens`` None: the
        server picks the cap). Raises ``BadRequest`` (a 400) for values the engine refuses."""
        return SamplingParams(
            temperature=self.temperature,  # below GREEDY_BELOW the engine samples greedily
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            max_tokens=self.output_cap(),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.top_logprobs_asked(),
            grammar=self.grammar(),
        )

    def grammar(self) -> Grammar | None:
        """The grammar the answer is decoded under (None: free text)."""
        return None


def response_format_grammar(
    kind: object, spec: object, param: str = "response_format"
) -> Grammar | None:
    """OpenAI's structured output formats as a grammar (checked by the grammar library):
    ``text`` (None), ``json_object`` (any JSON object) or ``json_schema`` with ``spec``
    holding the ``schema`` (chat's ``json_schema`` object; the Responses API's format
    itself). ``HttpError`` 400 naming ``param`` otherwise."""
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_schema({"type": "object"})
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if kind != "json_schema" or not isinstance(schema, dict):
        raise bad_request(
            f"{param} must be {{'type': 'text'}}, {{'type': 'json_object'}} or "
            "{'type': 'json_schema', ... 'schema': {...}} (a JSON schema object).",
            param,
        )
    grammar = Grammar.json_schema(schema)
    try:
        check_grammar(grammar)
    except BadRequest as exc:
        raise bad_request(f"{param}: {exc}", param) from None
    return grammar


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
        self.grammar()  # a 400 for a format the server cannot honour
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise bad_request(
                "max_tokens and max_completion_tokens disagree; send only one of them.",
                "max_completion_tokens",
            )

    def grammar(self) -> Grammar | None:
        """``response_format`` as the grammar the answer is decoded under: ``json_object``
        (any JSON object), ``json_schema`` (``json_schema.schema``; ``strict`` changes
        nothing: the answer always matches), or None for ``text``. A 400 for another type,
        a missing schema, or one the grammar library refuses."""
        fmt = self.response_format or {}
        return response_format_grammar(fmt.get("type", "text"), fmt.get("json_schema"))

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
