"""Grammar-constrained decoding in the embedded engine (``talaria.engine.grammar``).

A random-weight model that speaks through SmolLM2's tokenizer (``smollm2-tiny-dummy``)
writes noise unless constrained; under a JSON schema every answer it samples, on every
seed, must be JSON valid against the schema. Schemas are drawn by hypothesis from the
shapes agents send (objects of bounded strings, integers, numbers, booleans, enums, nested
objects and short arrays), each accepted by the grammar library.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.api.tool_choice import call_grammar
from talaria.api.tool_parsers import ToolFormat, parse
from talaria.backends.embedded import EmbeddedInstance, build_embedded
from talaria.config import InstanceSpec
from talaria.errors import BadRequest
from talaria.generation import SamplingParams
from talaria.grammar import Grammar, GrammarKind, check_grammar
from talaria.policy.baselines import POLICIES
from talaria.types import Call, TokenSeq
from tests.helpers import examples

MODEL = "smollm2-tiny-dummy"
NAMES = st.sampled_from(["city", "days", "ok", "path", "cmd", "n", "tags", "args"])


def leaf() -> st.SearchStrategy[dict[str, Any]]:
    string = st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n})
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 50)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    number = st.just({"type": "number", "minimum": 0, "maximum": 1})
    boolean = st.just({"type": "boolean"})
    choice = st.lists(st.sampled_from(["a", "bb", "ls", "rm -r"]), min_size=1, max_size=3)
    enum = choice.map(lambda xs: {"enum": sorted(set(xs))})
    return st.one_of(string, integer, number, boolean, enum)


def objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], required: list[bool]) -> dict[str, Any]:
        req = [k for k, r in zip(sorted(props), required, strict=False) if r]
        return {
            "type": "object",
            "properties": props,
            "required": req,
            "additionalProperties": False,
        }

    props = st.dictionaries(NAMES, children, min_size=1, max_size=3)
    return st.builds(build, props, st.lists(st.booleans(), min_size=3, max_size=3))


def arrays(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return children.map(lambda c: {"type": "array", "items": c, "maxItems": 3})


SCHEMAS = objects(st.recursive(leaf(), lambda c: objects(c) | arrays(c), max_leaves=4))


@pytest.fixture(scope="module")
def tiny() -> EmbeddedInstance:
    spec = InstanceSpec(
        name="g0",
        hardware="cpu",
        device_memory_bytes=2 * 10**8,
        host_memory_bytes=2 * 10**8,
        block_size=16,
        memory_utilization=0.9,
    )
    return build_embedded(spec, [MODEL], POLICIES["talaria"], torch.float32)


def answer(tiny: EmbeddedInstance, key: str, params: SamplingParams) -> str:
    tok = tiny.tokenizers[MODEL]
    assert tok is not None
    prompt = TokenSeq(tok.encode("Answer in JSON.", add_special_tokens=False))
    local = tiny.instance
    call = Call(key, 0, MODEL, prompt, params.max_tokens)
    local.submit(call, 0.0, params=params)
    now = 0.0
    while not local.idle:
        local.step(now)
        now += 0.01
    return tok.decode(list(local.take_output(call.key)), skip_special_tokens=True)


@settings(max_examples=examples(12), deadline=None)
@given(schema=SCHEMAS, seed=st.integers(0, 2**31 - 1))
def test_every_sampled_answer_is_valid_against_its_schema(
    tiny: EmbeddedInstance, schema: dict[str, Any], seed: int
) -> None:
    grammar = Grammar.json_schema(schema)
    check_grammar(grammar)  # the shapes drawn are ones the library accepts
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed, grammar=grammar)
    text = answer(tiny, f"s{seed}", params)
    jsonschema.validate(json.loads(text), schema)
    tiny.core.check_integrity()


def test_without_a_grammar_the_same_model_writes_no_json(tiny: EmbeddedInstance) -> None:
    """The check above is not vacuous: unconstrained, the random model's answer is noise."""
    text = answer(tiny, "free", SamplingParams(max_tokens=24, temperature=1.0, seed=1))
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_any_json_object_and_a_refused_schema() -> None:
    assert Grammar.json_schema({"type": "object"}).source == '{"type": "object"}'
    with pytest.raises(BadRequest, match="grammar library"):
        check_grammar(Grammar.json_schema({"type": "nonsense"}))
    with pytest.raises(BadRequest, match="lark is refused by the grammar library"):
        check_grammar(Grammar.lark("start: %json{ not json"))
    with pytest.raises(BadRequest, match="cannot be read"):
        check_grammar(Grammar(GrammarKind.JSON_SCHEMA, "{not json"))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SHELL = {
    "type": "function",
    "function": {
        "name": "run_shell",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "enum": ["ls", "pwd"]}},
            "required": ["command"],
            "additionalProperties": False,
        },
    },
}


@settings(max_examples=examples(8), deadline=None)
@given(fmt=st.sampled_from(list(ToolFormat)), seed=st.integers(0, 2**31 - 1))
def test_a_forced_call_is_one_well_formed_call_of_the_tools(
    tiny: EmbeddedInstance, fmt: ToolFormat, seed: int
) -> None:
    """``tool_choice: required`` under the call grammar: whatever the random model samples,
    the answer reads as exactly one call of a request's tool, with arguments valid against
    that tool's schema."""
    grammar = call_grammar(fmt, [WEATHER, SHELL])
    check_grammar(grammar)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, grammar=grammar)
    text = answer(tiny, f"t{seed}-{fmt.value}", params)
    piece = parse(fmt, text, {"get_weather", "run_shell"})
    assert piece.content == "" and len(piece.calls) == 1, text
    (call,) = piece.calls
    tool = WEATHER if call.name == "get_weather" else SHELL
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])
    tiny.core.check_integrity()
