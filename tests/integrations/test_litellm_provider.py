"""The LiteLLM provider end to end: LiteLLM's own ``completion`` / ``acompletion`` (plain
and streamed) against a live Talaria server on 127.0.0.1 serving SmolLM2-135M, with real
tool runs between calls; plus errors, an unreachable server, the embedded backend, and the
pure helpers.

One server per module (loading takes ~15-30 s). The server's backend is wrapped in a
recorder, so the tests see what the server received: the session id of every call and
every hint event with its fields.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import

import litellm
from litellm import exceptions as lx

from talaria.integrations.litellm import EmbeddedTalaria, HttpBackend, TalariaLLM, register
from talaria.integrations.litellm.call import Answer, Call, Piece, ToolCall, Usage
from talaria.integrations.litellm.provider import (
    _chunks_of,
    _session_and_headers,
)
from talaria.session import HintStats, HttpSink, SessionTracker
from tests.gates import LIVENESS_S, GatedSink, returns_while_held
from tests.integrations.live_server import MODEL, TINY, Served

LLM = f"talaria/{MODEL}"
SYSTEM = "You are a shell assistant. Reply with one shell command in a ```bash block."
FAST = {"max_tokens": 8, "temperature": 0.0}


# --- a live server over a recording backend ---------------------------------------------------


@pytest.fixture
def handler() -> Iterator[TalariaLLM]:
    h = register(TalariaLLM())
    yield h
    h.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def bash_block(text: str) -> str | None:
    """The command in the first ```bash block of ``text``, if any."""
    if "```bash" not in text:
        return None
    body = text.split("```bash", 1)[1].split("```", 1)[0].strip()
    return body.splitlines()[0] if body else None


def run_tool(command: str | None) -> str:
    """The agent's tool: a harmless real command. The model's proposal runs when it is
    ``ls`` or ``pwd``; anything else is replaced by ``ls`` (a 135M model proposes at random)."""
    argv = ["ls"] if command not in ("ls", "pwd") else [command]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    return (done.stdout or done.stderr)[:200]


def cached(usage: Any) -> int:
    details = usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def check_run(served: Served, session_id: str, calls_before: int, cached_tokens: list[int]) -> None:
    """What the issue asks of an agent run: one session for all its calls, cached tokens from
    the second call on, every gap hint received (tool_end with its measured seconds)."""
    calls = served.recorder.calls[calls_before:]
    assert calls == [session_id] * len(cached_tokens)
    assert len(calls) >= 3
    assert all(c > 0 for c in cached_tokens[1:]), cached_tokens
    events = served.recorder.events_of(session_id)
    kinds = [e["event"] for e in events]
    gaps = len(cached_tokens) - 1
    assert kinds == ["tool_start", "tool_end"] * gaps + ["end"], kinds
    assert all(e["accepted"] for e in events)
    starts = [e for e in events if e["event"] == "tool_start"]
    ends = [e for e in events if e["event"] == "tool_end"]
    assert all(e["tool"] == "bash" and e["expected_s"] > 0 for e in starts)
    assert all(0 < e["measured_s"] < 30 for e in ends)


# --- end to end -------------------------------------------------------------------------------


def test_sync_agent_loop_one_session_cached_tokens_and_gap_hints(
    served: Served, handler: TalariaLLM
) -> None:
    before = served.talaria.stats()["sessions"]["total"]
    calls_before = len(served.recorder.calls)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "List the files in the current directory."},
    ]
    cached_tokens = []
    with handler.session(served.url) as session:
        for turn in range(3):
            if turn == 1:  # the streamed path, in the same loop
                chunks = list(
                    litellm.completion(
                        model=LLM,
                        messages=messages,
                        api_base=served.url,
                        litellm_session_id=session.session_id,
                        stream=True,
                        stream_options={"include_usage": True},
                        **FAST,
                    )
                )
                response: Any = litellm.stream_chunk_builder(chunks, messages=messages)
            else:
                response = litellm.completion(
                    model=LLM,
                    messages=messages,
                    api_base=served.url,
                    litellm_session_id=session.session_id,
                    **FAST,
                )
            text = response.choices[0].message.content
            assert isinstance(text, str) and text
            cached_tokens.append(cached(response.usage))
            messages.append({"role": "assistant", "content": text})
            if turn < 2:
                command = bash_block(text)
                session.tool_started("bash", command=command or "ls")
                output = run_tool(command)
                session.tool_ended()
                messages.append({"role": "user", "content": f"Output:\n{output}\nWhat next?"})
    assert handler.hint_sender(served.url).flush(5.0)
    check_run(served, session.session_id, calls_before, cached_tokens)
    assert session.stats().sent == 5 and session.stats().failed == 0
    stats = served.talaria.stats()["sessions"]
    assert stats["total"] - before == 1  # one session for the whole agent run


