"""A small tool-calling agent on LangChain, served by Talaria.

Start a server with the embedded default models, then run the agent::

    talaria serve                        # http://127.0.0.1:8000
    python examples/langchain_agent.py   # --base-url, --model, --steps, --api-key

The model gets one tool, ``run_shell`` (a LangChain ``@tool`` bound with ``bind_tools``),
and two earlier turns in its history (each a call, its result and an answer). Each step
invokes the model; the server reads its tool calls into OpenAI ``tool_calls``
(``AIMessage.tool_calls`` here), which run through LangChain and come back as
``ToolMessage`` s. With ``--tool-choice run_shell`` (the default) the server opens each
answer as a call of ``run_shell`` and the model writes the command; with ``auto`` the model
decides, and the run ends at its first answer without a call. Harmless commands only
(``ls``, ``pwd``, ``date``, ``echo``, ``uname``; anything else runs ``ls``).

``TalariaCallbackHandler`` turns the tool runs into tool-gap hints; the run's
``thread_id`` is its Talaria session, so the printed ``cached`` count (prompt tokens whose
KV the server reused) grows from the second call on.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence

from server_check import server_ready  # sibling module of the examples

SYSTEM = "You are a shell assistant: you answer by running commands."
EXAMPLES = (  # (question, command, its output, the answer)
    ("Show the date.", "date", "Mon Dec  1 10:00:00 UTC 2026", "It is Monday, December 1."),
    ("Say hello.", "echo hello", "hello", "hello"),
)
TASK = "List the files in the current directory."
HARMLESS = {"ls", "pwd", "date", "echo", "uname"}


def run_shell_command(command: str) -> str:
    """Run ``command`` if it is on the harmless list, else ``ls``; its output."""
    try:
        argv = shlex.split(command)
    except ValueError:
        argv = []
    if not argv or argv[0] not in HARMLESS:
        argv = ["ls"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    return f"$ {shlex.join(argv)}\n{(done.stdout + done.stderr).strip()[:500]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="Talaria server")
    parser.add_argument("--model", default="smollm2-135m", help="a model the server serves")
    parser.add_argument("--steps", type=int, default=4, help="LLM calls (default 4)")
    parser.add_argument("--max-tokens", type=int, default=48, help="per answer (default 48)")
    parser.add_argument(
        "--tool-choice",
        default="run_shell",
        choices=["run_shell", "auto"],
        help="run_shell: every answer is a call the model writes; auto: the model decides",
    )
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

    from talaria.integrations.langchain import ChatTalaria, TalariaCallbackHandler

    @tool
    def run_shell(command: str) -> str:
        """Run a harmless shell command (ls, pwd, date, echo, uname) and return its output."""
        return run_shell_command(command)

    llm = ChatTalaria(
        base_url=base_url,
        model=args.model,
        api_key=args.api_key,
        temperature=0.0,
        max_tokens=args.max_tokens,
    )
    agent = llm.bind_tools([run_shell], tool_choice=args.tool_choice)
    hints = TalariaCallbackHandler(base_url, api_key=args.api_key)
    thread = f"langchain-agent-{uuid.uuid4().hex[:8]}"
    # LangGraph copies configurable.thread_id into the run metadata; plain LangChain does not
    config: RunnableConfig = {
        "configurable": {"thread_id": thread},
        "metadata": {"thread_id": thread},
        "callbacks": [hints],
    }
    messages: list[BaseMessage] = [SystemMessage(SYSTEM)]
    for n, (question, command, output, reply) in enumerate(EXAMPLES):
        call = tool_call(name="run_shell", args={"command": command}, id=f"example-{n}")
        messages += [
            HumanMessage(question),
            AIMessage("", tool_calls=[call]),
            ToolMessage(f"$ {command}\n{output}", tool_call_id=f"example-{n}"),
            AIMessage(reply),
        ]
    messages.append(HumanMessage(TASK))
    print(f"session {thread} on {base_url} ({args.model})")
    started = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            answer = agent.invoke(messages, config)
            usage = answer.usage_metadata
            prompt = usage["input_tokens"] if usage else 0
            cached = usage.get("input_token_details", {}).get("cache_read", 0) if usage else 0
            print(f"\n[call {step}] {str(answer.content).strip()!r}")
            print(f"  prompt {prompt} tokens, {cached} cached")
            calls = list(answer.tool_calls)
            print(f"  tool calls: {[(c['name'], c['args']) for c in calls]}")
            messages.append(AIMessage(content=answer.content, tool_calls=calls))
            if step == args.steps or not calls:
                break
            for call in calls:
                result = run_shell.invoke(call, config)
                print("[tool] " + str(result.content).replace("\n", "\n  "))
                messages.append(result)
    except (openai.APIConnectionError, openai.APIStatusError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        hints.end(thread)
        hints.close()
    calls_made = sum(isinstance(m, AIMessage) for m in messages) - 2 * len(EXAMPLES)
    print(f"\n{calls_made} calls in {time.perf_counter() - started:.1f} s, one session")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
