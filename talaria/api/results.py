"""What the in-process API returns: answers (``ChatResult``), streamed pieces
(``ChatChunk``), their token counts (``Usage``) and served models (``ModelInfo``).

Plain frozen data made by ``talaria.api.talaria.Talaria``; the HTTP server reads them through
the protocols in ``talaria.server.schemas``.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class ChatResult:
    """A whole answer. ``finish_reason`` is "stop" (end token or stop string) or "length"."""

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


@attrs.frozen
class ChatChunk:
    """A piece of a streamed answer; ``finish_reason`` and ``usage`` only on the last."""

    id: str
    model: str
    text: str
    finish_reason: str | None
    usage: Usage | None
    instance: str
    session_id: str
    created: int
    token_ids: tuple[int, ...] = ()


@attrs.frozen
class ModelInfo:
    name: str
    context_length: int
    source: str
    created: int
