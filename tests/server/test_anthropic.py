"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on a
real ``Talaria`` (SmolLM2-135M on CPU, greedy), through the official ``anthropic`` client
and raw HTTP: each answer, whole and streamed, equals the in-process API's answer to the
same conversation; tool calls and results; exact token counts; ``max_tokens`` clamped to the
context; sessions and tenants from what Claude Code sends. Bad input is
``test_anthropic_errors``'; the server and helpers are ``anthropic_live``'s."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from talaria.api import SyncTalaria
from talaria.errors import ContextTooLong
from talaria.generation import SamplingParams
from tests.server.anthropic_live import (
    COUNT,
    GREEDY,
    KEY,
    MESSAGES,
    MODEL,
    OPENAI_TOOLS,
    QUESTION,
    SYSTEM,
    TOOLS,
    api,
    assert_error,
    assert_healthy,
    claude,
    events,
    http,
    openai_question,
    plain,
    prompt_of,
    url,
    weather_question,
)
from tests.server.conftest import requires_smollm2

__all__ = ["api", "claude", "http", "url"]  # the live fixtures these tests take


def answer_of(message: Any) -> dict[str, Any]:
    """A message (the SDK's) as plain data without its id."""
    out = message.model_dump(exclude_none=False)
    out.pop("id")
    return out


@requires_smollm2
def test_whole_and_streamed_answers_equal_the_api(
    claude: anthropic.Anthropic, api: SyncTalaria
) -> None:
    # this SDK has no temperature argument any more: it travels in extra_body
    asked = {"model": MODEL, "max_tokens": 24, "system": SYSTEM, "extra_body": GREEDY}
    question = [{"role": "user", "content": QUESTION}]
    whole = claude.messages.create(messages=question, **asked)  # type: ignore[call-overload]
    ref = api.chat(
        [{"role": "system", "content": SYSTEM}, *question],
        MODEL,
        params=SamplingParams(max_tokens=24, temperature=0),
    )
    assert ref.text == "The capital of France is Paris." and ref.finish_reason == "stop"
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL
    assert [b.model_dump() for b in whole.content] == [
        {"type": "text", "text": ref.text, "citations": None}
    ]
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    usage = whole.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == ref.usage.prompt_tokens
    assert usage.output_tokens == ref.usage.completion_tokens == 8
    assert usage.cache_creation_input_tokens == 0

    with claude.messages.stream(messages=question, **asked) as stream:  # type: ignore[arg-type]
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == ref.text
    assert final.id.startswith("msg_") and final.id != whole.id
    same = answer_of(whole), answer_of(final)
    for a in same:  # the second call reads the first one's prompt from the prefix cache
        a["usage"] = a["usage"]["input_tokens"] + a["usage"]["cache_read_input_tokens"]
    assert same[0] == same[1]


