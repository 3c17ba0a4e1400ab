"""ChatTalaria and TalariaCallbackHandler end to end: LangChain's own tool-calling machinery
(``@tool``, ``bind_tools``, ``invoke`` / ``stream`` / ``ainvoke`` / ``astream``, tools run
with callbacks) against a live Talaria server on 127.0.0.1 serving SmolLM2-135M; plus
errors, an unreachable server, and the pure parts (tool-call parsing, session ids).

One server per module (loading takes ~15-30 s). The server's backend is wrapped in a
recorder, so the tests see what the server received: the session id of every call and
every hint event with its fields.

A 135M model does not reliably call tools. The loops let it try (greedy decoding, a
one-shot example of the ``<tool_call>`` format) and, when an answer holds no tool call,
the test drives the loop itself with a call to the same tool, still through LangChain's
``AIMessage.tool_calls`` / ``tool.invoke(call)`` / ``ToolMessage`` path.
"""

from __future__ import annotations

import asyncio
import shlex
import socket
import subprocess
import time
import uuid
from typing import Any

import openai
import pytest
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import ToolCall, tool_call
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langchain_core.tools import tool

from talaria.integrations.langchain import ChatTalaria, TalariaCallbackHandler
from talaria.integrations.langchain.chat_model import SESSION_KWARG, _session_id
from talaria.session import HintSender
from tests.integrations.live_server import MODEL, Served

SYSTEM = "You are a shell assistant: you answer by running commands."
EXAMPLE = [  # two earlier turns: the server renders their calls for SmolLM2's template
    HumanMessage("Show the date."),
    AIMessage("", tool_calls=[tool_call(name="run_shell", args={"command": "date"}, id="ex-1")]),
    ToolMessage("$ date\nMon Dec  1 10:00:00 UTC 2026", tool_call_id="ex-1"),
    AIMessage("It is Monday, December 1."),
    HumanMessage("Say hello."),
    AIMessage(
        "", tool_calls=[tool_call(name="run_shell", args={"command": "echo hello"}, id="ex-2")]
    ),
    ToolMessage("$ echo hello\nhello", tool_call_id="ex-2"),
    AIMessage("hello"),
]
ALLOWED = {"ls", "pwd", "date", "echo"}
TOKENS = 48  # max_tokens per call: room for a call's arguments


@tool
def run_shell(command: str) -> str:
    """Run a harmless shell command (ls, pwd, date or echo; anything else runs ls)."""
    argv = shlex.split(command) if command.strip() else []
    if not argv or argv[0] not in ALLOWED:
        argv = ["ls"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    return f"$ {shlex.join(argv)}\n{(done.stdout or done.stderr)[:200]}"


def llm(url: str, **kwargs: Any) -> ChatTalaria:
    """Greedy; calls set ``max_tokens``."""
    return ChatTalaria(base_url=url, model=MODEL, temperature=0.0, **kwargs)


def agent_of(url: str) -> Any:
    """The model with ``run_shell`` bound and chosen: every answer is a call the model
    writes (the server opens it and reads it; nothing here makes one up)."""
    return llm(url).bind_tools([run_shell], tool_choice="run_shell")


def start_messages(task: str) -> list[BaseMessage]:
    return [SystemMessage(SYSTEM), *EXAMPLE, HumanMessage(task)]


def model_calls(ai: AIMessage) -> list[ToolCall]:
    """The calls the server read from the model's answer (there must be one)."""
    assert ai.tool_calls, ai
    assert all(c["name"] == "run_shell" and isinstance(c["args"], dict) for c in ai.tool_calls)
    assert all(str(c["id"]).startswith("call_") for c in ai.tool_calls)
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    return list(ai.tool_calls)


def merge(chunks: list[Any]) -> AIMessageChunk:
    """A streamed answer's chunks added up (LangChain's own merge)."""
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks)
    merged: AIMessageChunk = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    return merged


