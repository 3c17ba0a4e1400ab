"""The tools of a chat request: checked, shown to the model, and how its answer is read.

:func:`plan_tools` checks OpenAI ``tools``, ``tool_choice`` and ``parallel_tool_calls``
(BadRequest naming what is wrong) and returns a :class:`ToolPlan`, or None when the answer
is plain text. ``tool_choice``:

* ``"none"``: the model is not shown the tools and its answer is content only;
* ``"auto"`` (the default with tools): tools shown, calls read from the answer
  (``talaria.api.tool_parsers``), content kept around them;
* ``"required"``: the answer is one call of one of the tools;
* ``{"type": "function", "function": {"name": N}}``: the answer is one call of N.

Required and named choices are enforced by decoding constrained to a grammar
(:attr:`ToolPlan.grammar`, llguidance's Lark with an embedded JSON schema): the answer is a
call written in the model's format (Hermes' ``<tool_call>`` block, a Llama 3 JSON object,
Mistral's ``[TOOL_CALLS]`` list, a bare JSON object) whose name is one of the allowed tools
and whose arguments match that tool's ``parameters`` schema. A schema the grammar library
cannot compile (a keyword it does not support) constrains that tool's arguments to a JSON
object instead, and a warning is logged. An answer cut off by ``max_tokens`` before its
call is whole raises :class:`~talaria.errors.ToolCallFailed` rather than yielding a call
made up by the server. A forced call (or the one call ``parallel_tool_calls: false``
keeps) ends the answer at its closing tag where the format has one (:attr:`ToolPlan.stop`).

:func:`render_messages` prepares the conversation for the chat template: an assistant
message's ``tool_calls`` carry their arguments as objects (what Hugging Face templates
expect; OpenAI sends JSON text), and, for templates that do not render them (SmolLM2's
prints ``content`` only), are written into the content in the model's format, so the
model sees its own calls on the next turn. A template that never mentions ``tools`` gets
the tools described in a system message (:func:`tools_preamble`, Hermes' wording), since
the model could not know them otherwise. Pure: no I/O.
"""

from __future__ import annotations

import enum
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from talaria.api.tool_parsers import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_TAG,
    Piece,
    ToolCallStream,
    ToolFormat,
    render_calls,
)
from talaria.errors import BadRequest, ToolCallFailed
from talaria.generation import SamplingParams
from talaria.grammar import Grammar, check_grammar

__all__ = [
    "MAX_TOOLS",
    "AnswerReader",
    "Choice",
    "ToolPlan",
    "call_grammar",
    "constrained",
    "literal_call_grammar",
    "plan_tools",
    "render_messages",
    "tools_preamble",
]

log = logging.getLogger(__name__)

MAX_TOOLS: Final = 128  # OpenAI's limit on tools per request
# a forced call as llguidance's Lark: the format's wrapping around one JSON call object
_CALL_LARK: Final[Mapping[ToolFormat, tuple[str, str]]] = {
    ToolFormat.HERMES: (f"{HERMES_OPEN}\n", f"\n{HERMES_CLOSE}"),
    ToolFormat.LLAMA3_JSON: ("", ""),
    ToolFormat.MISTRAL: (f"{MISTRAL_TAG}[", "]"),
    ToolFormat.JSON: ("", ""),
}
# the call object as one line with ", " and ": " (free whitespace lets a weak model pad)
_COMPACT: Final = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NAME: Final = re.compile(r"\A[A-Za-z0-9_.\-]{1,64}\Z")


class Choice(enum.Enum):
    """What ``tool_choice`` asks of the answer (``none`` makes no plan at all)."""

    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@attrs.frozen
class ToolPlan:
    """How one request's answer is shown tools and read: ``tools`` (checked OpenAI tool
    objects, for the template), their ``names``, the model's ``format``, the ``choice``
    (``forced``: the named tool), ``max_calls`` (1 with ``parallel_tool_calls: false``) and,
    for a required or named choice, the ``grammar`` the answer is decoded under."""

    tools: tuple[Mapping[str, Any], ...]
    names: frozenset[str]
    format: ToolFormat
    choice: Choice
    forced: str | None = None
    max_calls: int | None = None
    grammar: Grammar | None = None

    @property
    def stop(self) -> str | None:
        """A stop string that ends the answer once its one call is written (Hermes' closing
        tag, when the call is forced or only one is kept); None otherwise."""
        one = self.choice is not Choice.AUTO or self.max_calls == 1
        return HERMES_CLOSE if one and self.format is ToolFormat.HERMES else None

    def stream(self) -> ToolCallStream:
        """A fresh reader of one answer (one per choice)."""
        return ToolCallStream(self.format, self.names, max_calls=self.max_calls)


