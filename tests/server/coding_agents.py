"""The real coding agents of the client tests: their pinned npm packages, installed once
into ``.cache/coding-agents`` (npm's own cache makes a second install fast), and a
scripted server for them (``agent-tiny-dummy`` under an answer script: one call of the
client's read-only tool, then a fixed sentence) whose call log the tests read."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import pytest

from talaria.api import Talaria, TalariaConfig
from talaria.server.app import app_and_talaria
from tests.server.server_fakes import live_server

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ROOT / ".cache" / "coding-agents"
# the versions the protocol tests pin (docs/serving.md says what each sends)
PACKAGES = {
    "claude": ("@anthropic-ai/claude-code", "2.1.197"),
    "codex": ("@openai/codex", "0.171.0"),
    "opencode": ("opencode-ai", "1.18.33"),
}
MODEL = "agent-tiny-dummy"
ANSWER = "The file says hello"  # the scripted text answer (a regular expression of itself)
FILE = "hello.txt"
# each client's read-only tool, and the arguments of the scripted call (PATH: the file)
READ_TOOLS = {
    "claude": ("Read", {"file_path": "PATH"}),
    "codex": ("exec_command", {"cmd": f"cat {FILE}"}),
    "opencode": ("read", {"filePath": "PATH"}),
}
_LINE = re.compile(r"(\w+)=(\S+)")


def _installed(bin_dir: Path) -> bool:
    for client, (_, version) in PACKAGES.items():
        exe = bin_dir / client
        if not exe.exists():
            return False
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
        if version not in out.stdout:
            return False
    return True


def install_clients() -> Path:
    """The directory holding the three clients' executables, installing the pinned
    versions with npm when they are missing. Skips (a failure under CI) when node or npm is
    missing or the registry cannot be reached."""
    bin_dir = PREFIX / "node_modules" / ".bin"
    if _installed(bin_dir):
        return bin_dir
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("the coding-agent clients need node 20 and npm (not on PATH)")
    specs = [f"{name}@{version}" for name, version in PACKAGES.values()]
    cmd = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(PREFIX), *specs]
    PREFIX.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not _installed(bin_dir):
        pytest.skip(f"npm could not install {specs}: {done.stderr[-2000:]}")
    return bin_dir


@attrs.frozen
class CallLine:
    """One line of the server's call log (``talaria.calls``)."""

    session: str
    call: int
    prompt: int
    cached: int
    output: int

    @classmethod
    def parse(cls, message: str) -> CallLine:
        f = dict(_LINE.findall(message))
        counts = (int(f[k]) for k in ("call", "prompt", "cached", "output"))
        return cls(f["session"], *counts)


class CallLog(logging.Handler):
    """Collects the call log's lines while installed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[CallLine] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(CallLine.parse(record.getMessage()))


def script_config(work: Path) -> TalariaConfig:
    """agent-tiny-dummy, scripted: each client's read-only tool reads ``work``'s file."""
    path = str(work / FILE)
    calls = {
        name: {k: (path if v == "PATH" else v) for k, v in args.items()}
        for name, args in READ_TOOLS.values()
    }
    return TalariaConfig(
        models=(MODEL,),
        device_memory_bytes=2 * 10**9,
        host_memory_bytes=10**9,
        dtype="float32",
        shutdown_grace_s=5.0,
        answer_script={"text": ANSWER, "tool_calls": calls},
    )


@contextmanager
def scripted_server(work: Path) -> Iterator[tuple[str, Talaria, CallLog]]:
    """(base URL, the Talaria behind it, its call log) for a scripted server on ``work``."""
    app, talaria = app_and_talaria(script_config(work), max_body_bytes=4 * 2**20)
    log = CallLog()
    logger = logging.getLogger("talaria.calls")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        with live_server(app) as url:
            yield url, talaria, log
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)


def run_client(client: str, bin_dir: Path, url: str, work: Path, *args: str) -> str:
    """Run ``examples/coding_agents/run_client.sh`` for ``client`` in ``work``; its output
    (stdout and stderr), after asserting it exited 0."""
    script = ROOT / "examples" / "coding_agents" / "run_client.sh"
    prompt = f"Read {FILE} and tell me what it says."
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "TALARIA_URL": url,
        "TALARIA_CLIENT_DIR": str(work),
    }
    done = subprocess.run(
        ["bash", str(script), client, MODEL, prompt, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{client} exited {done.returncode}:\n{out[-4000:]}"
    return out
