"""SWE-agent on Talaria: ``TalariaAgentHook`` and the LiteLLM provider ``talaria/<model>``.

Needs SWE-agent 1.x, installed from its repository (PyPI's ``sweagent`` is an unrelated
2024 placeholder)::

    git clone https://github.com/SWE-agent/SWE-agent && pip install -e ./SWE-agent
    talaria serve                                   # http://127.0.0.1:8000
    python examples/swe_agent_hook_example.py       # --base-url, --model, --steps

It runs SWE-agent's own ``RunSingle`` with SWE-agent's ``config/default.yaml``, the model
``talaria/<model>`` (:func:`~integrations.swe_agent.sweagent_hook.swe_agent_model_config`),
a local deployment (SWE-ReX runs the commands on this machine, in a temporary git
repository) and a one-line problem statement. The hook gives the run one session
(``X-Session-ID`` on every call), reports each command as a tool gap, and ends the session
with the run. SmolLM2-135M will not solve anything; ``--steps`` caps the calls.

Not exercised in this repository's CI (SWE-agent is not installable there); the hook itself
is tested by ``tests/integrations/test_swe_agent_hook.py``, driven the way SWE-agent calls it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

PROBLEM = "Create hello.txt containing hello."


def server_problem(base_url: str) -> str | None:
    """None when the server answers ``/health``, else what is wrong."""
    try:
        health = httpx.get(f"{base_url}/health", timeout=3.0)
    except httpx.HTTPError as exc:
        return (
            f"no Talaria server at {base_url} ({exc}). Start one with `talaria serve` "
            "(it listens on 127.0.0.1:8000), or pass --base-url."
        )
    return None if health.status_code == 200 else f"unhealthy: {health.text[:200]}"


def run_config(base_url: str, model: str, steps: int, repo: Path, out: Path) -> dict[str, Any]:
    """A ``RunSingleConfig`` dict: SWE-agent's default agent, Talaria's model."""
    import yaml  # type: ignore[import-untyped, unused-ignore]
    from sweagent import CONFIG_DIR  # type: ignore[import-not-found, unused-ignore]

    from integrations.swe_agent.sweagent_hook import swe_agent_model_config

    agent = yaml.safe_load((CONFIG_DIR / "default.yaml").read_text())["agent"]
    agent["model"] = swe_agent_model_config(
        model,
        base_url,
        per_instance_call_limit=steps,
        completion_kwargs={"max_tokens": 128, "temperature": 0.0},
    )
    # A small model cannot call functions; let it write its command in a fenced block.
    agent.setdefault("tools", {})["parse_function"] = {"type": "thought_action"}
    return {
        "agent": agent,
        "env": {"deployment": {"type": "local"}, "repo": {"type": "local", "path": str(repo)}},
        "problem_statement": {"type": "text", "text": PROBLEM, "id": "talaria-hello"},
        "output_dir": str(out),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4, help="model calls at most")
    args = parser.parse_args(argv)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    try:
        from sweagent.run.run_single import (  # type: ignore[import-not-found, unused-ignore]
            RunSingle,
            RunSingleConfig,
        )
    except ImportError:
        print("error: SWE-agent is not installed; see this script's docstring.", file=sys.stderr)
        return 2
    problem = server_problem(base_url)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    from integrations.swe_agent.sweagent_hook import TalariaAgentHook

    with tempfile.TemporaryDirectory(prefix="talaria-swe-") as tmp:
        repo, out = Path(tmp) / "repo", Path(tmp) / "out"
        repo.mkdir()
        (repo / "README.md").write_text("demo\n")
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
        subprocess.run(["git", "add", "."], cwd=repo, check=True)
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"],
            cwd=repo,
            check=True,
        )
        config = RunSingleConfig.model_validate(
            run_config(base_url, args.model, args.steps, repo, out)
        )
        run = RunSingle.from_config(config)
        hook = TalariaAgentHook(session_id="talaria-hello")
        run.agent.add_hook(hook)
        try:
            run.run()
        finally:
            hook.close(timeout_s=2.0)
            if hook.sessions is not None:
                print("talaria:", hook.sessions.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