def call_grammar(
    fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], loose: bool = False
) -> Grammar:
    """One call of one of ``tools`` written in ``fmt``: ``{"name": N, "arguments": A}``
    (``"parameters"`` for Llama 3) with A valid against N's ``parameters`` schema (any
    JSON object when ``loose``, or when the tool has no schema)."""
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    shapes = []
    for tool in tools:
        function = tool["function"]
        schema = function.get("parameters")
        args = dict(schema) if schema is not None and not loose else {"type": "object"}
        shapes.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, key: args},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    call = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    head, tail = _CALL_LARK[fmt]
    body = json.dumps({**call, "x-guidance": _COMPACT}, ensure_ascii=False)
    return Grammar.lark(f"start: {json.dumps(head)} call {json.dumps(tail)}\ncall: %json {body}")


def literal_call_grammar(fmt: ToolFormat, name: str, arguments: Mapping[str, Any]) -> Grammar:
    """Exactly one call of ``name`` with ``arguments``, written in ``fmt`` as
    :func:`call_grammar`'s calls are (one line, ", " and ": ")."""
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    call = json.dumps({"name": name, key: arguments}, ensure_ascii=False)
    head, tail = _CALL_LARK[fmt]
    return Grammar.lark(f"start: {json.dumps(head + call + tail)}")


def constrained(
    params: SamplingParams, plan: ToolPlan | None, scripted: Grammar | None = None
) -> SamplingParams:
    """``params`` with what the answer is decoded under: ``scripted`` (a deployment's answer
    script) over everything, else a forced call's grammar (``plan``), else the request's own
    (checked: a grammar the library refuses is a 400, not a failed call), and the stop that
    ends a forced call. BadRequest for a response format beside a forced call."""
    stops = params.stop
    end = plan.stop if plan is not None else None
    if end is not None and end not in stops:  # the forced call ends the answer
        stops = (*stops, end)  # (see ToolPlan.stop)
    forced = plan.grammar if plan is not None else None
    if scripted is not None:
        forced, params = scripted, attrs.evolve(params, grammar=None)
    elif forced is not None and params.grammar is not None:
        raise BadRequest(
            "a response format cannot be combined with a forced tool call (tool_choice "
            "'required' or a named function): send one of them"
        )
    if params.grammar is not None:
        check_grammar(params.grammar)  # (a forced call's was checked by plan_tools)
    grammar = forced if forced is not None else params.grammar
    return attrs.evolve(params, stop=stops, grammar=grammar)


def _forced_grammar(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]]) -> Grammar:
    """:func:`call_grammar`, loose when the tools' schemas cannot be compiled (logged)."""
    grammar = call_grammar(fmt, tools)
    try:
        check_grammar(grammar)
    except BadRequest as exc:
        names = ", ".join(str(t["function"]["name"]) for t in tools)
        log.warning("forced call of %s: arguments constrained to any object (%s)", names, exc)
        grammar = call_grammar(fmt, tools, loose=True)
    return grammar


class AnswerReader:
    """Reads one choice's answer as it streams: with a plan, into content and tool calls
    (``talaria.api.tool_parsers.ToolCallStream``); without one, text passes through.
    Mutates only itself."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan
        self._stream = plan.stream() if plan is not None else None
        self._text: list[str] = []  # what the model wrote (quoted by ToolCallFailed)

    @property
    def calls_made(self) -> int:
        """Tool calls given out so far (the index of the next one)."""
        return self._stream.calls_made if self._stream is not None else 0

    def feed(self, text: str) -> Piece:
        """The content and whole calls the answer's next delta completes."""
        if self._stream is None:
            return Piece(text)
        self._text.append(text)
        return self._stream.feed(text)

    def finish(self, reason: str) -> tuple[Piece, str]:
        """The rest of the answer once it ended, and its ``finish_reason``: "tool_calls"
        when it holds calls (as vLLM reports it, even if ``max_tokens`` cut the text after
        them). Raises ToolCallFailed when ``tool_choice`` required a call and none is
        there."""
        if self._stream is None or self.plan is None:
            return Piece(), reason
        piece = self._stream.finish()
        if self._stream.calls_made:
            return piece, "tool_calls"
        plan = self.plan
        if plan.choice is not Choice.AUTO:
            wanted = f"a call of {plan.forced!r}" if plan.forced else "a tool call"
            cut = " (it was cut off by max_tokens: raise it)" if reason == "length" else ""
            written = "".join(self._text)
            raise ToolCallFailed(
                f"tool_choice asked for {wanted}, and the model's answer is not a well-formed "
                f"call of the request's tools{cut}: {written!r:.300}. Retry, with a higher "
                "temperature or tool_choice 'auto'."
            )
        return piece, reason


