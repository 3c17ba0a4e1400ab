"""The answer script (``TalariaConfig.answer_script``): its checks, which grammar a call
gets, and what a random-weight model answers under it through the whole API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import llguidance
import pytest

from talaria.api import SyncTalaria, TalariaConfig
from talaria.api.answer_script import AnswerScript
from talaria.api.tool_choice import literal_call_grammar, plan_tools
from talaria.api.tool_parsers import ToolFormat
from talaria.errors import ConfigError
from talaria.generation import SamplingParams
from talaria.grammar import Grammar, check_grammar

MODEL = "smollm2-tiny-dummy"
ANSWER = "The file says hello"
ARGS = {"file_path": "/work/hello.txt", "limit": 20}
SCRIPT = {"text": ANSWER, "tool_calls": {"Read": ARGS, "exec_command": {"cmd": "cat x"}}}
READ = {
    "type": "function",
    "function": {
        "name": "Read",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}}},
    },
}
OTHER = {"type": "function", "function": {"name": "Write", "parameters": {"type": "object"}}}
QUESTION = [{"role": "user", "content": "What does hello.txt say?"}]


def _matches(grammar_text: str, text: str) -> bool:
    """Whether llguidance's grammar accepts exactly ``text`` (byte by byte, then stops)."""
    tok = llguidance.LLTokenizer("byte")
    m = llguidance.LLMatcher(tok, grammar_text, log_level=0)
    ok = all(m.consume_token(b) for b in tok.tokenize_str(text))
    return ok and m.is_accepting()


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"text": "(("}, "unclosed group"),
        ({"text": ""}, "non-empty regular expression"),
        ({"tool_calls": {}}, "needs text"),
        ({"text": "a", "tool_calls": {"Read": "x"}}, "argument tables"),
        ({"text": "a", "tool_calls": ["Read"]}, "maps tool names"),
        ({"text": "a", "answers": 1}, "is a table with text"),
        ("text", "is a table with text"),
    ],
)
def test_a_bad_script_is_a_config_error(table: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        TalariaConfig(models=(MODEL,), answer_script=table)


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_the_scripted_call_is_exactly_the_call_in_each_format(fmt: ToolFormat) -> None:
    grammar = check_grammar(literal_call_grammar(fmt, "Read", ARGS))
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    call = json.dumps({"name": "Read", key: ARGS})
    written = {
        ToolFormat.HERMES: f"<tool_call>\n{call}\n</tool_call>",
        ToolFormat.MISTRAL: f"[TOOL_CALLS][{call}]",
    }.get(fmt, call)
    assert _matches(grammar, written)
    assert not _matches(grammar, written.replace("hello", "hullo"))


def test_which_grammar_a_call_gets() -> None:
    script = AnswerScript(ANSWER, SCRIPT["tool_calls"])
    text = check_grammar(script.text_grammar())
    assert _matches(text, ANSWER) and not _matches(text, ANSWER + ".")
    plan = plan_tools([OTHER, READ], None, None, ToolFormat.JSON)
    first = check_grammar(script.grammar(QUESTION, plan))
    assert _matches(first, json.dumps({"name": "Read", "arguments": ARGS}))
    result = {"role": "tool", "tool_call_id": "c1", "content": "hello"}
    assert check_grammar(script.grammar([*QUESTION, result], plan)) == text
    assert check_grammar(script.grammar(QUESTION, None)) == text  # no tools offered
    other = plan_tools([OTHER], None, None, ToolFormat.JSON)
    assert check_grammar(script.grammar(QUESTION, other)) == text  # no scripted tool
    slash = AnswerScript("a/b")
    assert _matches(check_grammar(slash.text_grammar()), "a/b")


@pytest.fixture(scope="module")
def scripted() -> Iterator[SyncTalaria]:
    cfg = TalariaConfig(
        models=(MODEL,),
        device_memory_bytes=10**9,
        host_memory_bytes=10**9,
        dtype="float32",
        answer_script=SCRIPT,
    )
    with SyncTalaria(cfg) as t:
        yield t


def test_a_random_model_calls_the_tool_then_answers_the_sentence(scripted: SyncTalaria) -> None:
    first = scripted.chat(QUESTION, MODEL, tools=[READ, OTHER], session_id="s1")
    (answer,) = first.choices
    assert answer.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [("Read", ARGS)]
    call = {"id": answer.tool_calls[0].id, "type": "function", "function": {"name": "Read"}}
    call["function"]["arguments"] = answer.tool_calls[0].arguments
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "hello"},
    ]
    second = scripted.chat(history, MODEL, tools=[READ, OTHER], session_id="s1")
    assert second.choices[0].text == ANSWER and second.choices[0].finish_reason == "stop"
    assert second.usage.cached_tokens > 0
    # the script overrides a response format, and scripts text completions too
    json_only = SamplingParams(grammar=Grammar.json_schema({"type": "object"}))
    plain = scripted.chat(QUESTION, MODEL, params=json_only)
    assert plain.choices[0].text == ANSWER
    assert scripted.complete("Once upon a time", MODEL).choices[0].text == ANSWER
    scripted.talaria.check_integrity()


def test_the_script_reads_from_toml(tmp_path: Any) -> None:
    path = tmp_path / "talaria.toml"
    path.write_text(
        f'models = ["{MODEL}"]\n[answer_script]\ntext = "{ANSWER}"\n'
        '[answer_script.tool_calls]\nRead = {file_path = "/work/hello.txt", limit = 20}\n'
    )
    script = TalariaConfig.from_toml(path).answer_script
    assert script == AnswerScript(ANSWER, {"Read": ARGS})
