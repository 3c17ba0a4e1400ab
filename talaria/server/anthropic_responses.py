"""Answers of the Anthropic Messages API, made from the in-process API's chunks
(``talaria.api.results.ChatChunk``): the whole ``message`` object and its server-sent
events (``message_start``, ``ping``, ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta``, ``message_stop``; a failure after the stream began is an ``error``
event).

One :class:`BlockBuilder` turns the chunks into content blocks as events; the whole answer
is the blocks it built, so a streamed and a whole answer of the same call have the same
content. Text is a ``text`` block (``text_delta`` events); each tool call the model wrote is
a ``tool_use`` block (its id ``toolu_`` and the call's hex digits, its arguments as one
``input_json_delta``). Usage follows Anthropic's meaning: ``input_tokens`` counts the prompt
tokens computed for this call, ``cache_read_input_tokens`` those whose KV the prefix cache
reused (their sum is the prompt), ``cache_creation_input_tokens`` is always 0 (caching is
automatic, nothing is written on request).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from talaria.api.results import ChatChunk, ToolCall, Usage

# finish reasons of the API (but "stop") as Anthropic's stop_reason
_STOP_REASONS: Final[Mapping[str, str]] = {"tool_calls": "tool_use", "length": "max_tokens"}


def message_id(chunk_id: str) -> str:
    """``msg_`` and the hex digits of the call's id (``chatcmpl-<hex>``)."""
    return "msg_" + chunk_id.rsplit("-", 1)[-1]


def tool_use_id(call: ToolCall) -> str:
    """``toolu_`` and the hex digits of the call's id (``call_<hex>``)."""
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(
    finish_reason: str | None, stop_sequence: str | None, asked: Sequence[str]
) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``): ``tool_use``, ``max_tokens``,
    ``stop_sequence`` (one of the request's ``asked`` ended it) or ``end_turn``."""
    mapped = _STOP_REASONS.get(finish_reason or "")
    if mapped is not None:
        return mapped, None
    if stop_sequence is not None and stop_sequence in asked:
        return "stop_sequence", stop_sequence
    return "end_turn", None


def usage_dict(usage: Usage | None, prompt_tokens: int = 0) -> dict[str, int]:
    """Anthropic's ``usage`` (module docstring); before the end (``usage`` None) the whole
    prompt as ``input_tokens`` and no output yet."""
    if usage is None:
        return {
            "input_tokens": prompt_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


@attrs.define
class BlockBuilder:
    """Content blocks of one answer, built chunk by chunk; each step returns the stream's
    events for it. Mutates only itself."""

    blocks: list[dict[str, Any]] = attrs.field(factory=list)
    _open_text: int | None = None  # index of the text block still open

    def feed(self, chunk: ChatChunk) -> list[dict[str, Any]]:
        """The events of one chunk: its text (opening a text block when none is open),
        then each of its tool calls as a whole ``tool_use`` block."""
        events: list[dict[str, Any]] = []
        if chunk.text:
            if self._open_text is None:
                self._open_text = len(self.blocks)
                self.blocks.append({"type": "text", "text": ""})
                events.append(_block_start(self._open_text, {"type": "text", "text": ""}))
            self.blocks[self._open_text]["text"] += chunk.text
            delta = {"type": "text_delta", "text": chunk.text}
            events.append(_block_delta(self._open_text, delta))
        for call in chunk.tool_calls:
            events.extend(self.close())
            events.extend(self._tool_use(call))
        return events

    def close(self) -> list[dict[str, Any]]:
        """Close the open text block, if any (its ``content_block_stop``)."""
        if self._open_text is None:
            return []
        index, self._open_text = self._open_text, None
        return [{"type": "content_block_stop", "index": index}]

    def _tool_use(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self.blocks)
        block = {"type": "tool_use", "id": tool_use_id(call), "name": call.name}
        self.blocks.append({**block, "input": json.loads(call.arguments)})
        partial = {"type": "input_json_delta", "partial_json": call.arguments}
        return [
            _block_start(index, {**block, "input": {}}),
            _block_delta(index, partial),
            {"type": "content_block_stop", "index": index},
        ]


def _block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _block_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def message(
    first: ChatChunk,
    model: str,
    content: list[dict[str, Any]],
    last: ChatChunk | None,
    stop_sequences: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``message`` object: whole (``last`` is the final chunk, with its usage;
    ``stop_sequences`` the request's), or as ``message_start`` sends it (``last`` None: no
    content, no stop reason yet)."""
    reason: str | None = None
    sequence: str | None = None
    if last is not None:
        reason, sequence = stop_reason(last.finish_reason, last.stop_sequence, stop_sequences)
    return {
        "id": message_id(first.id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_dict(None if last is None else last.usage, first.prompt_tokens),
    }


def message_delta(last: ChatChunk, stop_sequences: Sequence[str]) -> dict[str, Any]:
    """The ``message_delta`` event: the stop reason and the final (cumulative) usage."""
    reason, sequence = stop_reason(last.finish_reason, last.stop_sequence, stop_sequences)
    return {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": usage_dict(last.usage),
    }


def event_bytes(event: Mapping[str, Any]) -> bytes:
    """One server-sent event: ``event: <type>`` and its JSON ``data``."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
