"""A deployment that scripts what its model answers: protocol tests of real agent clients.

A random-weight model (``agent-tiny-dummy``) lets a coding agent's 20K-token first prompt fit
on a CPU, but its answers are noise: it never ends one before the cap, and never calls a
tool, so a client's tool round trip cannot be tested against it. :class:`AnswerScript`
(``TalariaConfig.answer_script``, a TOML ``[answer_script]`` table) constrains the model's
decoding with grammars instead (the same llguidance masks as any constrained call, so the
whole serving path runs):

* a call that offers one of the script's ``tool_calls`` tools (``tool_choice`` not
  ``none``) in a conversation that holds no tool result yet is answered with exactly that
  call (the first such tool in the script's order, its arguments as written), in the
  model's tool-call format;
* every other answer matches ``text``, a regular expression (llguidance's syntax), and ends
  where the expression does.

Never for real serving: it overrides whatever the request asked of the answer
(``response_format``, a forced tool choice). Plain data, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from talaria.api.tool_choice import ToolPlan, literal_call_grammar
from talaria.errors import BadRequest, ConfigError
from talaria.grammar import Grammar, check_grammar

__all__ = ["AnswerScript", "answer_script"]


def _tool_calls(value: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"answer_script.tool_calls maps tool names to arguments, got {value!r}")
    calls: dict[str, dict[str, Any]] = {}
    for name, args in value.items():
        if not isinstance(name, str) or not name or not isinstance(args, Mapping):
            raise ConfigError(
                f"answer_script.tool_calls maps tool names to argument tables; got "
                f"{name!r} = {args!r}"
            )
        calls[name] = dict(args)
    return calls


@attrs.frozen
class AnswerScript:
    """What a scripted deployment's model answers (see the module docstring): ``text``, a
    regular expression every text answer matches, and ``tool_calls``, tool name -> the
    arguments of the call a conversation's first tool-offering answers make."""

    text: str
    tool_calls: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict, converter=_tool_calls)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ConfigError("answer_script.text must be a non-empty regular expression")
        try:
            check_grammar(self.text_grammar())
        except BadRequest as exc:
            raise ConfigError(f"answer_script.text: {exc}") from None

    def text_grammar(self) -> Grammar:
        """Answers matching :attr:`text`, ended where it ends (a ``/`` in it is escaped)."""
        pattern = self.text.replace("/", "\\/")
        return Grammar.lark(f"start: /{pattern}/")

    def grammar(self, messages: Sequence[Mapping[str, Any]], plan: ToolPlan | None) -> Grammar:
        """The grammar one chat call's answer is decoded under: the scripted call of the
        first offered tool while ``messages`` (the chat form) hold no tool result, else
        :meth:`text_grammar`."""
        answered = any(m.get("role") == "tool" for m in messages if isinstance(m, Mapping))
        if plan is not None and not answered:
            for name, args in self.tool_calls.items():
                if name in plan.names:
                    return literal_call_grammar(plan.format, name, args)
        return self.text_grammar()


def answer_script(value: Any) -> AnswerScript | None:
    """``TalariaConfig.answer_script``'s converter: a table (``text``, ``tool_calls``), an
    AnswerScript, or None (answers are the model's own)."""
    if value is None or isinstance(value, AnswerScript):
        return value
    if not isinstance(value, Mapping) or set(value) - {"text", "tool_calls"}:
        raise ConfigError(
            f"answer_script is a table with text (a regular expression) and tool_calls "
            f"(tool name -> arguments); got {json.dumps(value, default=str)[:200]}"
        )
    if "text" not in value:
        raise ConfigError("answer_script needs text: the regular expression text answers match")
    return AnswerScript(value["text"], value.get("tool_calls", {}))