def plan_tools(
    tools: object,
    tool_choice: object,
    parallel_tool_calls: object,
    fmt: ToolFormat,
) -> ToolPlan | None:
    """Check a request's tool fields (see the module docstring) and plan its answer; None
    when it has no tools or ``tool_choice`` is "none". Raises BadRequest."""
    checked = _check_tools(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise BadRequest("parallel_tool_calls must be true or false")
    names = frozenset(str(t["function"]["name"]) for t in checked)
    choice, forced = _check_choice(tool_choice, names)
    if choice is None:
        return None
    if choice is Choice.REQUIRED and len(names) == 1:  # the one tool it can be
        choice, forced = Choice.NAMED, next(iter(names))
    grammar = None
    if choice is not Choice.AUTO:
        allowed = [t for t in checked if forced is None or t["function"]["name"] == forced]
        grammar = _forced_grammar(fmt, allowed)
    max_calls = 1 if parallel_tool_calls is False else None
    return ToolPlan(checked, names, fmt, choice, forced, max_calls, grammar)


_CALL_SHAPE: Final = '{"name": <function-name>, "%s": <args-json-object>}'
_HOW_TO_CALL: Final[Mapping[ToolFormat, str]] = {
    ToolFormat.HERMES: "within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    + _CALL_SHAPE % "arguments"
    + "\n</tool_call>",
    ToolFormat.LLAMA3_JSON: "as follows (several separated by ';'):\n" + _CALL_SHAPE % "parameters",
    ToolFormat.MISTRAL: "in one list after [TOOL_CALLS] as follows:\n[TOOL_CALLS]["
    + _CALL_SHAPE % "arguments"
    + "]",
    ToolFormat.JSON: "as your whole answer, as follows:\n" + _CALL_SHAPE % "arguments",
}


def tools_preamble(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat) -> str:
    """A system text that shows ``tools`` to a model whose template does not: Hermes 2 Pro's
    words, with the call syntax of ``fmt``."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You are a function calling AI model. You are provided with function signatures "
        "within <tools></tools> XML tags. You may call one or more functions to assist with "
        "the user query. Don't make assumptions about what values to plug into functions. "
        f"Here are the available tools: <tools>{listed}</tools>\n"
        "For each function call return a json object with function name and arguments "
        + _HOW_TO_CALL[fmt]
    )


def render_messages(
    messages: Sequence[Mapping[str, Any]],
    template: str | None,
    fmt: ToolFormat,
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[dict[str, Any]]:
    """The conversation as the chat template should see it (see the module docstring).
    ``tools``: those shown to the model (None: none). Raises BadRequest for a malformed
    assistant ``tool_calls``. The input is not mutated."""
    source = template or ""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        m = dict(message)
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls is not None:
            pairs = _history_calls(calls, index)
            m["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                for cid, n, a in pairs
            ]
            if pairs and "tool_calls" not in source:
                written = render_calls(fmt, [(n, a) for _, n, a in pairs])
                text = m.get("content") or ""
                m["content"] = f"{text}\n{written}" if isinstance(text, str) and text else written
        out.append(m)
    if tools and "tools" not in source:
        preamble = tools_preamble(tools, fmt)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{preamble}" if first else preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


# --- checks --------------------------------------------------------------------------------


def _check_tools(tools: object) -> tuple[Mapping[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise BadRequest("tools must be a list of {type: 'function', function: {...}} objects")
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    seen: set[str] = set()
    out: list[Mapping[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise BadRequest(f"{where} must be an object of type 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise BadRequest(f"{where}.function must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise BadRequest(
                f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-', "
                f"got {name!r:.80}"
            )
        if name in seen:
            raise BadRequest(f"{where}: two tools are named {name!r}")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise BadRequest(f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise BadRequest(f"{where}.function.parameters must be a JSON schema object")
        out.append({"type": "function", "function": dict(function)})
    return tuple(out)


def _check_choice(tool_choice: object, names: frozenset[str]) -> tuple[Choice | None, str | None]:
    if tool_choice is None:
        return (Choice.AUTO if names else None), None
    if tool_choice == "none":
        return None, None
    if tool_choice in ("auto", "required"):
        if not names:
            if tool_choice == "auto":
                return None, None
            raise BadRequest("tool_choice 'required' needs tools")
        return Choice(tool_choice), None
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in names:
                raise BadRequest(
                    f"tool_choice names the function {name!r:.80}, which is not in tools "
                    f"({', '.join(sorted(names)) or 'none'})"
                )
            return Choice.NAMED, name
    raise BadRequest(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}"
    )


def _history_calls(calls: object, index: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(id, name, arguments) of an assistant message's ``tool_calls``; BadRequest if bad."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise BadRequest(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(name, str) or not name:
            raise BadRequest(f"{where}[{j}] must be {{'function': {{'name', 'arguments'}}}}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                raise BadRequest(f"{where}[{j}].function.arguments is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise BadRequest(f"{where}[{j}].function.arguments must be a JSON object")
        call_id = call.get("id") if isinstance(call, Mapping) else None
        out.append((str(call_id) if call_id is not None else "", name, arguments))
    return out
