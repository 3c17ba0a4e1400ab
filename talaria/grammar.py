"""Constrained decoding's plain data: a :class:`Grammar` an answer must match, and checking
it with llguidance before a call is queued.

A grammar is a JSON schema or a Lark grammar (llguidance's dialect, which may embed JSON
schemas with ``%json{...}``); it rides in :class:`~talaria.generation.SamplingParams` to
whichever executor runs the call: the embedded engine masks logits with it
(:mod:`talaria.engine.grammar`), vLLM hands it to its own structured outputs. The API checks
it here first (:func:`check_grammar`), so a grammar the library cannot build is a typed 400
and never a failed call. No torch here.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from talaria.errors import BadRequest

__all__ = ["Grammar", "GrammarKind", "check_grammar", "compile_grammar"]

# JSON as one line, ", " and ": " between items (a schema's own x-guidance may say
# otherwise): free whitespace would let a weak model pad an answer up to max_tokens
_JSON: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarKind(enum.Enum):
    """How a :class:`Grammar`'s source is written."""

    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    LARK = "lark"  # a Lark grammar in llguidance's dialect (it may embed %json{...} schemas)


@attrs.frozen
class Grammar:
    """What an answer must match, token by token (constrained decoding): a JSON schema or a
    Lark grammar. Plain data: the API builds it (``response_format``, a forced tool call),
    each executor compiles it (llguidance in the embedded engine, vLLM's structured outputs
    on vLLM)."""

    kind: GrammarKind
    source: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> Grammar:
        """Answers that are JSON valid against ``schema`` (``{"type": "object"}``: any object)."""
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True))

    @classmethod
    def lark(cls, text: str) -> Grammar:
        return cls(GrammarKind.LARK, text)


def compile_grammar(grammar: Grammar) -> str:
    """``grammar`` in llguidance's form. ``BadRequest`` when its source is not JSON (a
    schema) or not a grammar at all."""
    try:
        if grammar.kind is GrammarKind.JSON_SCHEMA:
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(grammar.source, defaults=_JSON)
            )
        return str(llguidance.LLMatcher.grammar_from_lark(grammar.source))
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"the {grammar.kind.value} cannot be read: {exc}") from None


def check_grammar(grammar: Grammar) -> str:
    """The compiled grammar, or ``BadRequest`` with the library's reason when it cannot be
    built (a schema keyword it does not support, an inconsistent schema, a Lark error)."""
    compiled = compile_grammar(grammar)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
    if failed:
        why = "; ".join(messages)
        raise BadRequest(f"the {grammar.kind.value} is refused by the grammar library: {why}")
    return compiled
