"""The in-process API: ``talaria.Talaria`` serves the embedded engine to code in this process.

::

    async with Talaria(TalariaConfig.default()) as tal:
        answer = await tal.chat([{"role": "user", "content": "hi"}], "smollm2-135m",
                                session_id="agent-1", params=SamplingParams(max_tokens=64))
        async for chunk in tal.chat_stream(messages, "smollm2-135m", session_id="agent-1"):
            print(chunk.text, end="")
        await tal.event("agent-1", "tool_start", tool="bash", expected_s=0.4)
        summary = await tal.event("agent-1", "end")

``Talaria`` owns a :class:`~talaria.runtime.live.LiveCluster` over the models of its
:class:`TalariaConfig`; ``SyncTalaria`` wraps it for scripts. Every error is a
:class:`~talaria.errors.TalariaError` with an HTTP status and a message a user can act on.
Calls without a session id are one-call sessions: they end when they return. A call's
sampling is one :class:`~talaria.generation.SamplingParams` (the HTTP server builds the same
object from a request's fields).

The package: ``config`` (``TalariaConfig`` and its TOML form), ``results`` (what calls
return), ``tool_choice`` and ``tool_parsers`` (a request's tools shown to the model and its
calls read from the answer), ``talaria`` (the
async API), ``stats`` (the ``Talaria.stats()`` snapshot) and ``sync`` (``SyncTalaria``).
"""

from talaria.api.config import DEFAULT_MAX_TOKENS, TalariaConfig
from talaria.api.results import (
    ChatChunk,
    ChatResult,
    Choice,
    Logprob,
    ModelInfo,
    Tokenized,
    ToolCall,
    TopLogprob,
    Usage,
)
from talaria.api.sync import SyncTalaria
from talaria.api.talaria import CallArgs, ChatArgs, Talaria
from talaria.generation import SamplingParams
from talaria.runtime.sessions import SessionSummary
from talaria.types import DEFAULT_TENANT, SessionKey

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_TENANT",
    "CallArgs",
    "ChatArgs",
    "ChatChunk",
    "ChatResult",
    "Choice",
    "Logprob",
    "ModelInfo",
    "SamplingParams",
    "SessionKey",
    "SessionSummary",
    "SyncTalaria",
    "Talaria",
    "TalariaConfig",
    "Tokenized",
    "ToolCall",
    "TopLogprob",
    "Usage",
]
