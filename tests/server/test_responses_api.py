"""``POST /v1/responses`` (OpenAI's Responses API, as Codex CLI speaks it) over HTTP on a
real ``Talaria`` (SmolLM2-135M in float32): the official ``openai`` SDK's
``client.responses.create`` whole and streamed, each against the same conversation on the
in-process API (greedy, so equal), a ``function_call`` answer and the ``store: false``
follow-up with the whole history and its tool output (its prefix served by the cache),
namespace and hosted tools, the event sequence, a failure after the stream began, and bad
input as typed 400s that leave the server's state intact. The translation of input items
into chat messages is checked exactly without a model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from talaria.api import SyncTalaria
from talaria.generation import SamplingParams
from talaria.server.errors import HttpError
from talaria.server.responses_api import ResponsesRequest, to_chat
from tests.server import smollm2_live
from tests.server.conftest import requires_smollm2

MODEL = "smollm2-135m"
PATH = "/v1/responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with smollm2_live.served() as base:
        yield base


@pytest.fixture(scope="module")
def tal() -> Iterator[SyncTalaria]:
    with SyncTalaria(smollm2_live.config()) as t:
        yield t


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


def turn(city: str, weather: str, call_id: str) -> list[dict[str, Any]]:
    """One earlier turn as Responses items: question, call, its output, answer."""
    return [
        {"role": "user", "content": [{"type": "input_text", "text": f"Weather in {city}?"}]},
        {
            "type": "function_call",
            "call_id": call_id,
            "name": "get_weather",
            "arguments": json.dumps({"city": city}),
        },
        {
            "type": "function_call_output",
            "call_id": call_id,
            "output": json.dumps({"weather": weather}),
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"It is {weather} in {city}."}],
        },
    ]


def chat_turn(city: str, weather: str, call_id: str) -> list[dict[str, Any]]:
    """The same turn as chat messages (what the server must translate it to)."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"weather": weather})},
        {"role": "assistant", "content": f"It is {weather} in {city}."},
    ]


def ask(city: str) -> list[dict[str, Any]]:
    history = turn("Rome", "sunny", "call_1") + turn("Oslo", "rainy", "call_2")
    return [*history, {"role": "user", "content": f"Weather in {city}?"}]


def chat_ask(city: str) -> list[dict[str, Any]]:
    history = chat_turn("Rome", "sunny", "call_1") + chat_turn("Oslo", "rainy", "call_2")
    return [*history, {"role": "user", "content": f"Weather in {city}?"}]


# --- translation (no model) -----------------------------------------------------------------


def test_items_translate_to_chat_messages_exactly() -> None:
    body = ResponsesRequest.model_validate(
        {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": [
                {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
                *ask("Paris"),
                {"role": "developer", "content": "Use metric units."},
            ],
            "tools": [
                WEATHER,
                {"type": "web_search"},
                {"type": "tool_search", "execution": "client", "parameters": {}},
                {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
                {
                    "type": "namespace",
                    "name": "mcp",
                    "description": "an MCP server",
                    "tools": [{"type": "function", "name": "read", "description": "Read"}],
                },
            ],
            "tool_choice": {"type": "function", "name": "read"},
        }
    )
    call = to_chat(body)
    assert call.messages == [
        {"role": "system", "content": "Be brief."},
        *chat_ask("Paris"),
        {"role": "developer", "content": "Use metric units."},
    ]
    assert call.tools == [
        CHAT_WEATHER,
        {"type": "function", "function": {"name": "mcp.read", "description": "Read"}},
    ]
    assert call.tool_choice == {"type": "function", "function": {"name": "mcp.read"}}
    assert call.parallel_tool_calls is True
    assert {k: (v.namespace, v.name) for k, v in call.names.items()} == {
        "get_weather": (None, "get_weather"),
        "mcp.read": ("mcp", "read"),
    }


def test_text_then_calls_make_one_assistant_message_and_outputs_need_their_call() -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Looking."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {
            "type": "function_call",
            "call_id": "c2",
            "name": "g",
            "arguments": "{}",
            "namespace": "n",
        },
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "two"}],
        },
    ]
    call = to_chat(ResponsesRequest.model_validate({"model": MODEL, "input": items}))
    assert call.messages[1] == {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "n.g", "arguments": "{}"}},
        ],
    }
    assert call.messages[2] == {"role": "tool", "tool_call_id": "c2", "content": "two"}
    assert call.tools is None and call.tool_choice is None
    orphan = [*items[:2], {"type": "function_call_output", "call_id": "c9", "output": "x"}]
    with pytest.raises(HttpError) as err:
        to_chat(ResponsesRequest.model_validate({"model": MODEL, "input": orphan}))
    assert (err.value.status, err.value.code, err.value.param) == (
        400,
        "unknown_call_id",
        "input.2.call_id",
    )


# --- over HTTP, on the model -----------------------------------------------------------------

PROMPT = "Write one short sentence about the sea."
SHORT = "What is 2+2? Answer with a number."  # SmolLM2 answers in 7 tokens, then ends


