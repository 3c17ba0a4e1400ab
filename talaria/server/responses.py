"""Response shapes of the OpenAI API (plain dicts, as OpenAI and vLLM send them), made from
the in-process API's results (``talaria.api.results``): whole answers, streamed chunks,
usage, logprobs, tool calls and model cards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from talaria.api.results import Logprob, ToolCall, TopLogprob, Usage


def _logprob_entry(lp: TopLogprob | Logprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.bytes)}


def chat_logprobs(entries: Sequence[Logprob] | None) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``
    (None when not asked for)."""
    if entries is None:
        return None
    content = [
        {**_logprob_entry(e), "top_logprobs": [_logprob_entry(t) for t in e.top]} for e in entries
    ]
    return {"content": content}


def text_logprobs(entries: Sequence[Logprob] | None, offset: int = 0) -> dict[str, Any] | None:
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
    logprobs: tuple[Logprob, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@attrs.frozen
class Answer:
    """A finished call as the server reports it (built from the API's stream)."""

    id: str
    model: str
    created: int  # unix seconds
    choices: tuple[AnswerChoice, ...]
    usage: Usage | None
    instance: str
    session_id: str


def usage_dict(usage: Usage | None) -> dict[str, Any] | None:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens`` (prefix reused)."""
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def tool_call_dict(call: ToolCall, index: int | None = None) -> dict[str, Any]:
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
    return _completion(
        a,
        "chat.completion",
        [
            {
                "index": c.index,
                "message": chat_message(c),
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in a.choices
        ],
    )


def text_completion(a: Answer) -> dict[str, Any]:
    """A ``text_completion`` object."""
    return _completion(
        a,
        "text_completion",
        [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": text_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in a.choices
        ],
    )


def _completion(a: Answer, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole answer of ``kind`` with its ``choices`` and usage."""
    return {
        "id": a.id,
        "object": kind,
        "created": a.created,
        "model": a.model,
        "choices": choices,
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
    return _chunk(head, "chat.completion.chunk", choice)


def text_chunk(
    head: ChunkHead,
    text: str,
    finish_reason: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streamed ``text_completion`` object with one choice."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _chunk(head, "text_completion", choice)


def _chunk(head: ChunkHead, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    """A streamed object of ``kind`` with one choice; ``usage: null`` when usage is
    requested (the usage chunk at the end carries it)."""
    out: dict[str, Any] = {
        "id": head.id,
        "object": kind,
        "created": head.created,
        "model": head.model,
        "choices": [choice],
    }
    if head.include_usage:
        out["usage"] = None
    return out


def usage_chunk(head: ChunkHead, usage: Usage, chat: bool) -> dict[str, Any]:
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
