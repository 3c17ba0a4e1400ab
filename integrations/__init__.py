"""Agent-framework integrations of Talaria, and the little they share.

* :mod:`integrations.litellm`: a LiteLLM custom provider (``model="talaria/<model>"``),
  against a Talaria server or an embedded in-process ``Talaria``.
* :mod:`integrations.langchain`: ``ChatTalaria`` (a LangChain chat model) and
  ``TalariaCallbackHandler`` (tool runs become tool-gap hints).

Session ids and tool-gap hints come from :mod:`talaria.session` (DESIGN.md, "Wire format
for sessions"). What this module holds is framework-neutral and pure (no I/O, no state):
reading tool calls that a model wrote as text, and writing tool calls back as text.

Small models such as SmolLM2 have no tool-call channel: the server returns their answer as
text, and a tool call is whatever JSON the model wrote. :func:`parse_tool_calls` reads the
usual shapes, in this order (the first shape that yields a call wins):

1. ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes / Qwen /
   SmolLM style; a last block may lack its closing tag when generation stopped there);
2. fenced code blocks (```json ... ```) holding such an object or a list of them;
3. the whole answer as one JSON object or list;
4. the first JSON objects found inside the text (at most :data:`MAX_SCANNED_OBJECTS` tried).

An object is a call when it has a string ``name`` and ``arguments`` (or ``parameters`` /
``args``) that is an object or a JSON string of one; OpenAI's ``{"type": "function",
"function": {...}}`` wrapping is unwrapped. With ``tool_names`` given, calls to other names
are ignored (so prose that happens to contain JSON is not taken for a call).

Conversely, chat templates that print only ``content`` (SmolLM2's does) drop an assistant
message's ``tool_calls``; :func:`tool_calls_as_text` writes them into ``content`` in the
``<tool_call>`` shape, so the model sees its own calls on the next turn.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "MAX_SCANNED_OBJECTS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TextToolCall",
    "parse_tool_calls",
    "render_tool_calls",
    "requested_tool_names",
    "tool_calls_as_text",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_SCANNED_OBJECTS = 32  # "{" positions tried by the free-text scan (bounds its cost)

_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL
)
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*[ \t]*\n(.*?)```", re.DOTALL)
_DECODER = json.JSONDecoder()


@attrs.frozen
class TextToolCall:
    """A tool call read from text: the tool's ``name``, its ``arguments`` (a JSON object)
    and a fresh ``id`` (``call_`` + 24 hex digits)."""

    name: str
    arguments: dict[str, Any]
    id: str = attrs.field(factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def arguments_json(self) -> str:
        """``arguments`` as the JSON string OpenAI's ``function.arguments`` carries."""
        return json.dumps(self.arguments, ensure_ascii=False)


def parse_tool_calls(
    text: str, tool_names: Collection[str] | None = None
) -> tuple[TextToolCall, ...]:
    """The tool calls written in ``text`` (see the module docstring for the shapes read);
    ``()`` when there are none. Pure; never raises for a string."""
    if not isinstance(text, str) or not text.strip():
        return ()
    names = None if tool_names is None else frozenset(tool_names)
    for candidates in (_blocks(text), _fenced(text), _whole(text), _scan(text)):
        calls = tuple(c for obj in candidates for c in _calls_in(obj, names))
        if calls:
            return calls
    return ()


def requested_tool_names(params: Mapping[str, Any]) -> tuple[str, ...] | None:
    """Names of the OpenAI ``tools`` in a request's body or params; None when there are none
    or ``tool_choice`` is "none"."""
    tools = params.get("tools")
    if not tools or params.get("tool_choice") == "none":
        return None
    names = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str):
            names.append(name)
    return tuple(names)


def render_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any] | str]]) -> str:
    """``(name, arguments)`` pairs as ``<tool_call>`` blocks, one per line; ``arguments``
    may be an object or its JSON string (kept as a string if it is not valid JSON)."""
    lines = []
    for name, arguments in calls:
        args: Any = arguments
        if isinstance(arguments, str):
            try:
                args = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                args = arguments
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        lines.append(f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}")
    return "\n".join(lines)


def tool_calls_as_text(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A copy of OpenAI-format ``messages`` in which every assistant message that has
    ``tool_calls`` but no text content also carries those calls as ``<tool_call>`` text in
    ``content`` (``tool_calls`` is kept). Other messages are copied unchanged; the input is
    not mutated."""
    out: list[dict[str, Any]] = []
    for message in messages:
        m = dict(message)
        calls = m.get("tool_calls")
        content = m.get("content")
        empty = content is None or (isinstance(content, str) and not content.strip())
        if m.get("role") == "assistant" and calls and empty:
            pairs = [_name_and_arguments(c) for c in calls]
            rendered = render_tool_calls([p for p in pairs if p is not None])
            if rendered:
                m["content"] = rendered
        out.append(m)
    return out


# --- helpers -------------------------------------------------------------------------------


def _name_and_arguments(call: Any) -> tuple[str, Mapping[str, Any] | str] | None:
    """(name, arguments) of an OpenAI tool call given as a dict or an object with
    ``function.name`` / ``function.arguments``; None if it has no name."""
    if isinstance(call, Mapping):
        function = call.get("function")
    else:
        function = getattr(call, "function", None)
    if isinstance(function, Mapping):
        name, arguments = function.get("name"), function.get("arguments")
    else:
        name, arguments = getattr(function, "name", None), getattr(function, "arguments", None)
    if not isinstance(name, str) or not name:
        return None
    if not isinstance(arguments, (str, Mapping)):
        arguments = {}
    return name, arguments


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _blocks(text: str) -> Iterator[Any]:
    if TOOL_CALL_OPEN not in text:
        return
    for match in _BLOCK.finditer(text):
        body = match.group(1).strip()
        obj = _loads(body)
        if obj is None:  # trailing prose or a truncated block: take its first object
            obj = next(_scan(body), None)
        if obj is not None:
            yield obj


def _fenced(text: str) -> Iterator[Any]:
    for match in _FENCE.finditer(text):
        obj = _loads(match.group(1).strip())
        if obj is not None:
            yield obj


def _whole(text: str) -> Iterator[Any]:
    obj = _loads(text.strip())
    if isinstance(obj, (dict, list)):
        yield obj


def _scan(text: str) -> Iterator[Any]:
    start = text.find("{")
    tried = 0
    while start != -1 and tried < MAX_SCANNED_OBJECTS:
        tried += 1
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError):
            start = text.find("{", start + 1)
            continue
        yield obj
        start = text.find("{", end)


def _calls_in(obj: Any, names: frozenset[str] | None) -> Iterator[TextToolCall]:
    items = obj if isinstance(obj, list) else [obj]
    for item in items:
        call = _as_call(item, names)
        if call is not None:
            yield call


def _as_call(obj: Any, names: frozenset[str] | None) -> TextToolCall | None:
    if not isinstance(obj, dict):
        return None
    inner = obj.get("function")
    if isinstance(inner, dict) and "name" in inner:
        obj = inner
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    if names is not None and name not in names:
        return None
    args: Any = next(
        (obj[k] for k in ("arguments", "parameters", "args") if k in obj),
        {},
    )
    if isinstance(args, str):
        args = _loads(args) if args.strip() else {}
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return TextToolCall(name=name, arguments=args)
