"""``POST /v1/responses``: OpenAI's Responses API (what Codex CLI speaks), translated onto
the chat machinery of ``/v1/chat/completions``.

Stateless, as Codex uses it (``store: false``, the whole history in ``input`` each turn):
the request's ``instructions`` and ``input`` items become chat messages, its tools chat
tools, and the call runs through the backend's ``chat_stream`` exactly as a chat completion
does (same template, tool parsers, prefix cache and sessions). The answer is shaped as a
``response`` object, whole or as the Responses API's server-sent events, by
``talaria.server.responses_stream``.

Input items: messages (role ``user``, ``assistant``, ``system`` or ``developer``; content a
string or ``input_text`` / ``output_text`` parts, joined), ``function_call`` items (an
assistant message's ``tool_calls``; calls right after an assistant message join it) and
``function_call_output`` items (a ``tool`` message; its ``call_id`` must name a
``function_call`` earlier in ``input``, else a 400). ``reasoning`` items are dropped (the
served models do not reason, and an encrypted reasoning item cannot be read anyway). A
string ``input`` is one user message; ``instructions`` is a system message placed first.

Tools: ``function`` tools (``name``, ``description``, ``parameters``; ``strict`` is
accepted but arguments are checked to be a JSON object, not against the schema) and
``namespace`` tools (``{"type": "namespace", "name", "description", "tools": [...]}``, as
the ``openai`` SDK's ``NamespaceTool`` and Codex send them): each nested function is shown
to the model as ``NAMESPACE.NAME`` (at most 64 characters, as any function name) and its
calls come back as ``function_call`` items with ``name`` NAME and ``namespace`` NAMESPACE
(a history item with ``namespace`` is rendered the same way). Hosted tools
(``web_search``, ``web_search_preview``, ``file_search``, ``local_shell``,
``code_interpreter``, ``image_generation``, ``tool_search``) and ``custom`` (free-form)
tools are accepted and never shown to the model nor called; any other tool type is a 400.

Fields: honoured ``model``, ``input``, ``instructions``, ``tools``, ``tool_choice``
(``auto``, ``none``, ``required``, ``{"type": "function", "name"}``, the name a top-level
function's, or a namespaced function's NAME or NAMESPACE.NAME), ``parallel_tool_calls``,
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``text.format``
(``json_object`` / ``json_schema``: decoding constrained to the schema), ``prompt_cache_key``
(the session, when no session header is sent; see
:func:`talaria.server.session_ids.session_of`).
Accepted and ignored (echoed where the response has them): ``store`` (nothing is stored,
whatever its value; the response says ``store: false``), ``include``, ``reasoning``,
``text.verbosity``, ``client_metadata``, ``metadata``, ``user``, ``safety_identifier``.
Refused with a 400: ``previous_response_id`` (no stored responses: send the whole history),
and the fields of :data:`UNHONOURED` sent with a value that changes something. Unknown
fields are ignored and named in ``X-Talaria-Ignored-Fields``.
"""

from __future__ import annotations

import logging
import types
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any, Literal

import attrs
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from talaria.api.results import ChatChunk
from talaria.generation import SamplingParams
from talaria.grammar import Grammar
from talaria.server import handling, responses_stream, streaming
from talaria.server import requests as req
from talaria.server.errors import bad_request
from talaria.server.responses_stream import FunctionName, ResponseHead
from talaria.server.session_ids import session_of

log = logging.getLogger(__name__)

_NULL: tuple[object, ...] = (None,)
# Responses API fields this server does not honour, each with the values that change
# nothing (accepted); any other value is a 400 naming the field.
UNHONOURED: Mapping[str, tuple[object, ...]] = types.MappingProxyType(
    {
        "background": (None, False),
        "conversation": _NULL,
        "prompt": _NULL,
        "top_logprobs": (None, 0),
        "truncation": (None, "disabled"),
        "max_tool_calls": _NULL,
        "service_tier": (None, "auto", "default"),
        "stream_options": (None, ()),
    }
)
# Accepted, known and without effect (not reported as ignored unknown fields).
_KNOWN_IGNORED = frozenset({"safety_identifier"})


class _Item(req.StrictModel):
    """Base of the input items and tools: unknown fields (``id``, ``status``, ...) are
    ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Item):
    """A text part of a message's content (or of a function call's output)."""

    type: Literal["input_text", "output_text"]
    text: str


def _joined(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(_Item):
    """A message of the history; ``type`` may be left out, as OpenAI allows."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def add_to(self, out: list[dict[str, Any]], calls: set[str], index: int) -> None:
        """Append the chat message: the role and the content's text."""
        out.append({"role": self.role, "content": _joined(self.content)})