def test_async_agent_loop_streamed_and_whole(served: Served, handler: TalariaLLM) -> None:
    async def agent() -> tuple[str, list[int], list[str]]:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Print the Python version."},
        ]
        cached_tokens: list[int] = []
        texts: list[str] = []
        async with handler.session(served.url) as session:
            for turn in range(3):
                common = {
                    "model": LLM,
                    "messages": messages,
                    "api_base": served.url,
                    "metadata": {"session_id": session.session_id},
                    **FAST,
                }
                if turn == 1:
                    response: Any = await litellm.acompletion(**common)
                    text = response.choices[0].message.content
                    usage = response.usage
                else:
                    stream: Any = await litellm.acompletion(
                        stream=True, stream_options={"include_usage": True}, **common
                    )
                    parts, usage = [], None
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            parts.append(chunk.choices[0].delta.content)
                        usage = getattr(chunk, "usage", None) or usage
                    text = "".join(parts)
                texts.append(text)
                cached_tokens.append(cached(usage))
                messages.append({"role": "assistant", "content": text})
                if turn < 2:
                    session.tool_started("bash", command="python -c 'import sys'")
                    proc = await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-c",
                        "import sys; print(sys.version)",
                        stdout=asyncio.subprocess.PIPE,
                    )
                    out, _ = await proc.communicate()
                    session.tool_ended()
                    messages.append({"role": "user", "content": f"Output: {out.decode()[:60]}"})
        await handler.hint_sender(served.url).aflush(5.0)
        return session.session_id, cached_tokens, texts

    calls_before = len(served.recorder.calls)
    sid, cached_tokens, texts = asyncio.run(agent())
    assert all(texts)
    check_run(served, sid, calls_before, cached_tokens)


def test_embedded_backend_without_api_base(served: Served, handler: TalariaLLM) -> None:
    handler.attach_embedded(served.recorder, served.loop)  # type: ignore[arg-type]
    calls_before = len(served.recorder.calls)
    messages = [{"role": "user", "content": "Say hi."}]
    with handler.session(session_id="embedded-run-1") as session:
        first = litellm.completion(
            model=LLM, messages=messages, litellm_session_id=session.session_id, **FAST
        )
        session.tool_started("bash", command="true")
        session.tool_ended()
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Again."},
        ]
        pieces = list(
            litellm.completion(
                model=LLM,
                messages=messages,
                litellm_session_id=session.session_id,
                stream=True,
                stream_options={"include_usage": True},
                **FAST,
            )
        )
    second: Any = litellm.stream_chunk_builder(pieces, messages=messages)
    assert cached(second.usage) > 0
    assert served.recorder.calls[calls_before:] == ["embedded-run-1"] * 2
    assert handler.hint_sender().flush(5.0)
    assert session.stats().sent == 3 and session.stats().failed == 0
    with pytest.raises(lx.NotFoundError):
        litellm.completion(model="talaria/no-such-model", messages=messages)


