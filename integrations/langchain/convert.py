"""LangChain messages to OpenAI's wire format and OpenAI answers back to LangChain messages.

Pure functions (no I/O). Tool calls are the answer's OpenAI ``tool_calls``: the server
reads them from the model's output (``talaria.api.tool_parsers``), and renders the history's
calls back in the model's own format, so the next prompt repeats what the model wrote and
its KV stays reusable.
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

__all__ = [
    "PROVIDER",
    "ai_message",
    "final_chunk",
    "openai_messages",
    "stream_tool_chunks",
    "usage_metadata",
]

PROVIDER = "talaria"


def openai_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """``messages`` as OpenAI chat messages (text content as one string; an assistant
    message's tool calls as ``tool_calls``)."""
    converted = convert_to_openai_messages(list(messages), text_format="string")
    return [dict(m) for m in converted]


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


def ai_message(completion: Any, headers: Mapping[str, str] | None) -> AIMessage:
    """An ``AIMessage`` from a ``ChatCompletion``: text as ``content``, the server's tool
    calls, usage, and ``response_metadata`` (``finish_reason``; ``session_id`` and
    ``talaria_instance`` from the answer's headers)."""
    if not completion.choices:
        raise ValueError("the server answered without a choice")
    choice = completion.choices[0]
    text = choice.message.content or ""
    calls, invalid = _native_calls(getattr(choice.message, "tool_calls", None))
    return AIMessage(
        content=text,
        tool_calls=calls,
        invalid_tool_calls=invalid,
        usage_metadata=usage_metadata(completion.usage),
        response_metadata=_metadata(completion.model, choice.finish_reason, headers),
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


def final_chunk(finish_reason: str | None, usage: Any, model: str) -> AIMessageChunk:
    """The last chunk of a streamed answer (``chunk_position="last"``): usage and
    metadata (the tool calls came in earlier chunks)."""
    return AIMessageChunk(
        content="",
        usage_metadata=usage_metadata(usage),
        response_metadata=_metadata(model, finish_reason, None),
        chunk_position="last",
    )
