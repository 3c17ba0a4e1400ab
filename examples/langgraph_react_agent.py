"""LangGraph's prebuilt ReAct agent over ChatTalaria, served by Talaria.

Start a server with the embedded default models, then run the agent::

    talaria serve                                # http://127.0.0.1:8000
    python examples/langgraph_react_agent.py     # --base-url, --model, --thread-id, --api-key

The agent is ``langgraph.prebuilt.create_react_agent`` unchanged: it binds one tool, ``add``
(a LangChain ``@tool``), loops model -> tools -> model until the model answers without a
tool call, and keeps each thread's conversation in its checkpointer. The run's
``config={"configurable": {"thread_id": ...}}`` names the Talaria session of every model
call, and ``TalariaCallbackHandler`` turns the tool runs into tool-gap hints of that session.

Two questions are asked on the same thread; the second call's ``cached`` count (prompt
tokens whose KV the server reused) shows the session continuing. SmolLM2-135M writes its
tool call as ``<tool_call>`` text (the server reads it into OpenAI ``tool_calls``) when the
prompt shows two worked examples; greedy decoding keeps it repeatable. A model may still
answer without calling the tool, and a 135M model's prose may misstate the sum the tool
returned; the script prints what happened either way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from server_check import server_ready  # sibling module of the examples

SYSTEM = (
    "You can call one tool, add(a: integer, b: integer), which adds two numbers. To call it, "
    'reply with only: <tool_call>{"name": "add", "arguments": {"a": <a>, "b": <b>}}</tool_call>'
)
EXAMPLES = ((2, 3), (6, 1))  # worked examples shown before the thread's messages
QUESTIONS = ("Use the add tool: what is 12 plus 30?", "Use the add tool: what is 4 plus 7?")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="Talaria server")
    parser.add_argument("--model", default="smollm2-135m", help="a model the server serves")
    parser.add_argument("--thread-id", default=None, help="LangGraph thread (default: random)")
    parser.add_argument("--max-tokens", type=int, default=32, help="per answer (default 32)")
    parser.add_argument(
        "--api-key", default=os.environ.get("TALARIA_API_KEY"), help="if the server needs one"
    )
    args = parser.parse_args(argv)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    problem = server_ready(base_url, args.api_key, args.model)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    import openai
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )
    from langchain_core.messages.tool import tool_call
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.prebuilt import create_react_agent

    from talaria.integrations.langchain import ChatTalaria, TalariaCallbackHandler

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    examples: list[BaseMessage] = []
    for n, (a, b) in enumerate(EXAMPLES):
        call_id = f"example-{n}"
        examples += [
            HumanMessage(f"Use the add tool: what is {a} plus {b}?"),
            AIMessage("", tool_calls=[tool_call(name="add", args={"a": a, "b": b}, id=call_id)]),
            ToolMessage(str(a + b), tool_call_id=call_id),
            AIMessage(f"The add tool says {a} plus {b} is {a + b}."),
        ]

    def prompt(state: dict[str, Any]) -> list[BaseMessage]:
        return [SystemMessage(SYSTEM), *examples, *state["messages"]]

    llm = ChatTalaria(
        base_url=base_url,
        model=args.model,
        api_key=args.api_key,
        temperature=0.0,
        max_tokens=args.max_tokens,
        stop=["</tool_call>"],
    )
    agent = create_react_agent(llm, [add], prompt=prompt, checkpointer=InMemorySaver())
    hints = TalariaCallbackHandler(base_url, api_key=args.api_key)
    thread = args.thread_id or f"langgraph-{uuid.uuid4().hex[:8]}"
    config: RunnableConfig = {
        "configurable": {"thread_id": thread},  # the Talaria session
        "callbacks": [hints],
        "recursion_limit": 8,
    }
    print(f"thread (session) {thread} on {base_url} ({args.model})")
    started = time.perf_counter()
    seen = 0
    try:
        for question in QUESTIONS:
            print(f"\n[user] {question}")
            state = agent.invoke({"messages": [HumanMessage(question)]}, config)
            for message in state["messages"][seen + 1 :]:
                if isinstance(message, ToolMessage):
                    print(f"  [tool {message.name}] {message.content}")
                elif isinstance(message, AIMessage):
                    usage = message.usage_metadata
                    calls = [(c["name"], c["args"]) for c in message.tool_calls]
                    text = f"tool calls {calls}" if calls else repr(str(message.content).strip())
                    print(f"  [model] {text}")
                    if usage is not None:
                        cached = usage.get("input_token_details", {}).get("cache_read", 0)
                        session = message.response_metadata.get("session_id")
                        print(
                            f"    prompt {usage['input_tokens']} tokens, {cached} cached, "
                            f"session {session}"
                        )
            seen = len(state["messages"])
    except openai.APIConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        hints.end(thread)
        hints.close()
    print(f"\n{len(QUESTIONS)} questions in {time.perf_counter() - started:.1f} s, one session")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
