"""Tool calls in a model's answer: the formats chat templates teach, read whole or streamed.

A model calls tools by writing them in the format its chat template (and its fine-tuning)
taught it. :class:`ToolFormat` names the formats read here:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in
  the answer, text around them being content (Hermes, Qwen2.5/3, SmolLM3 and the many
  templates that copied them). A last block may lack its closing tag when the model stopped
  right after the object.
* ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3's
  JSON tool calling), optionally after ``<|python_tag|>``, several joined by ``;``.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects.
* ``json``: the whole answer is one such JSON object or a list of them, optionally in a
  Markdown code fence: for templates that render tools but teach no markup.

:func:`format_for_template` picks the format from the template's source (``tool_parsers``
in the config overrides it per model). A block is a call only when every object in it
names one of the request's tools and its arguments are a JSON object (or the JSON text of
one); anything else stays in the content as the model wrote it, so no text is lost and no
call is made up.

:class:`ToolCallStream` reads an answer as it is generated: text that cannot start a call
is content at once; text that might (a ``<tool_c`` at the end of a delta) waits for the
next delta; a call comes out whole once its closing is seen (the arguments never arrive
split). vLLM's streaming parsers instead emit argument fragments as JSON grows, which makes
each parser a partial-JSON state machine of its own; here one stream serves every format,
and a call's arguments are always valid JSON when a client sees them. Parsing a whole
answer is feeding it to a stream at once, so the two can never disagree.

Pure: no I/O, no state beyond one stream's buffer.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final

import attrs

from talaria.api.results import ToolCall
from talaria.generation import held_suffix

__all__ = [
    "Piece",
    "ToolCallStream",
    "ToolFormat",
    "format_for_template",
    "new_call_id",
    "parse",
    "render_calls",
]


class ToolFormat(enum.Enum):
    """How a model writes tool calls (see the module docstring)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    JSON = "json"


HERMES_OPEN: Final = "<tool_call>"
HERMES_CLOSE: Final = "</tool_call>"
PYTHON_TAG: Final = "<|python_tag|>"
MISTRAL_TAG: Final = "[TOOL_CALLS]"
_FENCE: Final = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?```\s*\Z", re.DOTALL)
_DECODER: Final = json.JSONDecoder()


@attrs.frozen
class _Syntax:
    opens: tuple[str, ...]  # what starts a call
    close: str | None  # what ends one (None: the call runs to the end of the answer)
    at_start: bool  # a call may only begin the answer (after whitespace)


_SYNTAX: Final[Mapping[ToolFormat, _Syntax]] = {
    ToolFormat.HERMES: _Syntax((HERMES_OPEN,), HERMES_CLOSE, at_start=False),
    ToolFormat.LLAMA3_JSON: _Syntax((PYTHON_TAG, "{"), None, at_start=True),
    ToolFormat.MISTRAL: _Syntax((MISTRAL_TAG,), None, at_start=False),
    ToolFormat.JSON: _Syntax(("{", "[", "```"), None, at_start=True),
}


def format_for_template(template: str | None) -> ToolFormat:
    """The format a chat template teaches: its call markup if it has one (``<tool_call>``,
    ``<|python_tag|>`` or ``ipython``, ``[TOOL_CALLS]``), ``json`` for a template that
    renders tools without markup, and ``hermes`` for one that never mentions ``tools`` (or no
    template): Talaria then describes the tools itself, in Hermes' words
    (``talaria.api.tool_choice``)."""
    source = template or ""
    if HERMES_OPEN in source:
        return ToolFormat.HERMES
    if PYTHON_TAG in source or "ipython" in source:
        return ToolFormat.LLAMA3_JSON
    if MISTRAL_TAG in source:
        return ToolFormat.MISTRAL
    return ToolFormat.JSON if "tools" in source else ToolFormat.HERMES


