"""One SWE-agent 1.x run on Talaria, as ``examples/swe_agent_hook_example.py`` and
``tests/integrations/test_swe_agent_run.py`` do it: SWE-agent's own ``RunSingle`` with the
``local`` deployment (SWE-ReX runs the commands on this machine, no Docker), the model
``talaria/<model>`` through the LiteLLM provider, and :class:`TalariaAgentHook` on the agent.

Why the Python API and not ``sweagent run``: SWE-agent's YAML and command line have no field
for agent hooks, and ``talaria/<model>`` only resolves in a process where the provider is
registered with LiteLLM (``custom_provider_map``; the hook's ``on_init`` does it). From the
bare command line only ``openai/<model>`` with ``api_base=http://HOST:PORT/v1`` works, with
one fixed ``X-Session-ID`` in ``completion_kwargs.extra_headers`` and no tool-gap hints.

SWE-agent 1.x is not on PyPI (PyPI's ``sweagent`` is an unrelated placeholder); it installs
from its source. :func:`overlay_environment` installs it into a throwaway virtual
environment that sees this interpreter's packages (Talaria, LiteLLM, torch) but receives
every new package itself, so the calling environment is never changed.

Side effects of the ``local`` deployment, which :func:`local_deployment_cleanup` undoes:
it copies the repository to ``/<repo name>`` (so give the repository a unique name) and
writes ``/root/tools``, ``/root/state.json``, ``/root/.swe-agent-env`` and
``/root/model.patch``. The model's commands run on this machine as this user: the agent
config here (:func:`small_model_agent_config`) blocks the obvious destructive commands and
uses no tool bundle with an install script (SWE-agent's ``default.yaml`` does:
``tools/edit_anthropic`` runs ``pip install tree-sitter`` with whatever ``pip`` is first on
``PATH``, which on a ``local`` deployment is the machine's own Python).

Imports nothing from ``sweagent`` at module level.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from talaria.integrations.swe_agent.sweagent_hook import TalariaAgentHook, swe_agent_model_config

__all__ = [
    "SWE_AGENT_VERSION",
    "RunReport",
    "SweAgentInstallError",
    "demo_repository",
    "local_deployment_cleanup",
    "overlay_environment",
    "run_config",
    "run_swe_agent",
    "small_model_agent_config",
    "sweagent_importable",
]

SWE_AGENT_VERSION = "1.1.0"
PROBLEM = "Create hello.txt containing hello."
# What the local deployment writes outside the run's output directory (besides /<repo>).
ROOT_LEFTOVERS = ("/root/tools", "/root/state.json", "/root/.swe-agent-env", "/root/model.patch")
# Exit statuses of a run that reached the model and ended by SWE-agent's own rules; the
# others (exit_error, exit_api, exit_environment_error, ...) mean the integration broke.
FINISHED_STATUSES = frozenset(
    {
        "submitted",
        "exit_cost",  # per_instance_call_limit reached: the usual end with a step limit
        "exit_format",  # the model's answers had no command max_requeries times in a row
        "exit_command_timeout",
        "exit_total_execution_time",
        "exit_context",
        "exit_forfeit",
        "exit_command",
    }
)
# Prompts SmolLM2-135M follows with greedy decoding: it answers with a ```bash block.
SYSTEM_TEMPLATE = (
    "You are a shell assistant. Answer with exactly one command in a ```bash code block."
)
INSTANCE_TEMPLATE = "Task: {{problem_statement}}\nExample answer:\n```bash\nls\n```"
BLOCKED_PREFIXES = (
    "rm ",
    "sudo",
    "pip",
    "curl",
    "wget",
    "apt",
    "shutdown",
    "reboot",
    "kill",
    "git push",
    "chmod -R",
    "chown",
    "dd ",
    "mkfs",
)


class SweAgentInstallError(RuntimeError):
    """SWE-agent could not be installed into the overlay environment (the message has the
    installer's output)."""


def sweagent_importable() -> bool:
    """Whether ``sweagent`` imports in this interpreter."""
    import importlib.util

    return importlib.util.find_spec("sweagent") is not None


# --------------------------------------------------------------------------- install
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def overlay_environment(source: Path, venv: Path, *, timeout_s: float = 900.0) -> Path:
    """Install SWE-agent from its source tarball ``source`` (``SWE-agent-<v>-src.tar.gz``:
    ``sweagent/``, ``config/``, ``tools/``, ``pyproject.toml``) into the virtual environment
    ``venv`` and return that environment's Python.

    The environment is made with this interpreter's base Python and a ``.pth`` file that
    adds this interpreter's site-packages after its own (so Talaria, LiteLLM and torch are
    the caller's, and pip sees them as installed), then ``pip install -e`` of the unpacked
    source (SWE-agent finds ``config/``, ``tools/`` and ``trajectories/`` beside its
    package). Only packages the caller lacks are installed, into ``venv``; the calling
    environment is not touched. An environment already built from the same tarball is
    reused. Raises :class:`SweAgentInstallError` with pip's output when the install fails,
    ``FileNotFoundError`` when ``source`` is missing."""
    source = Path(source).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"SWE-agent source tarball not found: {source}")
    venv = Path(venv).resolve()
    stamp = venv / "talaria-overlay.json"
    python = _venv_python(venv)
    want = {"source_sha256": _sha256(source), "parent": sys.prefix}
    if stamp.is_file() and python.exists():
        with contextlib.suppress(ValueError):
            if json.loads(stamp.read_text()) == want:
                return python
    if venv.exists():
        shutil.rmtree(venv)

    def check(cmd: Sequence[str], what: str) -> None:
        _run_checked(cmd, what, timeout_s)

    check([sys.executable, "-m", "venv", "--without-pip", str(venv)], "creating the venv")
    _inherit_parent_site_packages(python)
    src = venv / "src"
    _unpack(source, src)
    roots = [p for p in src.iterdir() if (p / "pyproject.toml").is_file()]
    root = roots[0] if len(roots) == 1 else src
    if not (root / "sweagent").is_dir():
        raise SweAgentInstallError(f"{source} has no sweagent/ package (looked in {root})")
    (root / "trajectories").mkdir(exist_ok=True)
    check(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e", str(root)],
        f"pip install -e {root}",
    )
    check([str(python), "-c", "import sweagent.run.run_single"], "importing sweagent")
    stamp.write_text(json.dumps(want))
    return python