@requires_smollm2
def test_the_stream_has_anthropics_events_in_order(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    with http.stream("POST", MESSAGES + "?beta=true", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = events(r)
    names = [name for name, _ in got]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6)
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = got[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    assert got[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in got[3:-3])
    delta = got[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3
    total = delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"]
    assert total == start["usage"]["input_tokens"]


@requires_smollm2
def test_a_stop_sequence_ends_the_answer(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(
        model=MODEL,
        max_tokens=24,
        extra_body=GREEDY,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        stop_sequences=["never", " Paris"],
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == " Paris"
    assert [b.model_dump()["text"] for b in r.content] == ["The capital of France is"]


@requires_smollm2
def test_a_tool_use_answer_and_its_result(claude: anthropic.Anthropic, api: SyncTalaria) -> None:
    session = {"X-Claude-Code-Session-Id": "anthropic-tools"}
    asked = {"model": MODEL, "max_tokens": 40, "tools": TOOLS, "extra_body": GREEDY}
    r = claude.messages.create(messages=weather_question("Paris"), extra_headers=session, **asked)
    ref = api.chat(
        openai_question("Paris"),
        MODEL,
        tools=OPENAI_TOOLS,
        params=SamplingParams(max_tokens=40, temperature=0),
    )
    assert ref.finish_reason == "tool_calls" and ref.text == ""
    assert [(c.name, json.loads(c.arguments)) for c in ref.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert r.stop_reason == "tool_use" and len(r.content) == 1
    use = r.content[0].model_dump()
    assert use["type"] == "tool_use" and use["name"] == "get_weather"
    assert use["input"] == {"city": "Paris"} and use["id"].startswith("toolu_")
    assert r.usage.output_tokens == ref.usage.completion_tokens

    # the result goes back in the same session: its prompt, the call included, is reused
    result = {
        "type": "tool_result",
        "tool_use_id": use["id"],
        "content": [{"type": "text", "text": json.dumps({"weather": "cloudy"})}],
    }
    follow = [
        *weather_question("Paris"),
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]
    after = claude.messages.create(
        messages=follow, extra_headers=session, **{**asked, "max_tokens": 12}
    )
    prompt = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    assert (after.usage.cache_read_input_tokens or 0) >= prompt - 16  # all but a block
    ref_call = {
        "id": use["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    ref_after = api.chat(
        [
            *openai_question("Paris"),
            {"role": "assistant", "content": "", "tool_calls": [ref_call]},
            {
                "role": "tool",
                "tool_call_id": use["id"],
                "content": json.dumps({"weather": "cloudy"}),
            },
        ],
        MODEL,
        tools=OPENAI_TOOLS,
        params=SamplingParams(max_tokens=12, temperature=0),
    )
    texts = [b.model_dump().get("text") for b in after.content if b.type == "text"]
    assert "".join(t or "" for t in texts) == ref_after.text


@requires_smollm2
def test_a_streamed_tool_use_comes_as_input_json_delta(
    claude: anthropic.Anthropic, http: httpx.Client
) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 40,
        "temperature": 0,
        "tools": TOOLS,
        "messages": weather_question("Paris"),
        "stream": True,
    }
    with http.stream("POST", MESSAGES, json=body) as r:
        got = events(r)
    blocks = [(n, d) for n, d in got if n.startswith("content_block")]
    assert [n for n, _ in blocks] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    ]
    start = blocks[0][1]["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
    assert blocks[1][1]["delta"]["type"] == "input_json_delta"
    assert json.loads(blocks[1][1]["delta"]["partial_json"]) == {"city": "Paris"}
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"

    asked = {"model": MODEL, "max_tokens": 40, "tools": TOOLS, "extra_body": GREEDY}
    with claude.messages.stream(messages=weather_question("Paris"), **asked) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.model_dump().get("input")) for b in final.content] == [
        ("tool_use", {"city": "Paris"})
    ]


@requires_smollm2
def test_tool_choice_is_honoured(claude: anthropic.Anthropic, api: SyncTalaria) -> None:
    asked = {"model": MODEL, "max_tokens": 30, "tools": TOOLS, "extra_body": GREEDY}
    for choice, openai_choice in (
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
        ({"type": "any"}, "required"),
    ):
        forced = claude.messages.create(
            messages=weather_question("Lima"), tool_choice=choice, **asked
        )
        ref = api.chat(
            openai_question("Lima"),
            MODEL,
            tools=OPENAI_TOOLS,
            tool_choice=openai_choice,
            params=SamplingParams(max_tokens=30, temperature=0),
        )
        assert forced.stop_reason == "tool_use", choice
        assert (
            [(b.model_dump()["name"], b.model_dump()["input"]) for b in forced.content]
            == [(c.name, json.loads(c.arguments)) for c in ref.tool_calls]
            == [("get_weather", {"city": "Lima"})]
        )
    plain = claude.messages.create(
        messages=weather_question("Lima"), tool_choice={"type": "none"}, **asked
    )
    ref_plain = api.chat(
        openai_question("Lima"),
        MODEL,
        tools=OPENAI_TOOLS,
        tool_choice="none",
        params=SamplingParams(max_tokens=30, temperature=0),
    )
    assert [b.type for b in plain.content] == ["text"]
    assert plain.content[0].model_dump()["text"] == ref_plain.text


@requires_smollm2
def test_count_tokens_is_the_prompt_of_the_call(http: httpx.Client, api: SyncTalaria) -> None:
    body = plain()
    count = http.post(
        COUNT + "?beta=true", json={k: v for k, v in body.items() if k != "max_tokens"}
    )
    assert count.status_code == 200 and set(count.json()) == {"input_tokens"}
    n = count.json()["input_tokens"]
    assert n == prompt_of(http.post(MESSAGES, json=body))
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    assert n == len(api.tokenize(MODEL, messages=chat).token_ids) == 27

    # with tools and a forced call (decoded under its grammar): the same prompt counted
    forced = plain(
        system=None,
        messages=weather_question("Lima"),
        tools=TOOLS,
        max_tokens=30,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    counted = http.post(COUNT, json={k: v for k, v in forced.items() if k != "max_tokens"})
    answered = http.post(MESSAGES, json=forced)
    assert answered.json()["stop_reason"] == "tool_use"
    assert counted.json()["input_tokens"] == prompt_of(answered)
    auto = http.post(COUNT, json={**forced, "tool_choice": {"type": "auto"}, "max_tokens": None})
    # the grammar constrains the answer, not the prompt: the same tokens as with auto
    assert auto.json()["input_tokens"] == counted.json()["input_tokens"]


@requires_smollm2
def test_a_max_tokens_over_the_context_is_clamped(http: httpx.Client, api: SyncTalaria) -> None:
    r = http.post(MESSAGES, json=plain(max_tokens=32000))
    assert r.status_code == 200, r.text
    granted = int(r.headers["X-Talaria-Max-Tokens-Clamped"])
    prompt = prompt_of(r)
    assert prompt == 27 and 0 < granted < 32000 and granted + prompt <= 8192
    assert r.json()["content"][0]["text"] == "The capital of France is Paris."
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    # the strict API takes exactly the granted cap and refuses one token more
    assert (
        api.chat(
            chat, MODEL, params=SamplingParams(max_tokens=granted, temperature=0)
        ).usage.prompt_tokens
        == prompt
    )
    with pytest.raises(ContextTooLong, match="tokens"):
        api.chat(chat, MODEL, params=SamplingParams(max_tokens=granted + 1, temperature=0))
    # chat completions clamps the same way; a cap that fits is not reported
    body = {"model": MODEL, "messages": chat, "max_tokens": 32000, "temperature": 0}
    openai_style = http.post("/v1/chat/completions", json=body)
    assert openai_style.status_code == 200, openai_style.text
    assert openai_style.headers["X-Talaria-Max-Tokens-Clamped"] == str(granted)
    fits = http.post(MESSAGES, json=plain(max_tokens=granted))
    assert fits.status_code == 200 and "X-Talaria-Max-Tokens-Clamped" not in fits.headers
    # a prompt that does not fit at all is still refused
    long = plain(messages=[{"role": "user", "content": "w " * 9000}])
    assert_error(http.post(MESSAGES, json=long), 400, "invalid_request_error", ["tokens"])
    assert_healthy(http)


@requires_smollm2
def test_sessions_and_tenants_come_from_what_claude_code_sends(
    url: str, http: httpx.Client
) -> None:
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "cc-session-1"})
    r = http.post(MESSAGES, json=plain(max_tokens=2, metadata={"user_id": user_id}))
    assert r.status_code == 200 and r.headers["X-Session-ID"] == "cc-session-1"
    r = http.post(
        MESSAGES, json=plain(max_tokens=2), headers={"X-Claude-Code-Session-Id": "cc-session-2"}
    )
    assert r.headers["X-Session-ID"] == "cc-session-2"
    # x-api-key names the same tenant as the bearer key: its sessions are the bearer's
    bearer = {"Authorization": f"Bearer {KEY}"}
    ended = httpx.post(
        url + "/v1/sessions/cc-session-1/events", json={"event": "end"}, headers=bearer
    )
    assert ended.status_code == 200 and ended.json()["summary"]["calls"] == 1
    assert_healthy(http)


@requires_smollm2
def test_system_messages_inside_the_conversation(http: httpx.Client, api: SyncTalaria) -> None:
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": QUESTION},
    ]
    r = http.post(MESSAGES, json=plain(system=None, messages=messages, max_tokens=12))
    assert r.status_code == 200, r.text
    ref = api.chat(messages, MODEL, params=SamplingParams(max_tokens=12, temperature=0))
    assert [b["text"] for b in r.json()["content"]] == [ref.text]
    assert prompt_of(r) == ref.usage.prompt_tokens