def cache_read(ai: AIMessage | AIMessageChunk) -> int:
    usage = ai.usage_metadata
    assert usage is not None
    return int(usage.get("input_token_details", {}).get("cache_read", 0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def check_run(served: Served, session_id: str, calls_before: int, cached: list[int]) -> None:
    """One session for every call of the run, cached tokens from the second call on, every
    gap hint received (tool_end with its measured seconds), then the end."""
    calls = served.recorder.calls[calls_before:]
    assert len(calls) >= 3 and calls == [session_id] * len(cached)
    assert all(c > 0 for c in cached[1:]), cached
    events = served.recorder.events_of(session_id)
    kinds = [e["event"] for e in events]
    gaps = len(cached) - 1
    assert kinds == ["tool_start", "tool_end"] * gaps + ["end"], kinds
    assert all(e["accepted"] for e in events)
    starts = [e for e in events if e["event"] == "tool_start"]
    ends = [e for e in events if e["event"] == "tool_end"]
    assert all(e["tool"] == "run_shell" and e["expected_s"] > 0 for e in starts)
    assert all(0 < e["measured_s"] < 30 for e in ends)


# --- end to end -------------------------------------------------------------------------------


def test_sync_tool_loop_one_session_cached_tokens_and_gap_hints(served: Served) -> None:
    sid = f"lc-sync-{uuid.uuid4().hex[:8]}"
    hints = TalariaCallbackHandler(served.url)
    config: RunnableConfig = {"metadata": {"session_id": sid}, "callbacks": [hints]}
    agent = agent_of(served.url)
    messages = start_messages("List the files in the current directory.")
    before = served.talaria.stats()["sessions"]["total"]
    calls_before = len(served.recorder.calls)
    cached: list[int] = []
    for turn in range(3):
        if turn == 1:  # the streamed path, in the same loop
            merged = merge(list(agent.stream(messages, config, max_tokens=TOKENS)))
            ai: AIMessage = AIMessage(
                content=merged.content,
                tool_calls=merged.tool_calls,
                usage_metadata=merged.usage_metadata,
                response_metadata=merged.response_metadata,
            )
        else:
            ai = agent.invoke(messages, config, max_tokens=TOKENS)
        assert ai.response_metadata["session_id"] == sid
        cached.append(cache_read(ai))
        calls = model_calls(ai)
        messages.append(AIMessage(content=ai.content, tool_calls=calls))
        if turn < 2:
            for call in calls:
                result = run_shell.invoke(call, config)
                assert isinstance(result, ToolMessage) and str(result.content).startswith("$ ")
                messages.append(result)
    hints.end(sid)
    assert hints.flush(5.0)
    print(f"cached tokens per call: {cached}")
    check_run(served, sid, calls_before, cached)
    assert served.talaria.stats()["sessions"]["total"] - before == 1
    hints.close()


def test_async_agent_steps_with_thread_id(served: Served) -> None:
    """LangGraph-style ``configurable.thread_id``; each step a runnable whose child runs
    are the model call and the tool runs, so the handler finds the tools' session through
    their parent."""
    thread = f"lc-thread-{uuid.uuid4().hex[:8]}"
    hints = TalariaCallbackHandler(served.url)
    agent = agent_of(served.url)

    async def step(messages: list[BaseMessage], config: RunnableConfig) -> list[BaseMessage]:
        turn = sum(isinstance(m, AIMessage) for m in messages[len(EXAMPLE) + 1 :])
        if turn == 1:
            ai = await agent.ainvoke(messages, config, max_tokens=TOKENS)
        else:
            merged = merge([c async for c in agent.astream(messages, config, max_tokens=TOKENS)])
            ai = AIMessage(
                content=merged.content,
                tool_calls=merged.tool_calls,
                usage_metadata=merged.usage_metadata,
                response_metadata=merged.response_metadata,
            )
        calls = model_calls(ai)
        out: list[BaseMessage] = [
            AIMessage(content=ai.content, tool_calls=calls, usage_metadata=ai.usage_metadata)
        ]
        if turn < 2:
            for call in calls:
                out.append(await run_shell.ainvoke(call, config))
        return messages + out

    async def run() -> list[BaseMessage]:
        config: RunnableConfig = {"configurable": {"thread_id": thread}, "callbacks": [hints]}
        messages = start_messages("List the files here.")
        runnable = RunnableLambda(step)
        for _ in range(3):
            messages = await runnable.ainvoke(messages, config)
        hints.end(thread)
        await hints.hints.aflush(5.0)
        return messages

    calls_before = len(served.recorder.calls)
    messages = asyncio.run(run())
    answers = [m for m in messages[len(EXAMPLE) + 2 :] if isinstance(m, AIMessage)]
    check_run(served, thread, calls_before, [cache_read(a) for a in answers])
    hints.close()


# --- errors -----------------------------------------------------------------------------------


def test_unknown_model_is_openai_not_found(served: Served) -> None:
    model = ChatTalaria(base_url=served.url, model="no-such-model", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        model.invoke("hi")
    with pytest.raises(openai.NotFoundError):
        list(model.stream("hi"))
    with pytest.raises(openai.NotFoundError):
        asyncio.run(model.ainvoke("hi"))


def test_unreachable_server_fails_fast_and_hints_drop_quietly() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    model = ChatTalaria(base_url=dead, model=MODEL, max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.APIConnectionError, match="talaria serve"):
        model.invoke("hi")
    with pytest.raises(openai.APIConnectionError):
        asyncio.run(model.ainvoke("hi"))
    assert time.monotonic() - started < 5
    hints = TalariaCallbackHandler(dead)
    config: RunnableConfig = {"metadata": {"session_id": "lost"}, "callbacks": [hints]}
    started = time.monotonic()
    run_shell.invoke({"command": "pwd"}, config)
    hints.end("lost")
    assert time.monotonic() - started < 2  # the tool's own time; hints never block
    assert hints.flush(5.0)
    assert hints.hints.stats().failed == 3 and hints.hints.stats().sent == 0
    hints.close()


# --- pure parts -------------------------------------------------------------------------------


def test_session_id_precedence() -> None:
    config = {"metadata": {"session_id": "meta"}, "configurable": {"thread_id": "thread"}}
    assert _session_id({"session_id": "arg"}, config, "field") == "arg"
    assert _session_id({SESSION_KWARG: "found"}, config, "field") == "found"
    assert _session_id({}, config, "field") == "meta"
    assert _session_id({}, {"configurable": {"thread_id": "thread"}}, "field") == "thread"
    assert _session_id({}, {}, "field") == "field"
    assert _session_id({}, None, None) is None
    spaced = _session_id({"session_id": "a b"}, None, None)
    assert spaced is not None and spaced.startswith("sess-")


def test_callback_handler_finds_the_session_of_a_tool_run() -> None:
    received: list[tuple[str, str, dict[str, Any]]] = []

    def sink(session_id: str, event: str, **fields: Any) -> None:
        received.append((session_id, event, fields))

    sender = HintSender.in_process(sink)
    hints = TalariaCallbackHandler(hints=sender, session_id="fallback")
    # from the tool run's own metadata (thread_id when no session_id)
    run_shell.invoke({"command": "pwd"}, {"metadata": {"thread_id": "t1"}, "callbacks": [hints]})
    # from the parent: a step whose model child carried the session
    step_id, model_id, tool_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    hints.on_chain_start({}, {}, run_id=step_id)
    hints.on_chat_model_start(
        {}, [], run_id=model_id, parent_run_id=step_id, metadata={"session_id": "s2"}
    )
    hints.on_tool_start(
        {"name": "bash"}, "ls", run_id=tool_id, parent_run_id=step_id, inputs={"command": "ls -l"}
    )
    hints.on_tool_error(RuntimeError("boom"), run_id=tool_id)
    # from the model answer that asked for it, by tool call id
    model_run = uuid.uuid4()
    hints.on_chat_model_start({}, [], run_id=model_run, metadata={"session_id": "s3"})
    answer = AIMessage("", tool_calls=[tool_call(name="run_shell", args={}, id="tc-1")])
    hints.on_llm_end(LLMResult(generations=[[ChatGeneration(message=answer)]]), run_id=model_run)
    run_shell.invoke(
        {"type": "tool_call", "name": "run_shell", "args": {"command": "pwd"}, "id": "tc-1"},
        {"callbacks": [hints]},
    )
    # none of these: the handler's own session
    run_shell.invoke({"command": "pwd"}, {"callbacks": [hints]})
    assert sender.flush(5.0)
    kinds = [(s, e) for s, e, _ in received]
    assert kinds == [
        ("t1", "tool_start"),
        ("t1", "tool_end"),
        ("s2", "tool_start"),
        ("s2", "tool_end"),
        ("s3", "tool_start"),
        ("s3", "tool_end"),
        ("fallback", "tool_start"),
        ("fallback", "tool_end"),
    ]
    assert received[2][2]["tool"] == "bash" and received[3][2]["measured_s"] >= 0
    hints.close()
    sender.close()
