"""Run SWE-agent 1.1.0 on Talaria: one real ``RunSingle`` with TalariaAgentHook.

SWE-agent runs with SWE-ReX's ``local`` deployment (commands run on this machine, no
Docker) on a tiny git repository made here (or ``--repo``), with a one-line problem
statement, and calls the model ``talaria/<model>`` through Talaria's LiteLLM provider.
``TalariaAgentHook`` gives the run one session (``X-Session-ID`` on every call), reports
each command as a tool gap (``tool_start`` with the predicted seconds, ``tool_end`` with the
measured span) and ends the session with the run. SmolLM2-135M solves nothing; ``--calls``
bounds the run (SWE-agent's ``per_instance_call_limit``), whatever the model writes.

One command, from a checkout, SWE-agent installed or not::

    .venv/bin/python examples/swe_agent_hook_example.py --serve \\
        --sweagent-src third_party/SWE-agent-1.1.0-src.tar.gz

``--serve`` starts ``talaria serve`` for ``--model`` on a free port and stops it afterwards
(without it, ``--base-url`` names a running server). Without ``sweagent`` importable,
``--sweagent-src`` installs SWE-agent from its source tarball into a throwaway virtual
environment (``--sweagent-venv``, reused while the tarball is the same; it sees this
environment's packages and changes nothing in it) and reruns this script there. The
``local`` deployment copies the repository to ``/<repo name>`` and writes ``/root/tools``,
``/root/state.json``, ``/root/.swe-agent-env`` and ``/root/model.patch``; this script
removes what it created. The model's commands run on this machine as you.

Exit status: 0 when the run ended by SWE-agent's own rules (call limit, submission,
repeated format errors), 1 when it ended by an error (``exit_error``, ``exit_api``, ...),
2 when it could not start. ``--summary FILE`` writes the run's report as JSON.
``tests/integrations/test_swe_agent_run.py`` runs this script against a live server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

import httpx  # noqa: E402

from talaria.integrations.swe_agent.sweagent_run import (  # noqa: E402
    PROBLEM,
    SweAgentInstallError,
    demo_repository,
    local_deployment_cleanup,
    overlay_environment,
    run_config,
    run_swe_agent,
    small_model_agent_config,
    sweagent_importable,
)

REEXEC_GUARD = "TALARIA_SWE_AGENT_REEXEC"
DEFAULT_VENV = Path(os.getenv("XDG_CACHE_HOME", Path.home() / ".cache")) / "talaria/swe-agent"


def server_problem(base_url: str) -> str | None:
    """None when the server answers ``/health``, else what is wrong."""
    try:
        health = httpx.get(f"{base_url}/health", timeout=3.0)
    except httpx.HTTPError as exc:
        return (
            f"no Talaria server at {base_url} ({exc}). Start one with `talaria serve` "
            "(it listens on 127.0.0.1:8000), pass --base-url, or pass --serve."
        )
    return None if health.status_code == 200 else f"unhealthy: {health.text[:200]}"


@contextlib.contextmanager
def talaria_serve(model: str, workdir: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """``talaria serve`` for ``model`` on a free 127.0.0.1 port; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = workdir / "talaria.toml"
    config.write_text(
        f'models = ["{model}"]\ndevice_memory_bytes = {2 * 10**9}\n'
        f"host_memory_bytes = {2 * 10**9}\n"
    )
    log = workdir / "talaria-serve.log"
    cmd = [sys.executable, "-m", "talaria.cli", "serve", "--config", str(config)]
    cmd += ["--port", str(port), "--log-level", "warning"]
    env = dict(os.environ, OMP_NUM_THREADS=os.getenv("OMP_NUM_THREADS", "1"))
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while server_problem(url) is not None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"talaria serve did not come up:\n{tail}")
            time.sleep(0.2)
        print(f"talaria serve: {url} (log {log})", file=sys.stderr)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1] if "\n\n" in doc else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="Talaria server")
    parser.add_argument("--serve", action="store_true", help="start `talaria serve` for the run")
    parser.add_argument("--model", default="smollm2-135m", help="a model the server serves")
    parser.add_argument(
        "--calls", "--steps", type=int, default=3, help="SWE-agent's per-instance call limit"
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    parser.add_argument("--repo", type=Path, help="a git repository (default: a demo one)")
    parser.add_argument("--problem", default=PROBLEM, help="the problem statement")
    parser.add_argument("--session-id", help="the run's Talaria session id (default: new)")
    parser.add_argument("--output-dir", type=Path, help="trajectories (default: temporary)")
    parser.add_argument("--summary", type=Path, help="write the run's report here as JSON")
    parser.add_argument(
        "--sweagent-src", type=Path, help="SWE-agent's source tarball, when not installed"
    )
    parser.add_argument(
        "--sweagent-venv", type=Path, default=DEFAULT_VENV, help="where to install it"
    )
    return parser.parse_args(argv)


def reexec_with_sweagent(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Install SWE-agent into the overlay environment and rerun this script there."""
    if os.environ.get(REEXEC_GUARD):
        print("error: sweagent does not import even in the overlay environment", file=sys.stderr)
        return 2
    if args.sweagent_src is None:
        print(
            "error: SWE-agent is not installed here. Pass --sweagent-src "
            "SWE-agent-1.1.0-src.tar.gz to install it into a throwaway environment, "
            "or install it from its source (see third_party/README.md).",
            file=sys.stderr,
        )
        return 2
    print(f"installing SWE-agent into {args.sweagent_venv} ...", file=sys.stderr)
    try:
        python = overlay_environment(args.sweagent_src, args.sweagent_venv)
    except (SweAgentInstallError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ, **{REEXEC_GUARD: "1"})
    return subprocess.run([str(python), __file__, *argv], env=env, check=False).returncode


def run(args: argparse.Namespace, base_url: str, tmp: Path) -> int:
    problem = server_problem(base_url)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    repo = args.repo.resolve() if args.repo is not None else demo_repository(tmp)
    out = args.output_dir or tmp / "trajectories"
    agent = small_model_agent_config(
        args.model, base_url, calls=args.calls, max_tokens=args.max_tokens
    )
    config = run_config(agent, repo, out, problem=args.problem)
    with local_deployment_cleanup(repo.name):
        report = run_swe_agent(config, session_id=args.session_id)
    summary = report.to_json()
    print("talaria:", json.dumps(summary))
    if args.summary is not None:
        args.summary.write_text(json.dumps(summary, indent=2))
    return 0 if report.finished else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.calls < 1:
        print("error: --calls must be at least 1", file=sys.stderr)
        return 2
    if not sweagent_importable():
        return reexec_with_sweagent(args, argv)
    with tempfile.TemporaryDirectory(prefix="talaria-swe-") as name:
        tmp = Path(name)
        if not args.serve:
            return run(args, args.base_url.rstrip("/").removesuffix("/v1"), tmp)
        with talaria_serve(args.model, tmp) as url:
            return run(args, url, tmp)


if __name__ == "__main__":
    sys.exit(main())