class FunctionCallItem(_Item):
    """A call the model made earlier (``function_call``)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1)
    arguments: str
    namespace: str | None = Field(default=None, min_length=1)

    def add_to(self, out: list[dict[str, Any]], calls: set[str], index: int) -> None:
        """Add the call to the assistant message just before it, or to a new one."""
        name = FunctionName(self.namespace, self.name).exposed
        call = {
            "id": self.call_id,
            "type": "function",
            "function": {"name": name, "arguments": self.arguments},
        }
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant":
            last["tool_calls"] = [*last.get("tool_calls", ()), call]
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        calls.add(self.call_id)


class FunctionCallOutputItem(_Item):
    """A tool's result (``function_call_output``) for an earlier ``function_call``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart]

    def add_to(self, out: list[dict[str, Any]], calls: set[str], index: int) -> None:
        """Append a ``tool`` message; raises ``HttpError`` (400) when no earlier
        ``function_call`` in the input has this ``call_id``."""
        if self.call_id not in calls:
            raise bad_request(
                f"input[{index}] is the output of call {self.call_id[:80]!r}, but no "
                "function_call before it in input has that call_id; send the whole history "
                "(this server stores no responses).",
                f"input.{index}.call_id",
                code="unknown_call_id",
            )
        out.append({"role": "tool", "tool_call_id": self.call_id, "content": _joined(self.output)})


class ReasoningItem(_Item):
    """A reasoning item of an earlier answer: dropped."""

    type: Literal["reasoning"]

    def add_to(self, out: list[dict[str, Any]], calls: set[str], index: int) -> None:
        """Nothing: reasoning items are not shown to the model."""


def _item_type(raw: object) -> str | None:
    """The tag of an input item: its ``type``, ``message`` when left out."""
    if isinstance(raw, dict):
        kind = raw.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(raw, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Item):
    """A ``function`` tool, top-level or in a namespace."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self, exposed: str) -> dict[str, Any]:
        """The chat tool named ``exposed`` (``strict`` left out: not enforced)."""
        function: dict[str, Any] = {"name": exposed}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def functions(self) -> list[tuple[FunctionName, FunctionTool]]:
        """The functions the model is shown: this one."""
        return [(FunctionName(None, self.name), self)]


class CustomTool(_Item):
    """A free-form ``custom`` tool: accepted, never shown to the model nor called."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: Literal["custom"]

    def functions(self) -> list[tuple[FunctionName, FunctionTool]]:
        """None: custom tools take free text, which the tool parsers do not read."""
        return []


class NamespaceTool(_Item):
    """Functions grouped under a namespace (the ``openai`` SDK's ``NamespaceTool``)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]]

    def functions(self) -> list[tuple[FunctionName, FunctionTool]]:
        """Each nested function, named within this namespace."""
        return [
            (FunctionName(self.name, t.name), t) for t in self.tools if isinstance(t, FunctionTool)
        ]


class HostedTool(_Item):
    """A tool OpenAI runs on its side: accepted, never shown to the model nor called."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: Literal[
        "web_search",
        "web_search_preview",
        "file_search",
        "local_shell",
        "code_interpreter",
        "image_generation",
        "tool_search",
    ]

    def functions(self) -> list[tuple[FunctionName, FunctionTool]]:
        """None: this server runs no hosted tool."""
        return []


Tool = Annotated[
    FunctionTool | NamespaceTool | CustomTool | HostedTool, Field(discriminator="type")
]


