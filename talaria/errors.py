"""Typed errors. Each maps to one HTTP status and carries a message a user can act on.

Bad input raises one of these before any internal structure is touched, so a failed call
never leaves a manager half-updated.
"""

from __future__ import annotations


class TalariaError(Exception):
    """Base of every error Talaria raises on purpose."""

    http_status: int = 500
    code: str = "internal_error"
    # whether a 5xx's message is written for users (else the server logs it, not echoes it)
    public: bool = False


class ConfigError(TalariaError, ValueError):
    """A configuration value is invalid (raised at construction)."""

    http_status = 400
    code = "invalid_config"


class BadRequest(TalariaError, ValueError):
    """A request is malformed: missing field, wrong type, negative or absurd number."""

    http_status = 400
    code = "invalid_request_error"


class UnknownModel(BadRequest):
    """The request names a model that no instance serves."""

    http_status = 404
    code = "model_not_found"


class UnknownSession(BadRequest):
    """An event names a session the server has never seen (or already ended)."""

    http_status = 404
    code = "session_not_found"


class ContextTooLong(BadRequest):
    """Prompt plus requested new tokens exceed the model's context or the instance's KV pool."""

    code = "context_length_exceeded"


class Overloaded(TalariaError):
    """No instance can take the call now; retry later."""

    http_status = 503
    code = "overloaded"


class TooManyRequests(Overloaded):
    """The server, or the caller's tenant, is at a configured limit; retry after
    ``retry_after_s`` seconds (sent as ``Retry-After``)."""

    http_status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InstanceFailed(TalariaError, RuntimeError):
    """The instance serving a call failed while running it; the call was released and other
    sessions continue. Retry the call: it is routed afresh."""

    http_status = 503
    code = "instance_failed"


class InstanceLost(InstanceFailed):
    """The process (or node) executing an instance is gone: its calls that had streamed
    nothing are routed to another instance, the others fail with this error (503); the
    instance rejoins routing, its memory empty, once its process is back."""


class CallFailed(TalariaError, RuntimeError):
    """Sampling this one call failed inside an engine step (its logits processor or sampler
    raised); the call was released, the other calls of the step went on, and the instance
    stays in service. Retry it, or change its sampling parameters."""

    http_status = 500
    code = "sampling_failed"
    public = True


class ShuttingDown(TalariaError, RuntimeError):
    """The server is shutting down and took no new work, or stopped before the call ended."""

    http_status = 503
    code = "shutting_down"


class OutOfBlocks(TalariaError, RuntimeError):
    """A memory manager was asked to commit more blocks than it has (a caller skipped the check)."""

    code = "out_of_blocks"


class ToolCallFailed(TalariaError, RuntimeError):
    """``tool_choice`` asked for a tool call and the model's answer is not a well-formed call
    of one of the request's tools (the server forced the call's opening; the model wrote
    the rest)."""

    http_status = 500
    code = "tool_call_failed"
    public = True


class TraceError(TalariaError, ValueError):
    """A trace file is malformed; the message names the file, line and field at fault."""

    http_status = 400
    code = "invalid_trace"
