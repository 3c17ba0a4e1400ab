"""The ``openai`` client's ``chat.completions.create`` arguments for a call to a Talaria
server, shared by the LiteLLM HTTP backend and LangChain's ``ChatTalaria``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import openai

__all__ = ["create_options"]


def create_options(
    model: str,
    messages: list[dict[str, Any]],
    params: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    stream: bool,
    session_id: str | None,
    timeout_s: float,
    connect_timeout_s: float,
) -> dict[str, Any]:
    """Keyword arguments of ``chat.completions.create``: every body field in ``params``
    travels in ``extra_body`` so that the server, not the client library, judges it (with
    usage asked for in a stream); ``session_id``, when given, in the ``X-Session-ID`` header
    beside ``headers``. The connection may take ``connect_timeout_s``, at most ``timeout_s``,
    the whole call's limit. A new dict each call; nothing given is mutated."""
    extra_headers = dict(headers)
    if session_id is not None:
        extra_headers["X-Session-ID"] = session_id
    extra: dict[str, Any] = dict(params)
    if stream:
        extra["stream_options"] = {"include_usage": True}
    connect = min(connect_timeout_s, timeout_s)
    return {
        "model": model,
        "messages": messages,
        "stream": stream,
        "extra_headers": extra_headers,
        "extra_body": extra,
        "timeout": openai.Timeout(timeout_s, connect=connect),
    }
