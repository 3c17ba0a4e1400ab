"""LangChain messages to OpenAI's wire format and OpenAI answers back to LangChain messages.

Pure functions (no I/O). Tool calls come from the answer's OpenAI ``tool_calls`` when the
server sends them, else (when tools were bound) from the answer's text
(:func:`integrations.parse_tool_calls`); the text itself is kept as ``content`` unchanged,
so the next prompt repeats exactly what the model generated and its KV stays reusable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, InvalidToolCall
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import (
    ToolCall,
    ToolCallChunk,
    invalid_tool_call,
    tool_call,
    tool_call_chunk,
)
from langchain_core.messages.utils import convert_to_openai_messages

from integrations import parse_tool_calls, tool_calls_as_text

__all__ = [
    "PROVIDER",
    "ai_message",
    "final_chunk",
    "openai_messages",
    "stream_tool_chunks",
    "usage_metadata",
]

PROVIDER = "talaria"


def openai_messages(messages: Sequence[BaseMessage], calls_as_text: bool) -> list[dict[str, Any]]:
    """``messages`` as OpenAI chat messages (text content as one string). With
    ``calls_as_text``, an assistant message that only calls tools also carries the calls as
    ``<tool_call>`` text (:func:`integrations.tool_calls_as_text`)."""
    converted = convert_to_openai_messages(list(messages), text_format="string")
    plain = [dict(m) for m in converted]
    return tool_calls_as_text(plain) if calls_as_text else plain


def usage_metadata(usage: Any) -> UsageMetadata | None:
    """LangChain usage from OpenAI's ``usage`` (an object or a dict);
    ``input_token_details.cache_read`` = ``prompt_tokens_details.cached_tokens``."""
    if usage is None:
        return None
    get = usage.get if isinstance(usage, Mapping) else lambda k, d=None: getattr(usage, k, d)
    prompt = int(get("prompt_tokens", 0) or 0)
    completion = int(get("completion_tokens", 0) or 0)
    details = get("prompt_tokens_details", None)
    if isinstance(details, Mapping):
        cached = details.get("cached_tokens")
    else:
        cached = getattr(details, "cached_tokens", None)
    return UsageMetadata(
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=prompt + completion,
        input_token_details=InputTokenDetails(cache_read=int(cached or 0)),
    )


def _native_calls(raw: Any) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    """OpenAI ``message.tool_calls`` as LangChain tool calls (bad JSON arguments become
    invalid tool calls)."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for tc in raw or ():
        function = getattr(tc, "function", None)
        name = getattr(function, "name", None)
        arguments = getattr(function, "arguments", None) or "{}"
        call_id = getattr(tc, "id", None)
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError as exc:
            invalid.append(invalid_tool_call(name=name, args=arguments, id=call_id, error=str(exc)))
            continue
        if not isinstance(name, str) or not isinstance(args, dict):
            invalid.append(
                invalid_tool_call(name=name, args=arguments, id=call_id, error="not an object")
            )
            continue
        calls.append(tool_call(name=name, args=args, id=call_id))
    return calls, invalid


def _text_calls(text: str, names: tuple[str, ...] | None) -> list[ToolCall]:
    if not names:
        return []
    return [
        tool_call(name=c.name, args=c.arguments, id=c.id) for c in parse_tool_calls(text, names)
    ]


def _metadata(
    model: str, finish_reason: str | None, headers: Mapping[str, str] | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "model_name": model,
        "model_provider": PROVIDER,
        "finish_reason": finish_reason,
    }
    if headers is not None:
        meta["session_id"] = headers.get("x-session-id")
        meta["talaria_instance"] = headers.get("x-talaria-instance")
    return meta


def ai_message(
    completion: Any, headers: Mapping[str, str] | None, names: tuple[str, ...] | None, parse: bool
) -> AIMessage:
    """An ``AIMessage`` from a ``ChatCompletion``: text as ``content``, tool calls (native,
    else parsed from the text when ``parse`` and tools were declared), usage, and
    ``response_metadata`` (``finish_reason``: "tool_calls" when there are calls,
    ``session_id`` and ``talaria_instance`` from the answer's headers)."""
    if not completion.choices:
        raise ValueError("the server answered without a choice")
    choice = completion.choices[0]
    text = choice.message.content or ""
    calls, invalid = _native_calls(getattr(choice.message, "tool_calls", None))
    if not calls and not invalid and parse:
        calls = _text_calls(text, names)
    finish = "tool_calls" if calls else choice.finish_reason
    return AIMessage(
        content=text,
        tool_calls=calls,
        invalid_tool_calls=invalid,
        usage_metadata=usage_metadata(completion.usage),
        response_metadata=_metadata(completion.model, finish, headers),
        id=completion.id,
    )


def stream_tool_chunks(delta_calls: Any) -> list[ToolCallChunk]:
    """OpenAI streamed ``delta.tool_calls`` as LangChain tool call chunks."""
    out: list[ToolCallChunk] = []
    for tc in delta_calls or ():
        function = getattr(tc, "function", None)
        out.append(
            tool_call_chunk(
                name=getattr(function, "name", None),
                args=getattr(function, "arguments", None),
                id=getattr(tc, "id", None),
                index=getattr(tc, "index", None),
            )
        )
    return out


def final_chunk(
    text: str,
    native: bool,
    finish_reason: str | None,
    usage: Any,
    model: str,
    names: tuple[str, ...] | None,
    parse: bool,
) -> AIMessageChunk:
    """The last chunk of a streamed answer (``chunk_position="last"``): usage, metadata,
    and, unless the server streamed tool calls itself (``native``), the tool calls parsed
    from the whole ``text``."""
    chunks: list[ToolCallChunk] = []
    if not native and parse:
        chunks = [
            tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
            for i, c in enumerate(_text_calls(text, names))
        ]
    finish = "tool_calls" if chunks or native else finish_reason
    return AIMessageChunk(
        content="",
        tool_call_chunks=chunks,
        usage_metadata=usage_metadata(usage),
        response_metadata=_metadata(model, finish, None),
        chunk_position="last",
    )