def new_call_id() -> str:
    """A fresh tool call id: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@attrs.frozen
class Piece:
    """What a stream gives back for what it was fed: content text and whole tool calls."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class ToolCallStream:
    """Read one answer's text deltas into content and tool calls (see the module docstring).

    ``names``: the request's tools (a call of another name is content). ``max_calls``: calls
    kept at most (``parallel_tool_calls: false`` keeps one; later calls are dropped, text
    and all). Trailing whitespace waits
    for more content, and is dropped at the end of an answer that has calls. Mutates only
    itself.
    """

    def __init__(
        self,
        fmt: ToolFormat,
        names: Collection[str],
        *,
        max_calls: int | None = None,
    ) -> None:
        self.format = fmt
        self._syntax = _SYNTAX[fmt]
        self._names = frozenset(names)
        self._max_calls = max_calls
        self._buffer = ""  # text not yet decided
        self._in_call = False
        self._begun = False  # content other than whitespace was given out
        self._space = ""  # whitespace-only content held back
        self.calls_made = 0  # calls given out so far
        self.calls_dropped = 0  # calls over max_calls
        self._done = False

    def feed(self, text: str) -> Piece:
        """The content and whole calls that ``text`` (the answer's next delta) completes."""
        if self._done:
            raise ValueError("the stream is finished")
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._step(content, calls):
            pass
        return self._piece(content, calls)

    def finish(self) -> Piece:
        """The rest, once the answer ended: an open call is read to the end of the text (a
        Hermes block whose closing tag never came included)."""
        if self._done:
            raise ValueError("the stream is finished")
        content: list[str] = []
        calls: list[ToolCall] = []
        if self._in_call:
            self._close_call(self._buffer, content, calls)
        else:
            content.append(self._buffer)
        self._buffer = ""
        self._done = True
        piece = self._piece(content, calls)
        if self._space and not self.calls_made:
            piece = Piece(piece.content + self._space, piece.calls)
        self._space = ""
        return piece

    # --- the state machine -----------------------------------------------------------------

    def _step(self, content: list[str], calls: list[ToolCall]) -> bool:
        """Decide what the buffer allows; True when it should be looked at again."""
        syntax = self._syntax
        if self._in_call:
            if syntax.close is None:
                return False
            end = self._buffer.find(syntax.close)
            if end < 0:
                return False
            body = self._buffer[: end + len(syntax.close)]
            self._buffer = self._buffer[end + len(syntax.close) :]
            self._in_call = False
            self._close_call(body, content, calls)
            return True
        if syntax.at_start:
            return self._step_at_start(content)
        found = [(i, o) for o in syntax.opens if (i := self._buffer.find(o)) >= 0]
        if found:
            start, _ = min(found)
            content.append(self._buffer[:start])
            self._buffer = self._buffer[start:]
            self._in_call = True
            return True
        keep = held_suffix(self._buffer, syntax.opens)
        content.append(self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _step_at_start(self, content: list[str]) -> bool:
        if self._begun or self.calls_made:
            content.append(self._buffer)
            self._buffer = ""
            return False
        head = self._buffer.lstrip()
        if not head:
            return False  # whitespace only: wait
        if any(head.startswith(o) for o in self._syntax.opens):
            self._in_call = True  # the leading whitespace stays: content if no call parses
            return True
        if any(o.startswith(head) for o in self._syntax.opens):
            return False  # maybe the start of a marker: wait
        content.append(self._buffer)
        self._buffer = ""
        return False

    def _close_call(self, raw: str, content: list[str], calls: list[ToolCall]) -> None:
        """Turn one call's raw text into calls, or give it back as content."""
        found = _calls_in(self.format, raw, self._names)
        if found is None:
            content.append(raw)
            return
        for call in found:
            if self._max_calls is not None and self.calls_made >= self._max_calls:
                self.calls_dropped += 1
                continue
            calls.append(call)
            self.calls_made += 1

    def _piece(self, content: list[str], calls: list[ToolCall]) -> Piece:
        """Content given out now: everything but its trailing whitespace, which waits for
        more content (or the end: dropped when the answer has calls). Whatever the deltas,
        the answer's content is thus the same."""
        text = self._space + "".join(content)
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            self._begun = True
        return Piece(body, tuple(calls))


def parse(
    fmt: ToolFormat,
    text: str,
    names: Collection[str],
    *,
    max_calls: int | None = None,
) -> Piece:
    """A whole answer's content and tool calls (what a stream fed ``text`` at once gives;
    the arguments as :class:`ToolCallStream`'s)."""
    stream = ToolCallStream(fmt, names, max_calls=max_calls)
    first = stream.feed(text)
    rest = stream.finish()
    return Piece(first.content + rest.content, first.calls + rest.calls)


def render_calls(fmt: ToolFormat, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """``(name, arguments)`` pairs written the way ``fmt`` writes them, for chat templates
    that do not render an assistant message's ``tool_calls`` themselves."""
    if fmt is ToolFormat.HERMES:
        return "\n".join(
            f"{HERMES_OPEN}\n{_dumps({'name': n, 'arguments': a})}\n{HERMES_CLOSE}"
            for n, a in calls
        )
    if fmt is ToolFormat.LLAMA3_JSON:
        return "; ".join(_dumps({"name": n, "parameters": a}) for n, a in calls)
    objects = [{"name": n, "arguments": a} for n, a in calls]
    if fmt is ToolFormat.MISTRAL:
        return MISTRAL_TAG + _dumps(objects)
    return _dumps(objects[0]) if len(objects) == 1 else _dumps(objects)


# --- reading one call's text ---------------------------------------------------------------


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _calls_in(fmt: ToolFormat, raw: str, names: frozenset[str]) -> tuple[ToolCall, ...] | None:
    """The calls in one call's raw text (markers included), or None when it is not a
    well-formed call of the request's tools."""
    objects = _objects(fmt, raw)
    if not objects:
        return None
    calls = []
    for obj in objects:
        call = _as_call(obj, names)
        if call is None:
            return None
        calls.append(call)
    return tuple(calls)


def _objects(fmt: ToolFormat, raw: str) -> list[Any] | None:
    text = raw.strip()
    if fmt is ToolFormat.HERMES:  # a closing tag cut short by max_tokens counts as one
        text = text.removeprefix(HERMES_OPEN).removesuffix(HERMES_CLOSE)
        text = text[: len(text) - held_suffix(text, (HERMES_CLOSE,))]
        return _list(_loads_prefix(text.strip()))
    if fmt is ToolFormat.LLAMA3_JSON:
        return _semicolon_joined(text.removeprefix(PYTHON_TAG).strip())
    if fmt is ToolFormat.MISTRAL:
        return _list(_loads(text.removeprefix(MISTRAL_TAG).strip()))
    fence = _FENCE.match(text)
    return _list(_loads(fence.group(1).strip() if fence else text))


def _list(obj: Any) -> list[Any] | None:
    if isinstance(obj, dict):
        return [obj]
    if isinstance(obj, list) and obj:
        return obj
    return None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _loads_prefix(text: str) -> Any:
    """The JSON value ``text`` holds, allowing nothing but whitespace after it."""
    try:
        obj, end = _DECODER.raw_decode(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return obj if not text[end:].strip() else None


def _semicolon_joined(text: str) -> list[Any] | None:
    """JSON objects separated by ``;`` (Llama 3's parallel calls), or None."""
    out: list[Any] = []
    pos = 0
    while pos < len(text):
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return None
        out.append(obj)
        rest = text[pos:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return None
        pos = len(text) - len(rest) + 1
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out or None


def _as_call(obj: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    inner = obj.get("function")
    if isinstance(inner, dict):
        obj = inner
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    keys = [k for k in ("arguments", "parameters") if k in obj]
    args: Any = obj[keys[0]] if keys else {}
    if isinstance(args, str):
        args = _loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), name, _dumps(args))
