"""The server's OpenAPI document: request bodies and documented error answers.

The route handlers parse their bodies themselves (so that a malformed one gets OpenAI's error
shape, not FastAPI's), which leaves FastAPI's generated document without request bodies.
:func:`body` and :func:`errors` give each route its ``requestBody`` (a ``$ref`` to the
pydantic model's JSON schema) and its error responses, and :func:`install` publishes the
models' schemas (and the shared error body) under ``components/schemas``, so a
schema-driven client or fuzzer can read the whole API. Pure: builds dictionaries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
ERROR_SCHEMA = "Error"
ANTHROPIC_ERROR_SCHEMA = "AnthropicError"  # the error body under /v1/messages

# What each documented status means here (every one has OpenAI's error body, Anthropic's
# under /v1/messages).
STATUS = {
    400: "Malformed request: invalid JSON, an unknown field, a value out of range, a prompt "
    "longer than the model's context (the message names the field).",
    401: "Missing or wrong API key (when the server has keys).",
    404: "Unknown model, route or session.",
    413: "The body is larger than the server accepts.",
    429: "Too many calls in flight (all, or this tenant's share), or this tenant's token "
    "budget is spent; Retry-After says when to retry.",
    503: "Shutting down, overloaded, or the instance serving the call was lost; retry.",
}
REQUEST_ERRORS = (400, 401, 404, 413, 429, 503)


def body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON request body is ``model``."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    }


def errors(
    statuses: Iterable[int] = REQUEST_ERRORS, anthropic: bool = False
) -> dict[int | str, dict[str, Any]]:
    """A route's documented error ``responses`` (OpenAI's error body each, or Anthropic's)."""
    schema = {"$ref": REF.format(model=ANTHROPIC_ERROR_SCHEMA if anthropic else ERROR_SCHEMA)}
    return {
        status: {"description": STATUS[status], "content": {"application/json": {"schema": schema}}}
        for status in statuses
    }


def _error_schema() -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }


def _anthropic_error_schema() -> dict[str, Any]:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    inner = {
        "type": "object",
        "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }
    return {
        "type": "object",
        "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": inner},
    }


def schemas(models: Iterable[type[BaseModel]]) -> dict[str, Any]:
    """``components/schemas`` for ``models`` (their nested definitions hoisted) and the error
    bodies."""
    out: dict[str, Any] = {
        ERROR_SCHEMA: _error_schema(),
        ANTHROPIC_ERROR_SCHEMA: _anthropic_error_schema(),
    }
    for model in models:
        schema = model.model_json_schema(ref_template=REF)
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def install(app: FastAPI, models: Iterable[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` publish ``models``' schemas (generated once, on first use)."""
    published = tuple(models)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
            )
            for ops in doc.get("paths", {}).values():
                for op in ops.values():  # the handlers answer 400, never FastAPI's 422
                    op.get("responses", {}).pop("422", None)
            components: dict[str, Any] = doc.setdefault("components", {})
            found = components.setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                found.pop(name, None)
            found.update(schemas(published))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def request_bodies(doc: Mapping[str, Any]) -> dict[tuple[str, str], str]:
    """(method, path) -> the schema name of each operation's request body in ``doc``."""
    out = {}
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            name = ref.get("schema", {}).get("$ref", "").rsplit("/", 1)[-1]
            if name:
                out[(method.upper(), path)] = name
    return out
