"""Every HTTP error the server sends, in OpenAI's shape or, under ``/v1/messages``,
Anthropic's (:class:`ErrorShape`).

OpenAI's: ``{"error": {"message": str, "type": str, "param": str | None, "code": str |
None}}``: the shape the ``openai`` client parses into ``APIError.message`` / ``.code`` /
``.param``. Anthropic's: ``{"type": "error", "error": {"type": str, "message": str}}`` with
the type its status has there (:func:`anthropic_type`). The message says what to change;
5xx messages never carry a traceback (the server log does, under the request id the
message quotes).
"""

from __future__ import annotations

import enum
import json
import logging
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from talaria.errors import ContextTooLong, Overloaded, TalariaError, UnknownModel, UnknownSession

log = logging.getLogger("talaria.server")

RETRY_AFTER_S = 1  # what a 503 asks a client to wait before retrying, seconds

# Fields whose type is a union: pydantic reports one error per union member; one line is enough.
_FIELD_HINTS: Mapping[str, str] = {
    "stop": "must be a string or a list of non-empty strings",
    "prompt": "must be a string, a list of token ids, or a list holding one of either",
    "content": "must be a string, a list of text parts, or null",
    "tool_choice": "must be a string or an object",
    "output": "must be a string or a list of text parts",
}


ANTHROPIC_PREFIX = "/v1/messages"  # the paths of the Anthropic Messages API


class ErrorShape(enum.Enum):
    """Whose error body a path answers with."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"

    @classmethod
    def for_path(cls, path: str) -> ErrorShape:
        """Anthropic's under ``/v1/messages`` (and its ``count_tokens``), OpenAI's elsewhere."""
        anthropic = path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")
        return cls.ANTHROPIC if anthropic else cls.OPENAI


_ANTHROPIC_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_type(status: int) -> str:
    """Anthropic's error ``type`` for a status: its own for the statuses it documents,
    ``invalid_request_error`` for other 4xx, ``api_error`` for other 5xx."""
    known = _ANTHROPIC_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


class HttpError(Exception):
    """An error the server answers with: status, a message a user can act on, and OpenAI's
    ``type`` / ``param`` / ``code``. Raised by request handling; rendered by :func:`render`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self, shape: ErrorShape = ErrorShape.OPENAI) -> dict[str, Any]:
        """The JSON body: OpenAI's ``{"error": {...}}`` or Anthropic's ``{"type": "error",
        "error": {"type", "message"}}``."""
        if shape is ErrorShape.ANTHROPIC:
            kind = anthropic_type(self.status)
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, shape: ErrorShape = ErrorShape.OPENAI) -> JSONResponse:
        """The whole HTTP response (status, body, headers)."""
        return JSONResponse(self.body(shape), status_code=self.status, headers=self.headers)

    def sse_event(self, shape: ErrorShape = ErrorShape.OPENAI) -> bytes:
        """The error as one server-sent event, for a failure after a stream has begun
        (Anthropic's is an ``event: error``)."""
        data = b"data: " + json.dumps(self.body(shape)).encode() + b"\n\n"
        return b"event: error\n" + data if shape is ErrorShape.ANTHROPIC else data


def error_type(status: int) -> str:
    """OpenAI's ``type`` for a status: client errors are ``invalid_request_error`` (401 too, as
    OpenAI does), 503 ``overloaded_error``, other 5xx ``server_error``."""
    if status == 503:
        return "overloaded_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> HttpError:
    """A 400 naming the offending field in ``param``."""
    return HttpError(400, message, code=code, param=param)


def internal(exc: BaseException) -> HttpError:
    """A 500 for a failure Talaria did not anticipate: logs the traceback under a fresh request
    id and answers with that id only."""
    rid = uuid.uuid4().hex[:12]
    log.error("internal error, request %s", rid, exc_info=exc)
    return HttpError(
        500,
        f"Internal server error (request {rid}); the server log has the details. "
        "Retrying may help; if it keeps failing, report the request id.",
        code="internal_error",
    )


def from_talaria(exc: TalariaError) -> HttpError:
    """Map a typed Talaria error to its HTTP answer (``exc.http_status``, ``exc.code``).

    Messages of 4xx and 503 errors, and of errors marked ``public``, are written for users
    and pass through; any other 5xx is treated as :func:`internal` (logged, not echoed).
    """
    status = int(getattr(exc, "http_status", 500))
    code = str(getattr(exc, "code", "internal_error"))
    if status >= 500 and status != 503 and not exc.public:
        return internal(exc)
    message = str(exc) or (type(exc).__doc__ or type(exc).__name__).strip()
    param: str | None = None
    headers: dict[str, str] = {}
    if isinstance(exc, UnknownModel):
        param = "model"
    elif isinstance(exc, ContextTooLong):
        param = "messages"
    elif isinstance(exc, UnknownSession):
        param = "session_id"
    if isinstance(exc, Overloaded) or status in (429, 503):
        wait = getattr(exc, "retry_after_s", RETRY_AFTER_S)
        headers["Retry-After"] = str(max(1, math.ceil(wait)))
        if "retry" not in message.lower():
            message = f"{message} Retry in a moment."
    return HttpError(status, message, code=code, param=param, headers=headers)


def from_validation(
    exc: ValidationError, what: str = "request body", hints: Mapping[str, str] | None = None
) -> HttpError:
    """A 400 from a pydantic error: invalid JSON, a wrong type, a missing or out-of-range
    field. The message names each offending field (up to three) and what it must be
    (``hints``: one line per union-typed field, OpenAI's fields' by default)."""
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        detail = next(e for e in errors if e["type"] == "json_invalid")
        reason = str(detail.get("ctx", {}).get("error", detail["msg"]))
        return bad_request(
            f"The {what} is not valid JSON ({reason}); send one JSON object.", code="invalid_json"
        )
    lines: list[str] = []
    params: list[str] = []
    for err in errors:
        path, hint = _describe(err["loc"], err["type"], err["msg"], hints or _FIELD_HINTS)
        line = f"{path or what}: {hint}"
        if line not in lines:
            lines.append(line)
            params.append(path)
    more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
    return bad_request(
        "Invalid request: " + "; ".join(lines[:3]) + more + ".", param=params[0] or None
    )


def _describe(
    loc: Sequence[int | str], kind: str, msg: str, hints: Mapping[str, str]
) -> tuple[str, str]:
    """(dotted field path, what is wrong) for one pydantic error; the members of a union
    in ``hints`` collapse into its one line."""
    if kind == "missing":
        return ".".join(str(p) for p in loc), "this field is required"
    path: list[str] = []
    for part in loc:
        if isinstance(part, str) and part in hints:
            path.append(part)
            return ".".join(path), hints[part]
        path.append(str(part))
    if kind == "extra_forbidden":
        return ".".join(path), "unknown field"
    return ".".join(path), msg[0].lower() + msg[1:] if msg else kind
