"""A small shell agent on LiteLLM, served by Talaria.

Start a server with the embedded default models, then run the agent::

    talaria serve                      # http://127.0.0.1:8000
    python examples/litellm_agent.py   # --base-url, --model, --steps, --api-key

Each step asks the model (through ``litellm.completion(model="talaria/<model>")``) for a
shell command, runs it when it is harmless (``ls``, ``pwd``, ``date``, ``echo``, ``uname``,
``python --version``; anything else runs ``ls`` instead), and sends the output back. Every
call of the run carries one session id, so the server keeps the conversation's KV between
calls: the printed ``cached`` count is the prompt tokens it did not recompute. The tool runs
are reported to the server as tool-gap hints.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from server_check import server_ready  # sibling module of the examples

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import

SYSTEM = (
    "You are a shell assistant working in a Linux terminal. Reply with exactly one shell "
    "command in a ```bash block, and nothing else."
)
TASK = "Find out which directory you are in and what files it holds."
HARMLESS = {"ls", "pwd", "date", "echo", "uname"}


def command_in(text: str) -> str:
    """The command the model proposed: the first line of its first code block, else its
    first line."""
    if "```" in text:
        body = text.split("```", 2)[1]
        lines = body.splitlines()[1:] if "\n" in body else [body]
        return next((ln.strip() for ln in lines if ln.strip()), "")
    return text.strip().splitlines()[0].strip("` ") if text.strip() else ""


def run_harmless(command: str) -> tuple[str, str]:
    """Run ``command`` if it is on the harmless list, else ``ls``; (what ran, its output)."""
    try:
        argv = shlex.split(command)
    except ValueError:
        argv = []
    python_version = argv[:1] in (["python"], ["python3"]) and argv[1:] in (["--version"], ["-V"])
    if python_version:
        argv = [sys.executable, "--version"]
    elif not argv or argv[0] not in HARMLESS:
        argv = ["ls"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    return shlex.join(argv), (done.stdout + done.stderr).strip()[:500]


def cached_tokens(usage: Any) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    return int(getattr(details, "cached_tokens", 0) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="Talaria server")
    parser.add_argument("--model", default="smollm2-135m", help="a model the server serves")
    parser.add_argument("--steps", type=int, default=4, help="LLM calls (default 4)")
    parser.add_argument("--max-tokens", type=int, default=48, help="per answer (default 48)")
    parser.add_argument(
        "--api-key", default=os.environ.get("TALARIA_API_KEY"), help="if the server needs one"
    )
    args = parser.parse_args(argv)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    problem = server_ready(base_url, args.api_key, args.model)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    import litellm

    from talaria.integrations.litellm import register

    talaria = register()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASK},
    ]
    started = time.perf_counter()
    try:
        with talaria.session(base_url, api_key=args.api_key) as session:
            print(f"session {session.session_id} on {base_url} ({args.model})")
            for step in range(1, args.steps + 1):
                response: Any = litellm.completion(
                    model=f"talaria/{args.model}",
                    messages=messages,
                    api_base=base_url,
                    api_key=args.api_key,
                    litellm_session_id=session.session_id,
                    max_tokens=args.max_tokens,
                    temperature=0.0,
                )
                text = response.choices[0].message.content or ""
                usage = response.usage
                print(f"\n[call {step}] {text.strip()!r}")
                print(f"  prompt {usage.prompt_tokens} tokens, {cached_tokens(usage)} cached")
                messages.append({"role": "assistant", "content": text})
                if step == args.steps:
                    break
                proposed = command_in(text)
                session.tool_started("bash", command=proposed or "ls")
                ran, output = run_harmless(proposed)
                session.tool_ended()
                print(f"[tool] $ {ran}\n  " + output.replace("\n", "\n  "))
                messages.append(
                    {"role": "user", "content": f"$ {ran}\n{output}\nWhat command next?"}
                )
    except litellm.exceptions.APIConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        talaria.close()
    print(f"\n{args.steps} calls in {time.perf_counter() - started:.1f} s, one session")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
