"""What the HTTP server needs from the in-process API: the part of ``talaria.api.Talaria``
it calls (a protocol, so a test can serve a fake), typed with the API's own results."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Unpack

if TYPE_CHECKING:
    from talaria.api.results import ChatChunk, ModelInfo, Tokenized
    from talaria.api.talaria import CallArgs, ChatArgs
    from talaria.runtime.sessions import SessionSummary
    from talaria.types import HintFields


class Backend(Protocol):
    """The part of ``talaria.api.Talaria`` the server uses. Streams raise ``TalariaError``
    (from the call or from the iterator); ``models`` and ``stats`` do no I/O."""

    def chat_stream(
        self, messages: list[dict[str, Any]], model: str, **call: Unpack[ChatArgs]
    ) -> AsyncIterator[ChatChunk]: ...

    def complete_stream(
        self,
        prompt: str | Sequence[int],
        model: str,
        **call: Unpack[CallArgs],
    ) -> AsyncIterator[ChatChunk]: ...

    async def event(
        self, session_id: str, event: str, *, tenant: str = ..., **fields: Unpack[HintFields]
    ) -> SessionSummary | None: ...

    def tokenize(
        self,
        model: str,
        *,
        prompt: str | None = ...,
        messages: Sequence[Mapping[str, Any]] | None = ...,
        add_special_tokens: bool | None = ...,
        add_generation_prompt: bool = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        parallel_tool_calls: bool | None = ...,
    ) -> Tokenized: ...

    def detokenize(self, model: str, token_ids: Sequence[int]) -> str: ...

    def models(self) -> Sequence[ModelInfo]: ...

    def stats(self) -> Mapping[str, Any]: ...

    async def integrity_problems(self) -> list[str]: ...