def test_backends_on_the_callers_event_loop(served: Served) -> None:
    """The async paths LiteLLM takes when it calls the provider inside a running loop
    (the HTTP backend's ``achat`` runs in the async agent loop above)."""
    http = HttpBackend(served.url)
    embedded = EmbeddedTalaria.attach(served.recorder, served.loop)  # type: ignore[arg-type]
    messages = [{"role": "user", "content": "Count to three."}]
    call = Call(MODEL, messages, dict(FAST), "async-backends", timeout_s=60)

    async def run() -> tuple[Answer, list[Piece], list[Piece]]:
        whole = await embedded.achat(call)
        streamed = [p async for p in http.astream(call)]
        return whole, streamed, [p async for p in embedded.astream(call)]

    calls_before = len(served.recorder.calls)
    whole, *streams = asyncio.run(run())
    assert served.recorder.calls[calls_before:] == ["async-backends"] * 3
    assert whole.text and whole.session_id == "async-backends" and whole.instance
    for pieces in streams:
        assert "".join(p.text for p in pieces)
        last = pieces[-1]
        assert last.finish_reason and last.usage is not None and last.usage.cached_tokens > 0
    http.close()


# --- errors -----------------------------------------------------------------------------------


def test_unknown_model_is_litellm_not_found(served: Served, handler: TalariaLLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(lx.NotFoundError, match="does not exist"):
        litellm.completion(model="talaria/no-such-model", messages=messages, api_base=served.url)
    with pytest.raises(lx.NotFoundError):
        litellm.completion(
            model="talaria/no-such-model", messages=messages, api_base=served.url, stream=True
        )

    with pytest.raises(lx.NotFoundError):  # raised by the await, as built-ins do
        asyncio.run(
            litellm.acompletion(
                model="talaria/no-such-model", messages=messages, api_base=served.url, stream=True
            )
        )


def test_refused_option_is_litellm_bad_request(served: Served, handler: TalariaLLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(lx.BadRequestError, match="n=2"):
        litellm.completion(model=LLM, messages=messages, api_base=served.url, n=2)
    with pytest.raises(lx.BadRequestError):
        asyncio.run(
            litellm.acompletion(
                model=LLM, messages=messages, api_base=served.url, logit_bias={"1": 5.0}
            )
        )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def weather_question(city: str) -> list[dict[str, Any]]:
    """An earlier turn (a call, its result, the answer), then the question about ``city``."""
    call = {
        "id": "call_rome",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    return [
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_rome", "content": '{"weather": "sunny"}'},
        {"role": "assistant", "content": "It is sunny in Rome."},
        {"role": "user", "content": f"What is the weather in {city}?"},
    ]


@pytest.mark.parametrize("backend", ["http", "embedded"])
def test_tool_calls_and_vllm_fields_through_both_backends(
    served: Served, handler: TalariaLLM, backend: str
) -> None:
    """The server's (or the in-process API's) tool calls come back as LiteLLM's
    ``message.tool_calls`` and streamed ``tool_calls`` deltas; vLLM's fields reach the
    engine through either backend; logprobs, which an answer here cannot carry, are refused."""
    if backend == "embedded":
        handler.attach_embedded(served.recorder, served.loop)  # type: ignore[arg-type]
    where: dict[str, Any] = {"api_base": served.url} if backend == "http" else {}
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = {"tools": [WEATHER], "tool_choice": named, "temperature": 0.0, "max_tokens": 24}
    answer: Any = litellm.completion(model=LLM, messages=weather_question("Paris"), **ask, **where)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)
    chunks = list(
        litellm.completion(
            model=LLM, messages=weather_question("Paris"), stream=True, **ask, **where
        )
    )
    streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in streamed] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    long: Any = litellm.completion(
        model=LLM,
        messages=[{"role": "user", "content": "Say yes."}],
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        **where,
    )
    assert long.usage.completion_tokens == 12 and long.choices[0].finish_reason == "length"
    with pytest.raises(lx.BadRequestError, match="logprobs"):
        litellm.completion(model=LLM, messages=weather_question("Oslo"), logprobs=True, **where)


def test_unreachable_server_fails_fast_and_hints_drop_quietly(handler: TalariaLLM) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    messages = [{"role": "user", "content": "hi"}]
    started = time.monotonic()
    with pytest.raises(lx.APIConnectionError, match="talaria serve"):
        litellm.completion(model=LLM, messages=messages, api_base=dead, timeout=30)
    with pytest.raises(lx.APIConnectionError):
        asyncio.run(litellm.acompletion(model=LLM, messages=messages, api_base=dead, stream=True))
    assert time.monotonic() - started < 10

    # hints never block the agent: hold every delivery to the dead server at a gate
    sender = handler.hint_sender(dead)  # the one the session below gets
    assert isinstance(sender.sink, HttpSink) and sender.pending == 0
    sender.sink = gate = GatedSink(sender.sink)

    def agent() -> SessionTracker:
        with handler.session(dead) as session:
            session.tool_started("bash", command="ls")
            session.tool_ended()
        return session

    session = returns_while_held(agent, "the session's tool_started / tool_ended / end", gate.open)
    assert session.hints is sender
    assert gate.entered.wait(LIVENESS_S)
    assert sender.pending == 3 and session.stats() == HintStats()  # none delivered yet
    gate.open.set()
    assert sender.flush(LIVENESS_S)
    assert session.stats() == HintStats(failed=3)  # refused, counted, never raised


# --- pure helpers -----------------------------------------------------------------------------


def test_session_id_precedence() -> None:
    lp = {"litellm_session_id": "from-litellm", "metadata": {"session_id": "from-metadata"}}
    sid, hdrs = _session_and_headers({}, {}, lp, {"X-Session-ID": "hdr", "X-Other": "1"})
    assert (sid, hdrs) == ("hdr", {"X-Other": "1"})
    assert _session_and_headers({"session_id": "arg"}, {}, lp, {})[0] == "arg"
    assert _session_and_headers({}, {"session_id": "body"}, lp, {})[0] == "body"
    assert _session_and_headers({}, {}, lp, None)[0] == "from-litellm"
    assert _session_and_headers({}, {}, {"metadata": {"session_id": "m"}}, None)[0] == "m"
    assert _session_and_headers({}, {}, {}, None)[0] is None
    spaced = _session_and_headers({"session_id": "has space"}, {}, None, None)[0]
    assert spaced is not None and spaced.startswith("sess-")  # normalized for the wire


def test_server_tool_calls_become_litellm_tool_calls() -> None:
    """The backends' tool calls (the server read them) reach LiteLLM as ``tool_use`` chunks
    and ``message.tool_calls``; the provider parses no text."""
    call = ToolCall(0, "call_1", "run_shell", '{"command": "ls"}')
    pieces = [Piece("", tool_calls=(call,)), Piece("", "tool_calls", Usage(10, 5, 8))]
    chunks = [c for p in pieces for c in _chunks_of(p)]
    tool_chunks = [c for c in chunks if c.get("tool_use")]
    assert [c["tool_use"] for c in tool_chunks] == [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "run_shell", "arguments": '{"command": "ls"}'},
        }
    ]
    assert chunks[-1]["finish_reason"] == "tool_calls" and chunks[-1]["is_finished"]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}  # type: ignore[index]
    text = '<tool_call>{"name": "run_shell", "arguments": {"command": "ls"}}</tool_call>'
    plain = [c for p in (Piece(text), Piece("", "stop")) for c in _chunks_of(p)]
    assert not any(c.get("tool_use") for c in plain) and plain[0]["text"] == text

    answer = Answer("", "tool_calls", Usage(10, 5, 8), tool_calls=(call,))
    response = TalariaLLM()._response(litellm.ModelResponse(), MODEL, answer)
    choice: Any = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "run_shell"
    assert choice.message.tool_calls[0].function.arguments == '{"command": "ls"}'
    assert choice.message.tool_calls[0].id == "call_1"
    assert response.usage.prompt_tokens_details.cached_tokens == 8  # type: ignore[attr-defined]


@pytest.mark.slow
def test_embedded_talaria_started_lazily_and_closed() -> None:
    handler = register(TalariaLLM(embedded_config=TINY))
    try:
        answer: Any = litellm.completion(
            model=LLM, messages=[{"role": "user", "content": "hi"}], **FAST
        )
        assert answer.choices[0].message.content
    finally:
        handler.close()
