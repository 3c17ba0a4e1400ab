"""Request schemas (pydantic, strict) of the Anthropic Messages API (``POST /v1/messages``
and ``POST /v1/messages/count_tokens``), and how a request becomes an OpenAI-style chat for
the in-process API (:meth:`MessagesRequest.chat_messages`, :meth:`MessagesRequest.chat_tools`).

Honoured: ``model``, ``messages`` (roles ``user``, ``assistant`` and ``system``, which
Claude Code sends; content a string or blocks of type ``text``, ``tool_use`` and
``tool_result``), ``system`` (a string or text blocks), ``max_tokens`` (required; clamped
to the context, see ``TalariaConfig.strict_max_tokens``), ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``stream``, ``tools`` (``name``, ``description``,
``input_schema``), ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``;
``disable_parallel_tool_use``), ``metadata.user_id`` (a session id when it names one,
``talaria.server.session_ids``) and Talaria's ``session_id``.

Accepted and ignored (each changes nothing here; ``docs/serving.md`` says why):
``cache_control`` on any block and at the top level (the prefix cache reuses every shared
prefix anyway), ``thinking`` (the served models do not think in separate blocks; earlier
``thinking`` and ``redacted_thinking`` blocks in the history are dropped),
``context_management``, ``output_config``, ``service_tier`` and ``container``. Fields
this server does not know are ignored too, and listed in the ``X-Talaria-Ignored-Fields``
header.

Refused with a 400 naming the field: ``image`` and ``document`` blocks (the served models
read text only), tools of a server-side ``type`` (web search, code execution, ...), a
``tool_result`` whose ``tool_use_id`` names no earlier ``tool_use``, and an empty
conversation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import ConfigDict, Field

from talaria.generation import SamplingParams
from talaria.server.errors import bad_request
from talaria.server.requests import MAX_STOP, StrictModel

# one line for each union-typed field's validation errors (``errors.from_validation``)
HINTS: Final[Mapping[str, str]] = {
    "content": "must be a string or a list of blocks of type text, tool_use, tool_result "
    "(thinking, image and document blocks are recognised; images and documents refused)",
    "system": "must be a string or a list of text blocks",
}
TOOL_ERROR_PREFIX = "Error: "  # how a tool_result with is_error reads to the model
# Anthropic's tool_choice types (but "tool") as OpenAI's
_CHOICES: Final[Mapping[str, str]] = {"auto": "auto", "any": "required", "none": "none"}


class _Block(StrictModel):
    """Base of the content blocks: ``cache_control`` accepted on any (and ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    cache_control: dict[str, Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    """An image or document: parsed so the refusal can say what it was (never served)."""

    type: Literal["image", "document"]


class ThinkingBlock(_Block):
    """Earlier reasoning a client sends back in the history; dropped."""

    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=200)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


Block = Annotated[
    TextBlock | ImageBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class AnthropicTool(StrictModel):
    """A client tool: its name, description and JSON Schema of its input. ``type`` is
    ``custom`` or absent; a server tool's type (``web_search_...``) is refused."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    name: str = Field(min_length=1, max_length=200)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(StrictModel):
    user_id: str | None = Field(default=None, max_length=4096)


class CountTokensRequest(StrictModel):
    """``POST /v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None

    def check(self) -> None:
        """Raise ``HttpError`` (400) for what this server cannot serve (module docstring)."""
        for i, tool in enumerate(self.tools or ()):
            if tool.type not in (None, "custom"):
                raise bad_request(
                    f"tools[{i}] is a server tool of type {tool.type!r}; this server runs "
                    "client tools only (name, description, input_schema).",
                    f"tools.{i}.type",
                )
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise bad_request('tool_choice of type "tool" needs the tool\'s name.', "tool_choice")
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise bad_request(f"tool_choice {choice.type!r} needs tools.", "tool_choice")

    def unknown_fields(self) -> list[str]:
        """Fields sent that this server does not know (ignored), sorted."""
        return sorted(self.model_extra or {})

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as the in-process API takes it (OpenAI message dicts): the
        system prompt first, then each message; ``tool_use`` blocks become the assistant's
        ``tool_calls``, ``tool_result`` blocks ``tool`` messages. Raises ``HttpError``
        (400) for refused blocks and for results of calls the conversation never made."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text_of(self.system)})
        calls: set[str] = set()
        for i, message in enumerate(self.messages):
            out.extend(_convert(message, i, calls))
        if not out:
            raise bad_request("messages holds no content.", "messages")
        return out

    def chat_tools(self) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
        """(OpenAI ``tools``, OpenAI ``tool_choice``) of the request's tools and choice."""
        if not self.tools:
            return None, None
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema or {"type": "object", "properties": {}},
                },
            }
            for t in self.tools
        ]
        return tools, _openai_choice(self.tool_choice)

    def parallel_tool_calls(self) -> bool | None:
        """False when ``tool_choice.disable_parallel_tool_use``; else the default."""
        choice = self.tool_choice
        return False if choice is not None and choice.disable_parallel_tool_use else None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` (the module docstring says what each field does here)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    session_id: str | None = None  # Talaria's extension, as on chat completions
    service_tier: str | None = None
    container: str | dict[str, Any] | None = None

    def check(self) -> None:
        """As :meth:`CountTokensRequest.check`, plus non-empty stop sequences."""
        super().check()
        if any(not s for s in self.stop_sequences or ()):
            raise bad_request("stop_sequences must be non-empty strings.", "stop_sequences")

    def sampling_params(self) -> SamplingParams:
        """The sampling parameters of the in-process API's chat call."""
        same = self.model_dump(include={"temperature", "top_p", "top_k", "max_tokens"})
        return SamplingParams(**same, stop=self.stop_sequences)  # the same names and meanings


def _text_of(value: str | list[TextBlock]) -> str:
    """A string, or text blocks joined with blank lines between them."""
    return value if isinstance(value, str) else "\n\n".join(b.text for b in value)


def _refuse(block: ImageBlock, where: str) -> None:
    raise bad_request(
        f"{where} is an {block.type!r} block; this server's models read text only (send "
        "text, tool_use and tool_result blocks).",
        where,
    )


def _check_blocks(blocks: list[Any], role: str, where: str) -> None:
    """400 for a block ``role`` may not send (tool results come in user messages, calls
    only from the assistant), or one the models cannot read (an image)."""
    wrong: type[ToolResultBlock | ToolUseBlock]
    if role == "assistant":
        wrong, why = ToolResultBlock, "a tool_result block in an assistant message; tool "
        why += "results come in user messages"
    else:
        wrong, why = ToolUseBlock, f"a tool_use block in a {role} message; only the assistant"
        why += " calls tools"
    for j, block in enumerate(blocks):
        if isinstance(block, ImageBlock):
            _refuse(block, f"{where}.{j}")
        if isinstance(block, wrong):
            raise bad_request(f"{where}.{j} is {why}.", where)


def _convert(message: AnthropicMessage, index: int, calls: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages (``calls``: the tool_use ids so far)."""
    where = f"messages.{index}.content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    _check_blocks(message.content, message.role, where)
    if message.role == "assistant":
        return [_assistant(message.content, calls)]
    out = [
        _tool_message(block, f"{where}.{j}", calls)
        for j, block in enumerate(message.content)
        if isinstance(block, ToolResultBlock)
    ]
    texts = [block.text for block in message.content if isinstance(block, TextBlock)]
    if texts:
        out.append({"role": message.role, "content": "\n\n".join(texts)})
    return out


def _assistant(blocks: list[Any], calls: set[str]) -> dict[str, Any]:
    """An assistant message: its text, and its ``tool_use`` blocks as ``tool_calls``."""
    texts = [block.text for block in blocks if isinstance(block, TextBlock)]
    tool_calls: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolUseBlock):
            calls.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            tool_calls.append({"id": block.id, "type": "function", "function": function})
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def _tool_message(block: ToolResultBlock, where: str, calls: set[str]) -> dict[str, Any]:
    """A ``tool_result`` as an OpenAI ``tool`` message; 400 when it answers no earlier
    ``tool_use`` of the conversation."""
    if block.tool_use_id not in calls:
        raise bad_request(
            f"{where}.tool_use_id ({block.tool_use_id[:80]!r}) names no tool_use block earlier "
            "in the conversation; each tool_result answers an assistant's tool_use.",
            f"{where}.tool_use_id",
        )
    if isinstance(block.content, str):
        text = block.content
    else:
        parts: list[str] = []
        for k, part in enumerate(block.content):
            if isinstance(part, ImageBlock):
                _refuse(part, f"{where}.content.{k}")
            else:
                parts.append(part.text)
        text = "\n\n".join(parts)
    if block.is_error:
        text = TOOL_ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _openai_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    """Anthropic's ``tool_choice`` as OpenAI's: auto, required (any), a named function
    (tool) or none."""
    if choice is None:
        return "auto"
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return _CHOICES[choice.type]
