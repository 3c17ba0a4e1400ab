"""LangGraph's prebuilt ReAct agent (``langgraph.prebuilt.create_react_agent``) over
``ChatTalaria``, unchanged, against a live Talaria server on 127.0.0.1 serving SmolLM2-135M:
the graph binds the tools, runs the model / tool loop, and keeps the conversation per
``thread_id`` in its checkpointer; ``thread_id`` (``config["configurable"]``) names the
Talaria session of every model call and of every tool-gap hint.

Two tests. The first asserts only what holds whatever the 135M model answers (it may or may
not call the tool): the run completes with a final answer, every model call carries the
thread's session, a second ``invoke`` on the thread continues that session with cached
tokens, and any tool call the model made was run and reported as a gap. The second makes
the tool path deterministic without faking it: a two-example few-shot prompt (greedy
decoding) makes SmolLM2 write a ``<tool_call>`` itself, which the server returns as OpenAI
``tool_calls`` and ``ChatTalaria`` as ``AIMessage.tool_calls``; the graph's ``ToolNode``
runs the tool and the model answers.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import tool_call
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import create_react_agent

from talaria.integrations.langchain import ChatTalaria, TalariaCallbackHandler
from tests.integrations.live_server import MODEL, Served

# LangGraph 1.x marks create_react_agent as moved to `langchain.agents.create_agent` (the
# `langchain` package); it is still LangGraph's prebuilt agent, and the one tested here.
pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")

SYSTEM = (
    "You can call one tool, add(a: integer, b: integer), which adds two numbers. To call it, "
    'reply with only: <tool_call>{"name": "add", "arguments": {"a": <a>, "b": <b>}}</tool_call>'
)
RECURSION_LIMIT = 8  # bounds a model that keeps calling the tool (the agent then says so)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def worked_example(a: int, b: int, n: int) -> list[BaseMessage]:
    """One solved question in LangChain's own shapes: a tool call, its result, the answer."""
    call_id = f"example-{n}"
    return [
        HumanMessage(f"Use the add tool: what is {a} plus {b}?"),
        AIMessage("", tool_calls=[tool_call(name="add", args={"a": a, "b": b}, id=call_id)]),
        ToolMessage(str(a + b), tool_call_id=call_id),
        AIMessage(f"The add tool says {a} plus {b} is {a + b}."),
    ]


FEW_SHOT = [*worked_example(2, 3, 1), *worked_example(6, 1, 2)]


def agent(url: str, examples: Sequence[BaseMessage] = ()) -> CompiledStateGraph[Any]:
    """The prebuilt ReAct agent with ``add``; the system prompt and ``examples`` are put
    before the thread's messages on each model call (not stored in the thread)."""
    llm = ChatTalaria(
        base_url=url, model=MODEL, temperature=0.0, max_tokens=32, stop=["</tool_call>"]
    )

    def prompt(state: dict[str, Any]) -> list[BaseMessage]:
        return [SystemMessage(SYSTEM), *examples, *state["messages"]]

    graph: CompiledStateGraph[Any] = create_react_agent(
        llm, [add], prompt=prompt, checkpointer=InMemorySaver()
    )
    return graph


def config(thread: str, hints: TalariaCallbackHandler) -> RunnableConfig:
    return {
        "configurable": {"thread_id": thread},
        "callbacks": [hints],
        "recursion_limit": RECURSION_LIMIT,
    }


def cache_read(ai: AIMessage) -> int:
    assert ai.usage_metadata is not None
    return int(ai.usage_metadata.get("input_token_details", {}).get("cache_read", 0))


def model_answers(messages: Sequence[BaseMessage]) -> list[AIMessage]:
    """The AIMessages the model wrote (with usage), not the agent's own step-limit notice."""
    return [m for m in messages if isinstance(m, AIMessage) and m.usage_metadata is not None]


def check_completed(messages: Sequence[BaseMessage]) -> None:
    last = messages[-1]
    assert isinstance(last, AIMessage) and not last.tool_calls, last
    assert str(last.content).strip()