def _run_checked(cmd: Sequence[str], what: str, timeout_s: float) -> None:
    """Run ``cmd``; :class:`SweAgentInstallError` with the end of its output if it fails."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-4000:]
        raise SweAgentInstallError(f"{what} failed (exit {done.returncode}):\n{output}")


def _inherit_parent_site_packages(python: Path) -> None:
    """A ``.pth`` file in the new environment of ``python`` that adds this interpreter's
    site-packages after its own."""
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    parents = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # `import` lines of a .pth run at startup; addsitedir also processes the parent's own
    # .pth files (editable installs such as Talaria's).
    lines = [f"import site; site.addsitedir({p!r})" for p in sorted(parents)]
    (purelib / "talaria-parent-environment.pth").write_text("\n".join(lines) + "\n")


def _unpack(source: Path, src: Path) -> None:
    """Unpack the tarball ``source`` into the new folder ``src``, refusing unsafe members."""
    src.mkdir()
    with tarfile.open(source) as archive:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse unsafe members
            archive.extractall(src, filter="data")
        else:  # pragma: no cover - older 3.11
            archive.extractall(src)


# --------------------------------------------------------------------------- the run
def demo_repository(parent: Path, name: str | None = None) -> Path:
    """A one-commit git repository ``parent/<name>`` (default ``talaria-swe-<pid>-<ns>``:
    unique, since the local deployment copies it to ``/<name>``) with a README and a
    ``greet.py``."""
    repo = Path(parent) / (name or f"talaria-swe-{os.getpid()}-{time.monotonic_ns()}")
    repo.mkdir(parents=True)
    (repo / "README.md").write_text("A tiny repository for an SWE-agent run.\n")
    (repo / "greet.py").write_text('def greet(name):\n    return "hi " + name\n')
    git = ["git", "-c", "user.name=talaria", "-c", "user.email=talaria@example.invalid"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True)
    return repo


@contextlib.contextmanager
def local_deployment_cleanup(repo_name: str) -> Iterator[None]:
    """Remove, on exit, what SWE-ReX's ``local`` deployment leaves outside the output
    directory: ``/<repo_name>`` and those of :data:`ROOT_LEFTOVERS` that did not exist on
    entry (so nothing that was there before is touched). Refuses a ``/<repo_name>`` that
    already exists: the run would reuse or clobber it."""
    if not repo_name or "/" in repo_name or repo_name in (".", ".."):
        raise ValueError(f"not a plain directory name: {repo_name!r}")
    copy = Path("/") / repo_name
    if copy.exists():
        raise FileExistsError(
            f"{copy} exists: the local deployment copies the repository there; "
            "give the repository a unique name"
        )
    existed = {p for p in ROOT_LEFTOVERS if os.path.lexists(p)}
    try:
        yield
    finally:
        for path in (str(copy), *(p for p in ROOT_LEFTOVERS if p not in existed)):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                with contextlib.suppress(OSError):
                    os.remove(path)


def small_model_agent_config(
    model: str,
    base_url: str,
    *,
    calls: int,
    max_tokens: int = 48,
    execution_timeout_s: int = 10,
) -> dict[str, Any]:
    """An SWE-agent ``DefaultAgentConfig`` dict a 135M model can drive: short prompts that
    ask for one ```bash block, SWE-agent's ``thought_action`` parser (the last fenced block
    is the command), the ``registry`` and ``submit`` bundles only (no install scripts),
    greedy decoding, ``max_tokens`` per answer, destructive commands blocked, and the
    Talaria model (:func:`swe_agent_model_config`) with ``per_instance_call_limit`` =
    ``calls``: SWE-agent ends the run (``exit_cost``, then autosubmission) when the call
    after the ``calls``-th returns, so ``calls + 1`` calls reach the server at most."""
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    return {
        "templates": {
            "system_template": SYSTEM_TEMPLATE,
            "instance_template": INSTANCE_TEMPLATE,
            "next_step_template": "OBSERVATION:\n{{observation}}",
            "next_step_no_output_template": "The command ran and printed nothing.",
        },
        "tools": {
            "bundles": [{"path": "tools/registry"}, {"path": "tools/submit"}],
            "enable_bash_tool": True,
            "parse_function": {"type": "thought_action"},
            "execution_timeout": execution_timeout_s,
            "max_consecutive_execution_timeouts": 1,
            "filter": {"blocklist": list(BLOCKED_PREFIXES)},
            "env_variables": {"PAGER": "cat", "MANPAGER": "cat", "GIT_PAGER": "cat"},
        },
        "history_processors": [],
        "max_requeries": 2,
        "model": swe_agent_model_config(
            model,
            base_url,
            per_instance_call_limit=calls,
            temperature=0.0,
            completion_kwargs={"max_tokens": max_tokens},
        ),
    }


def run_config(
    agent: Mapping[str, Any],
    repo: Path,
    output_dir: Path,
    *,
    problem: str = PROBLEM,
    instance_id: str = "talaria-hello",
) -> dict[str, Any]:
    """A ``RunSingleConfig`` dict: ``agent``, the ``local`` deployment on ``repo``, a text
    problem statement, trajectories under ``output_dir``."""
    return {
        "agent": dict(agent),
        "env": {
            "deployment": {"type": "local"},
            "repo": {"type": "local", "path": str(Path(repo).resolve())},
        },
        "problem_statement": {"type": "text", "text": problem, "id": instance_id},
        "output_dir": str(output_dir),
    }


@attrs.frozen
class RunReport:
    """What one run did: its Talaria session, SWE-agent's exit status and call count, each
    trajectory step's action and command seconds (SWE-agent's ``execution_time``: 0 for a
    step that ran no command), the hook's hint counts, and the trajectory file."""

    session_id: str | None
    exit_status: str | None
    api_calls: int
    steps: int
    actions: tuple[str, ...]
    execution_s: tuple[float, ...]
    hints: Mapping[str, int]
    trajectory: str | None
    seconds: float

    @property
    def finished(self) -> bool:
        """The run ended by SWE-agent's own rules (not by an error)."""
        return self.exit_status in FINISHED_STATUSES

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "finished": self.finished}


def run_swe_agent(
    config: Mapping[str, Any], *, session_id: str | None = None, hint_timeout_s: float = 5.0
) -> RunReport:
    """Run SWE-agent's ``RunSingle`` on ``config`` (a ``RunSingleConfig`` dict, e.g. from
    :func:`run_config`) with a :class:`TalariaAgentHook` on its agent; the hook's session
    ends with the run, whatever ends it, and queued hints get ``hint_timeout_s`` seconds to
    arrive. Needs ``sweagent`` importable. Does not clean up after the local deployment:
    wrap it in :func:`local_deployment_cleanup`."""
    from sweagent.run.run_single import (  # type: ignore[import-not-found, unused-ignore]
        RunSingle,
        RunSingleConfig,
    )

    started = time.monotonic()
    run = RunSingle.from_config(RunSingleConfig.model_validate(dict(config)))
    hook = TalariaAgentHook(session_id=session_id)
    run.agent.add_hook(hook)
    try:
        run.run()
    finally:
        sid = hook.sessions.sessions()[-1].session_id if hook.sessions else None
        hook.close(timeout_s=hint_timeout_s)
    traj = getattr(run.agent, "traj_path", None)
    info: dict[str, Any] = {}
    trajectory: list[Mapping[str, Any]] = []
    if traj is not None and Path(traj).is_file():
        data = json.loads(Path(traj).read_text())
        info, trajectory = data.get("info", {}), data.get("trajectory", [])
    stats = hook.sessions.hint_stats() if hook.sessions is not None else None
    return RunReport(
        session_id=sid,
        exit_status=info.get("exit_status"),
        api_calls=int(info.get("model_stats", {}).get("api_calls", 0)),
        steps=len(trajectory),
        actions=tuple(str(step.get("action", "")) for step in trajectory),
        execution_s=tuple(float(step.get("execution_time") or 0.0) for step in trajectory),
        hints=attrs.asdict(stats) if stats is not None else {},
        trajectory=str(traj) if traj is not None else None,
        seconds=round(time.monotonic() - started, 3),
    )