def healthy(http: httpx.Client) -> None:
    r = http.get("/health?integrity=true")
    assert r.status_code == 200 and r.json()["integrity"] == "ok", r.text


@requires_smollm2
def test_sdk_whole_answer_equals_the_in_process_api(
    client: openai.OpenAI, tal: SyncTalaria
) -> None:
    r = client.responses.create(
        model=MODEL, instructions="Be brief.", input=PROMPT, temperature=0, max_output_tokens=12
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    same = tal.chat(messages, MODEL, params=SamplingParams(max_tokens=12, temperature=0))
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"]
    assert r.output_text == same.text and same.text
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        same.usage.prompt_tokens,
        same.usage.completion_tokens,
    )
    assert r.usage.total_tokens == same.usage.total_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert same.finish_reason == "length" and r.usage.output_tokens == 12  # cut by the cap
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and item.status == "incomplete"
    assert (r.temperature, r.top_p, r.max_output_tokens, r.store) == (0, 1, 12, False)
    assert r.instructions == "Be brief." and r.tools == [] and r.tool_choice == "auto"


TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@requires_smollm2
def test_sdk_stream_carries_the_documented_events_and_the_same_answer(
    client: openai.OpenAI, tal: SyncTalaria
) -> None:
    same = tal.chat(
        [{"role": "user", "content": SHORT}],
        MODEL,
        params=SamplingParams(max_tokens=40, temperature=0),
    )
    assert (
        same.finish_reason == "stop" and same.text == "The answer is 4."
    )  # the answer ends before its cap: "completed"
    events = list(
        client.responses.create(
            model=MODEL, input=SHORT, temperature=0, max_output_tokens=40, stream=True
        )
    )
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [k for k in kinds if k != "response.output_text.delta"] == [
        *TEXT_EVENTS,
        "response.completed",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == same.text
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output_text == same.text and done.response.status == "completed"
    assert done.response.usage is not None
    assert done.response.usage.output_tokens == same.usage.completion_tokens
    item_ids = {getattr(e, "item_id", None) for e in events} - {None}
    assert item_ids == {done.response.output[0].id}
    with client.responses.stream(
        model=MODEL, input=SHORT, temperature=0, max_output_tokens=40
    ) as s:
        helper = [e.type for e in s]
        final = s.get_final_response()
    assert helper == kinds and final.output_text == same.text


@requires_smollm2
def test_a_streamed_answer_cut_by_the_cap_ends_with_response_incomplete(
    http: httpx.Client,
) -> None:
    body = {"model": MODEL, "input": PROMPT, "temperature": 0, "max_output_tokens": 3}
    events = sse_events(http.post(PATH, json={**body, "stream": True}))
    kinds = [e["type"] for e in events]
    assert [k for k in kinds if k != "response.output_text.delta"] == [
        *TEXT_EVENTS,
        "response.incomplete",
    ]
    last = events[-1]["response"]
    assert last["status"] == "incomplete" and last["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert last["output"][0]["status"] == "incomplete" and last["usage"]["output_tokens"] == 3
    whole = http.post(PATH, json=body).json()
    assert whole["output"][0]["content"] == last["output"][0]["content"]
    assert whole["status"] == "incomplete"
    metrics = http.get("/metrics").text
    assert 'endpoint="responses",model="smollm2-135m",status="200"' in metrics


@requires_smollm2
def test_a_function_call_then_its_output_with_the_whole_history(
    client: openai.OpenAI, tal: SyncTalaria
) -> None:
    """Codex's loop: a call comes back as a ``function_call`` item; the next request sends
    the whole history (``store: false``) with the call and its output, in the same session
    (``prompt_cache_key``), and finds its prefix cached."""
    fields: dict[str, Any] = {"temperature": 0, "store": False, "prompt_cache_key": "codex-1"}
    r = client.responses.create(
        model=MODEL, input=ask("Paris"), tools=[WEATHER], max_output_tokens=40, **fields
    )
    same = tal.chat(
        chat_ask("Paris"),
        MODEL,
        tools=[CHAT_WEATHER],
        params=SamplingParams(max_tokens=40, temperature=0),
    )
    (call,) = r.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert [(c.name, c.arguments) for c in same.tool_calls] == [(call.name, call.arguments)]
    assert r.status == "completed" and r.usage is not None
    history = [
        *ask("Paris"),
        call.model_dump(exclude_none=True),
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": '{"weather": "cloudy"}',
        },
    ]
    after = client.responses.create(
        model=MODEL, input=history, tools=[WEATHER], max_output_tokens=12, **fields
    )
    assert after.usage is not None and after.status in ("completed", "incomplete")
    cached = after.usage.input_tokens_details.cached_tokens
    assert cached >= r.usage.input_tokens - 16 and cached > 0, (cached, r.usage.input_tokens)
    follow = [
        *chat_ask("Paris"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"weather": "cloudy"}'},
    ]
    again = tal.chat(
        follow, MODEL, tools=[CHAT_WEATHER], params=SamplingParams(max_tokens=12, temperature=0)
    )
    assert after.output_text == again.text
    assert after.usage.input_tokens == again.usage.prompt_tokens


@requires_smollm2
def test_a_streamed_function_call(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input=ask("Paris"),
            tools=[WEATHER],
            temperature=0,
            max_output_tokens=40,
            stream=True,
        )
    )
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, args_done, item_done = events[2:6]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert json.loads(delta.delta) == {"city": "Paris"} and args_done.arguments == delta.delta
    assert item_done.item.arguments == delta.delta and item_done.item.status == "completed"
    assert item_done.item.call_id == added.item.call_id
    assert events[-1].response.output[0].call_id == added.item.call_id