def check_tools_ran(messages: Sequence[BaseMessage]) -> int:
    """Every tool call the model made has its ToolMessage with ``add``'s true result;
    returns how many there were."""
    results = {m.tool_call_id: m for m in messages if isinstance(m, ToolMessage)}
    calls = [c for m in model_answers(messages) for c in m.tool_calls]
    for call in calls:
        assert call["name"] == "add"
        result = results[str(call["id"])]
        assert result.status == "success", result
        assert result.content == str(call["args"]["a"] + call["args"]["b"])
    return len(calls)


def check_hints(served: Served, thread: str, tool_runs: int) -> None:
    """One tool_start / tool_end pair per tool run (the gap measured), then the end (which
    the handler sends only for a session it has seen a tool run of)."""
    events = served.recorder.events_of(thread)
    kinds = [e["event"] for e in events]
    expected = ["tool_start", "tool_end"] * tool_runs + (["end"] if tool_runs else [])
    assert kinds == expected, kinds
    assert all(e["accepted"] for e in events)
    assert all(e["tool"] == "add" for e in events if e["event"] == "tool_start")
    assert all(0 < e["measured_s"] < 30 for e in events if e["event"] == "tool_end")


def test_react_agent_thread_is_one_session_whatever_the_model_does(served: Served) -> None:
    thread = f"lg-thread-{uuid.uuid4().hex[:8]}"
    hints = TalariaCallbackHandler(served.url)
    graph = agent(served.url)
    sessions_before = served.talaria.stats()["sessions"]["total"]
    calls_before = len(served.recorder.calls)

    first = graph.invoke({"messages": [HumanMessage("What is 4 plus 7?")]}, config(thread, hints))
    check_completed(first["messages"])
    answers_first = model_answers(first["messages"])
    assert answers_first

    second = graph.invoke(
        {"messages": [HumanMessage("And what is 10 plus 20?")]}, config(thread, hints)
    )
    messages = second["messages"]
    check_completed(messages)
    assert messages[: len(first["messages"])] == first["messages"]  # the thread continued
    answers = model_answers(messages)
    answers_second = answers[len(answers_first) :]
    assert answers_second

    calls = served.recorder.calls[calls_before:]
    assert calls == [thread] * len(answers), calls  # every model call, one session
    assert all(a.response_metadata["session_id"] == thread for a in answers)
    assert served.talaria.stats()["sessions"]["total"] - sessions_before == 1
    # the second invoke's first call re-reads the thread's earlier turns from the cache
    first_prompt = answers_first[-1].usage_metadata
    assert first_prompt is not None
    cached = cache_read(answers_second[0])
    assert cached > 0 and cached >= first_prompt["input_tokens"] // 2, (cached, first_prompt)

    tool_runs = check_tools_ran(messages)
    hints.end(thread)
    assert hints.flush(5.0)
    check_hints(served, thread, tool_runs)
    cached_all = [cache_read(a) for a in answers]
    print(f"tool calls by the model: {tool_runs}; cached tokens: {cached_all}")
    hints.close()


def test_react_agent_runs_the_tool_the_model_calls(served: Served) -> None:
    thread = f"lg-tool-{uuid.uuid4().hex[:8]}"
    hints = TalariaCallbackHandler(served.url)
    graph = agent(served.url, FEW_SHOT)
    calls_before = len(served.recorder.calls)

    out = graph.invoke(
        {"messages": [HumanMessage("Use the add tool: what is 12 plus 30?")]},
        config(thread, hints),
    )
    messages = out["messages"]
    check_completed(messages)
    answers = model_answers(messages)
    # the model's own output, read by the server into tool_calls; none is made up here
    assert (
        answers[0].content == "" and answers[0].response_metadata["finish_reason"] == "tool_calls"
    )
    assert [(c["name"], c["args"]) for c in answers[0].tool_calls] == [("add", {"a": 12, "b": 30})]
    assert check_tools_ran(messages) >= 1
    tool_messages = [m for m in messages if isinstance(m, ToolMessage)]
    assert tool_messages[0].content == "42"

    calls = served.recorder.calls[calls_before:]
    assert calls == [thread] * len(answers) and len(calls) >= 2, calls
    assert all(cache_read(a) > 0 for a in answers[1:])  # the tool gap kept the session's KV
    hints.end(thread)
    assert hints.flush(5.0)
    check_hints(served, thread, len(tool_messages))
    hints.close()