class FunctionChoice(_Item):
    """``tool_choice: {"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Item):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (its ``schema``; the
    answer is decoded under it, so ``strict`` changes nothing)."""

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Item):
    """``text``: the output's format and (ignored) verbosity."""

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(req.StrictModel):
    """``POST /v1/responses`` (see the module docstring for what each field does)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str = Field(min_length=1)
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    text: TextConfig | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_message(cls, data: Any) -> Any:
        """A string ``input`` is one user message."""
        if isinstance(data, dict) and isinstance(data.get("input"), str):
            return {**data, "input": [{"role": "user", "content": data["input"]}]}
        return data

    def grammar(self) -> Grammar | None:
        """``text.format`` as the grammar the answer is decoded under (None for text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return None
        spec = {"schema": fmt.schema_} if fmt.schema_ is not None else None
        return req.response_format_grammar(fmt.type, spec, "text.format")

    def check(self) -> None:
        """Refuse what this server cannot honour (see the module docstring). Raises
        ``HttpError`` (400) naming the field."""
        if self.previous_response_id is not None:
            raise bad_request(
                "previous_response_id is not supported: this server stores no responses "
                "(store is ignored). Send the whole conversation in input, with store: false.",
                "previous_response_id",
                code="previous_response_not_supported",
            )
        self.grammar()  # a 400 for a schema the grammar library refuses
        for name, value in (self.model_extra or {}).items():
            accepted = UNHONOURED.get(name)
            if accepted is not None and not req.neutral(value, accepted):
                raise bad_request(f"{name} is not supported by this server; leave it out.", name)
        unknown = self.unknown_fields()
        if unknown:
            log.warning("ignored unknown request fields: %s", ", ".join(unknown)[:500])

    def unknown_fields(self) -> list[str]:
        """Fields sent that this server neither honours nor knows (ignored), sorted."""
        known = UNHONOURED.keys() | _KNOWN_IGNORED
        return sorted(k for k in (self.model_extra or {}) if k not in known)

    def echo(self) -> dict[str, Any]:
        """The request's fields a ``response`` object repeats."""
        choice = self.tool_choice or "auto"
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None,
            "prompt_cache_key": self.prompt_cache_key,
            "reasoning": self.reasoning or {"effort": None, "summary": None},
            "store": False,
            "temperature": self.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
            "top_p": self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }


@attrs.frozen
class ChatCall:
    """A Responses request as the chat machinery takes it: messages, tools (None without
    function tools), tool choice and the model-facing name of each function."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool
    names: Mapping[str, FunctionName]


def to_chat(body: ResponsesRequest) -> ChatCall:
    """Translate ``body`` (see the module docstring). Raises ``HttpError`` (400) for a
    ``function_call_output`` without its call."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    calls: set[str] = set()
    for i, item in enumerate(body.input):
        item.add_to(messages, calls, i)
    names: dict[str, FunctionName] = {}
    tools: list[dict[str, Any]] = []
    for tool in body.tools or ():
        for name, function in tool.functions():
            names[name.exposed] = name
            tools.append(function.chat_tool(name.exposed))
    choice = body.tool_choice
    chat_choice: str | dict[str, Any] | None
    if isinstance(choice, FunctionChoice):
        nested = (k for k, v in names.items() if v.name == choice.name)
        exposed = choice.name if choice.name in names else next(nested, choice.name)
        chat_choice = {"type": "function", "function": {"name": exposed}}
    else:
        chat_choice = choice
    return ChatCall(messages, tools or None, chat_choice, body.parallel_tool_calls, names)


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``: one call through the chat machinery, answered as a
    ``response`` object or, with ``stream: true``, as the Responses API's events."""
    body = await handling.parse(request, ResponsesRequest)
    handling.require_model(request, body.model)
    request.state.talaria_model = body.model
    request.state.talaria_ignored = body.unknown_fields()
    call = to_chat(body)
    session = session_of(request.headers, prompt_cache_key=body.prompt_cache_key)
    backend = handling.context(request).backend
    tenant = handling.tenant(request)

    def open_stream() -> AsyncIterator[ChatChunk]:
        return backend.chat_stream(
            call.messages,
            body.model,
            tools=call.tools,
            tool_choice=call.tool_choice,
            parallel_tool_calls=call.parallel_tool_calls,
            session_id=session,
            tenant=tenant,
            params=SamplingParams(
                temperature=body.temperature,
                top_p=body.top_p,
                max_tokens=body.max_output_tokens,
                grammar=body.grammar(),
            ),
        )

    first, stream = await handling.first_chunk(request, open_stream, body.model)
    headers = handling.answer_headers(request, first)
    head = _head(first, body, call)
    if body.stream:
        events = responses_stream.sse(request, first, stream, head)
        headers["Cache-Control"] = "no-cache"
        return streaming.SameTaskStream(events, media_type="text/event-stream", headers=headers)
    return JSONResponse(await responses_stream.whole(first, stream, head), headers=headers)


def _head(first: ChatChunk, body: ResponsesRequest, call: ChatCall) -> ResponseHead:
    """What the response repeats: its id (``resp_`` and the call's id), creation time,
    model, the request's echoed fields and the functions' names."""
    suffix = first.id.rsplit("-", 1)[-1]
    return ResponseHead(f"resp_{suffix}", first.created, first.model, body.echo(), call.names)
