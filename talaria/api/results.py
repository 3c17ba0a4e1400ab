"""What the in-process API returns: answers (``ChatResult``, one ``Choice`` per sample),
streamed pieces (``ChatChunk``), their token counts (``Usage``), per-token log-probabilities
(``Logprob``, ``TopLogprob``), tokenizations (``Tokenized``) and served models
(``ModelInfo``), and the tool calls models write (``ToolCall``).

Plain frozen data made by ``talaria.api.talaria.Talaria``; the HTTP server reads them through
``talaria.server.responses``, through the protocol of ``talaria.server.backend``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from talaria.generation import TokenLogprob


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def of_choices(cls, usages: tuple[Usage, ...]) -> Usage:
        """The usage of one request answered with several choices, as OpenAI counts it: the
        prompt once (the first choice's prompt and cached tokens), completions summed."""
        first = usages[0]
        completion = sum(u.completion_tokens for u in usages)
        return cls(first.prompt_tokens, completion, first.cached_tokens)


@attrs.frozen
class TopLogprob:
    """One candidate token: its text (``bytes`` decoded, U+FFFD for part of a character),
    id, natural-log probability and raw bytes."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...]


@attrs.frozen
class Logprob:
    """A generated token's log-probability and the most likely alternatives at its place
    (``top``, most likely first), under the model's raw distribution."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TopLogprob, ...] = ()

    @classmethod
    def of(cls, tok: TokenText, entries: Sequence[TokenLogprob]) -> tuple[Logprob, ...]:
        """The API's form of an executor's logprobs: each id with its text and bytes."""

        def top(token_id: int, logprob: float) -> TopLogprob:
            raw = tok.token_bytes(token_id) if token_id < tok.vocab_size else b""
            return TopLogprob(raw.decode("utf-8", "replace"), token_id, logprob, tuple(raw))

        out = []
        for e in entries:
            head = top(e.token_id, e.logprob)
            alts = tuple(top(i, lp) for i, lp in e.top)
            out.append(cls(head.token, e.token_id, e.logprob, head.bytes, alts))
        return tuple(out)


class TokenText(Protocol):
    """What ``Logprob.of`` reads of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def token_bytes(self, token_id: int) -> bytes: ...


@attrs.frozen
class ToolCall:
    """A call of one of the request's tools that the model wrote (``talaria.api.tool_parsers``
    read it): an id (``call_`` + 24 hex digits), the tool's ``name`` and its ``arguments``
    as the JSON text of an object (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str


@attrs.frozen
class Choice:
    """One sample of an answer (``n`` > 1 gives several). ``usage`` is its own: its prompt
    and cached tokens (choices after the first find the prompt's full blocks cached) and its
    completion tokens. ``logprobs`` is None unless asked for, else one per generated id.
    With tools, ``text`` is the answer's content without its tool calls, which are in
    ``tool_calls`` (``finish_reason`` "tool_calls"); ``token_ids`` are all generated ids.
    ``stop_sequence`` is the stop string that ended it (None: another reason)."""

    index: int
    text: str
    finish_reason: str
    token_ids: tuple[int, ...]
    usage: Usage
    logprobs: tuple[Logprob, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    stop_sequence: str | None = None


@attrs.frozen
class ChatResult:
    """A whole answer. ``finish_reason`` is "stop" (end token or stop string) or "length".
    The top-level ``text``, ``finish_reason``, ``token_ids`` and ``logprobs`` are the first
    choice's, and so are ``tool_calls`` (``finish_reason`` "tool_calls" when there are
    some); ``choices`` holds every choice (one unless ``n`` > 1); ``usage`` counts the
    request (``Usage.of_choices``). ``max_tokens_clamped`` is the output cap granted when
    the ``max_tokens`` asked for did not fit the context beside the prompt (None: granted as
    asked; see ``TalariaConfig.strict_max_tokens``)."""

    id: str
    model: str
    text: str
    finish_reason: str
    usage: Usage
    instance: str
    session_id: str
    created: int
    token_ids: tuple[int, ...] = ()
    ttft_s: float = 0.0
    choices: tuple[Choice, ...] = ()
    logprobs: tuple[Logprob, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    stop_sequence: str | None = None
    max_tokens_clamped: int | None = None


@attrs.frozen
class ChatChunk:
    """A piece of a streamed answer; ``finish_reason`` and ``usage`` only on the last of its
    choice (``index``; with ``n`` > 1 the choices' chunks interleave and each last chunk
    carries that choice's own usage). ``logprobs`` (when asked for) has one entry per id of
    ``token_ids``. With tools, ``text`` is content only and a chunk may carry tool calls
    instead (each whole, once the model closed it), numbered within the choice from
    ``first_call``. Every chunk carries ``prompt_tokens`` (the prompt's length) and
    ``max_tokens_clamped`` (as ``ChatResult``'s); the last of a choice its
    ``stop_sequence`` (the stop string that ended it, if one did)."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    instance: str
    session_id: str
    created: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Logprob, ...] | None = None
    index: int = 0
    tool_calls: tuple[ToolCall, ...] = ()
    first_call: int = 0
    prompt_tokens: int = 0
    max_tokens_clamped: int | None = None
    stop_sequence: str | None = None


@attrs.frozen
class Tokenized:
    """A text or conversation as ``model`` sees it: its ids, the vocabulary's string of each
    (byte-level BPE's own spelling, ``Ġ`` for a space) and the model's context length."""

    token_ids: tuple[int, ...]
    token_strs: tuple[str, ...]
    max_model_len: int


@attrs.frozen
class ModelInfo:
    name: str
    context_length: int
    source: str
    created: int