@requires_smollm2
def test_namespace_functions_are_called_by_namespace_and_name(client: openai.OpenAI) -> None:
    """A nested function is shown as ``weather.get_weather``; its call comes back with
    ``namespace`` and the bare ``name``. Hosted and custom tools change nothing."""
    space = {"type": "namespace", "name": "weather", "description": "Weather", "tools": [WEATHER]}
    fields: dict[str, Any] = {"input": ask("Lima"), "temperature": 0, "max_output_tokens": 40}
    r = client.responses.create(model=MODEL, tools=[space], tool_choice="required", **fields)
    (call,) = r.output
    assert (call.type, call.namespace, call.name) == ("function_call", "weather", "get_weather")
    assert json.loads(call.arguments) == {"city": "Lima"}
    hosted: list[Any] = [
        {"type": "web_search"},
        {"type": "local_shell"},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "custom", "name": "apply_patch", "description": "Patch files"},
        WEATHER,
    ]
    plain = client.responses.create(model=MODEL, tools=[WEATHER], **fields)
    mixed = client.responses.create(model=MODEL, tools=hosted, **fields)
    assert [(o.name, o.arguments) for o in mixed.output] == [
        (o.name, o.arguments) for o in plain.output
    ]
    assert mixed.usage is not None and plain.usage is not None
    assert mixed.usage.input_tokens == plain.usage.input_tokens
    assert [t["type"] for t in mixed.model_dump()["tools"]] == [t["type"] for t in hosted]


@requires_smollm2
def test_session_headers_and_prompt_cache_key(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1, "prompt_cache_key": "pck-1"}
    assert http.post(PATH, json=body).headers["x-session-id"] == "pck-1"
    for header in ("X-Session-ID", "session_id", "thread-id"):
        r = http.post(PATH, json=body, headers={header: f"h-{header}"})
        assert r.status_code == 200 and r.headers["x-session-id"] == f"h-{header}"
    bad = http.post(PATH, json={**body, "prompt_cache_key": "has space"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_session_id"


@requires_smollm2
def test_a_failure_after_the_stream_began_is_an_error_and_response_failed(
    http: httpx.Client,
) -> None:
    """A required call cut off by the token cap fails once generation ran."""
    body = {
        "model": MODEL,
        "input": "What is the weather in Lima?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_output_tokens": 2,
    }
    whole = http.post(PATH, json=body)
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "tool_call_failed"
    r = http.post(PATH, json={**body, "stream": True})
    events = sse_events(r)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert events[2]["code"] == "tool_call_failed" and "max_tokens" in events[2]["message"]
    failed = events[3]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "tool_call_failed"
    healthy(http)


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The events of a Responses stream; each ``event:`` line must name its data's type."""
    out: list[dict[str, Any]] = []
    kind = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert data["type"] == kind
            out.append(data)
        else:
            assert line == "", line
    return out


BAD: list[tuple[dict[str, Any], str, str | None, str]] = [
    (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "invalid_value",
        "input.0.function_call.call_id",
        "required",
    ),
    (
        {"input": [{"type": "computer_call", "action": {}}]},
        "invalid_value",
        "input.0",
        "'computer_call'",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "invalid_value",
        "input.0.message.content",
        "list of text parts",
    ),
    (
        {"tools": [{"type": "computer_use_preview"}]},
        "invalid_value",
        "tools.0",
        "'computer_use_preview'",
    ),
    (
        {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
        "unknown_call_id",
        "input.0.call_id",
        "no function_call",
    ),
    (
        {"previous_response_id": "resp_1"},
        "previous_response_not_supported",
        "previous_response_id",
        "stores no responses",
    ),
    (
        {"text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
        "invalid_value",
        "text.format",
        "grammar library",
    ),
    ({"background": True}, "invalid_value", "background", "not supported"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
        "invalid_request_error",
        None,
        "not in tools",
    ),
]


@requires_smollm2
@pytest.mark.parametrize(
    ("fields", "code", "param", "words"), BAD, ids=[f"bad{i}" for i in range(len(BAD))]
)
def test_bad_input_is_a_typed_400_and_leaves_the_server_intact(
    http: httpx.Client, fields: dict[str, Any], code: str, param: str | None, words: str
) -> None:
    r = http.post(PATH, json={"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["code"], error["param"]) == (code, param), error
    assert words in error["message"], error
    healthy(http)
