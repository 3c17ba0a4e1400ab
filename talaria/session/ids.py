"""Session ids: generated, or read from the fields agent frameworks already carry.

Every extractor is pure, never raises, and returns ``None`` when the framework carries no
id (absent, ``None``, blank, or not a string/number/UUID). A found id is returned usable on
the wire (:func:`normalize_session_id`): stripped, as is when it passes
:func:`check_session_id` (the server's rule), else mapped deterministically to
``"sess-" + sha256 hex`` so that one framework id always names one session.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping

from talaria.errors import BadRequest

SESSION_PREFIX = "sess-"
MAX_SESSION_ID_LEN = 256


def new_session_id() -> str:
    """A fresh random id: ``"sess-"`` + 32 hex digits (uuid4)."""
    return SESSION_PREFIX + uuid.uuid4().hex


def check_session_id(session_id: object) -> str:
    """``session_id`` if usable on the wire, else :class:`BadRequest` saying why.

    Usable (the server's rule, ``talaria.server``): 1..256 printable ASCII characters
    without spaces. It travels in the ``X-Session-ID`` header and, percent-encoded, in the
    events URL path.
    """
    if not isinstance(session_id, str):
        raise BadRequest(f"a session id must be a string, got {type(session_id).__name__}")
    if not 0 < len(session_id) <= MAX_SESSION_ID_LEN:
        raise BadRequest(
            f"a session id must have 1 to {MAX_SESSION_ID_LEN} characters, got {len(session_id)}"
        )
    if not _printable(session_id):
        raise BadRequest(
            f"a session id must be printable ASCII without spaces, got {session_id!r}; "
            "normalize_session_id() maps any string to a usable id"
        )
    return session_id


def _printable(text: str) -> bool:
    return all(33 <= ord(ch) <= 126 for ch in text)


def normalize_session_id(value: str) -> str:
    """``value`` if :func:`check_session_id` accepts it, else ``"sess-"`` + the first 32 hex
    digits of its SHA-256 (deterministic: one framework id, one session). Never raises for
    a string."""
    if 0 < len(value) <= MAX_SESSION_ID_LEN and _printable(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return SESSION_PREFIX + digest[:32]


def _as_id(value: object) -> str | None:
    """A candidate field value as an id string, or None (absent, blank, unusable type)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (str, int, uuid.UUID)):
        text = str(value).strip()
        return normalize_session_id(text) if text else None
    return None


def _field(mapping: object, *path: str) -> str | None:
    for key in path:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(key)
    return _as_id(mapping)


def _first(*candidates: str | None) -> str | None:
    return next((c for c in candidates if c is not None), None)


def session_id_from_litellm(kwargs: Mapping[str, object] | None) -> str | None:
    """The session id of a LiteLLM call, from its kwargs (as passed to ``completion`` or as
    received by a callback, where the params sit under ``litellm_params``).

    Order: ``litellm_session_id``, then ``metadata["session_id"]``; each looked up at the top
    level, then under ``litellm_params`` (LiteLLM's own precedence).
    """
    return _first(
        _field(kwargs, "litellm_session_id"),
        _field(kwargs, "litellm_params", "litellm_session_id"),
        _field(kwargs, "metadata", "session_id"),
        _field(kwargs, "litellm_params", "metadata", "session_id"),
    )


def session_id_from_langchain(metadata: Mapping[str, object] | None) -> str | None:
    """The session id of a LangChain/LangGraph run, from its run metadata or its
    ``RunnableConfig``.

    Order: ``session_id``, then LangGraph's ``thread_id``; each looked up at the top level,
    then under ``metadata``, then under ``configurable``.
    """
    return _first(
        *(
            _field(metadata, *prefix, name)
            for name in ("session_id", "thread_id")
            for prefix in ((), ("metadata",), ("configurable",))
        )
    )


def session_id_from_instance(instance_id: object) -> str | None:
    """An explicit agent instance id (e.g. a SWE-bench ``instance_id``) as a session id.

    Note that two runs of the same instance then share one id; add a run suffix when the
    same instance may run twice against one server.
    """
    return _as_id(instance_id)


def resolve_session_id(*candidates: str | None) -> str:
    """The first candidate that is not ``None``, checked (:func:`check_session_id`); a new
    id (:func:`new_session_id`) when all are ``None``."""
    found = _first(*candidates)
    return new_session_id() if found is None else check_session_id(found)
