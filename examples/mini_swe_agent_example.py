"""mini-swe-agent on Talaria: the real ``DefaultAgent`` loop and ``LocalEnvironment``.

Start a server, then run the agent::

    talaria serve                                  # http://127.0.0.1:8000
    python examples/mini_swe_agent_example.py      # --base-url, --model, --steps, --task

The agent (:class:`~talaria.integrations.swe_agent.mini_swe_agent.TalariaAgent`, mini-swe-agent's
``DefaultAgent`` with Talaria sessions) asks the model for one shell command per step and
runs it with mini-swe-agent's ``LocalEnvironment`` in a fresh temporary directory (``HOME``
points there too). The commands are the model's own: use a sandboxed environment (mini's
``docker``) for anything beyond a demo. Every call of the run carries one session id, so
the server keeps the conversation's KV between calls (the ``cached`` column: prompt tokens
not recomputed); each command's span is reported as a tool gap, and the session ends with
the run.

SmolLM2-135M (the default model) will not solve the task: the steps are capped (``--steps``,
default 4) and the script prints what happened.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server_check import server_ready  # sibling module of the examples

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

SYSTEM = (
    "You are a shell assistant working in a Linux terminal. Answer with exactly one shell "
    "command in a ```bash code block."
)
INSTANCE = "Task: {{task}}\nExample answer:\n```bash\nls\n```"
TASK = "create hello.txt containing hello"


def show(messages: list[dict[str, Any]]) -> None:
    """Print the conversation after the two prompts, with each call's Talaria usage."""
    for m in messages[2:]:
        extra = m.get("extra", {})
        usage = extra.get("talaria")
        content = str(m.get("content", "")).strip()
        print(f"--- {m.get('role')}: {content[:400]}")
        if usage:
            print(
                f"    [session {usage['session_id']}, instance {usage['instance']}: "
                f"prompt {usage['prompt_tokens']}, cached {usage['cached_tokens']}, "
                f"completion {usage['completion_tokens']} tokens]"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--api-key", default=os.getenv("TALARIA_API_KEY"))
    parser.add_argument("--steps", type=int, default=4, help="model calls at most")
    parser.add_argument("--max-tokens", type=int, default=48, help="per call")
    parser.add_argument("--task", default=TASK)
    args = parser.parse_args(argv)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")

    problem = server_ready(base_url, args.api_key, args.model)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    from minisweagent.environments.local import LocalEnvironment

    from talaria.integrations.swe_agent.mini_swe_agent import (
        SMALL_MODEL_ACTION_REGEX,
        TalariaAgent,
        TalariaModel,
    )

    model = TalariaModel(
        model_name=args.model,
        base_url=base_url,
        api_key=args.api_key,
        action_regex=SMALL_MODEL_ACTION_REGEX,
        # Greedy, and stop once the answer's first fenced block closes.
        model_kwargs={"temperature": 0.0, "max_tokens": args.max_tokens, "stop": ["\n```\n"]},
    )
    with tempfile.TemporaryDirectory(prefix="talaria-mini-") as workdir, model:
        env = LocalEnvironment(cwd=workdir, timeout=30, env={"HOME": workdir})
        agent = TalariaAgent(
            model, env, system_template=SYSTEM, instance_template=INSTANCE, step_limit=args.steps
        )
        print(f"task: {args.task!r} in {workdir}, at most {args.steps} calls to {args.model}")
        try:
            info = agent.run(args.task)
        except Exception as exc:  # the agent re-raises what the model call raised
            print(f"error: the agent stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            show(agent.messages)
        print(f"exit status: {info.get('exit_status')} after {agent.n_calls} calls")
        print(f"files in {workdir}: {sorted(os.listdir(workdir))}")
        model.sessions.flush(2.0)
        print("talaria:", json.dumps(model.sessions.summary(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
