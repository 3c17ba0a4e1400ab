"""Several nodes for real on one machine: each in its own network namespace, joined by veth
pairs to a bridge on a private test subnet, running its own Ray node; ``talaria serve
--ray`` on the head. The tests kill nodes, cut their links and restart the server; this module
makes and removes the network, starts and kills processes per node, and talks to the server
from outside (the root namespace, over the bridge).

Needs root and iproute2 (``ip netns``, veth, a bridge; ``tc netem`` is not used). Everything
it makes is named ``tlr*`` and removed at exit, with every process left in its namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

PREFIX = "tlr"
SUBNET = "10.77.0"  # a private test subnet; the bridge is .1, node i is .(10 + i)
BRIDGE = f"{PREFIX}br0"
RAY_PORT = 6379
SERVE_PORT = 8000
KEY = "multinode-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RESOURCE = "talaria_instance"


def netns_available() -> bool:
    """Whether this process can make network namespaces (root and iproute2)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class Network:
    """``nodes`` namespaces ``tlr0`` .. on one bridge; node ``i`` answers at
    :meth:`address` ``(i)``. A context manager: removes all it made, killing what runs in
    its namespaces."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    def address(self, i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def ns(self, i: int) -> str:
        return f"{PREFIX}{i}"

    def __enter__(self) -> Network:
        self.remove()  # what a killed earlier run left
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for i in range(self.nodes):
            ns, veth = self.ns(i), f"{PREFIX}v{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", BRIDGE)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.ns(i)], capture_output=True, text=True, check=False
        )
        return [int(p) for p in out.stdout.split()]

    def kill(self, i: int) -> None:
        """``kill -9`` every process of node ``i`` (the node dies)."""
        for pid in self.pids(i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def cut(self, i: int) -> None:
        """Partition node ``i``: its link to the bridge goes down."""
        _ip("link", "set", f"{PREFIX}v{i}", "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", f"{PREFIX}v{i}", "up")

    def remove(self) -> None:
        for i in range(8):
            ns = self.ns(i)
            if Path(f"/run/netns/{ns}").exists():
                self.kill(i)
                _ip("netns", "delete", ns, check=False)
            _ip("link", "delete", f"{PREFIX}v{i}", check=False)
        _ip("link", "delete", BRIDGE, check=False)

    def run(
        self, i: int, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in node ``i``'s namespace, output to ``log``. Ray's token
        authentication is off for every process of the test's cluster (its network is the
        test's own): Ray 2.60 turns it on for a head that finds ``~/.ray/auth_token`` (which
        any local ``ray.init()`` on the machine leaves behind) but not for ``ray start
        --address``, whose workers then fail to join."""
        with log.open("ab") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.ns(i), *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})},
                start_new_session=True,
            )


def ray_start(net: Network, i: int, workdir: Path, head: bool) -> None:
    """Start node ``i``'s Ray (the head, or a worker offering one instance unit); returns
    once ``ray start`` has."""
    ray = [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start"]
    common = ["--node-ip-address", net.address(i), "--num-cpus", "1",
              "--temp-dir", str(workdir / f"ray-{i}"), "--disable-usage-stats"]  # fmt: skip
    if head:
        argv = [*ray, "--head", "--port", str(RAY_PORT), "--include-dashboard=false", *common]
    else:
        units = json.dumps({RESOURCE: 1})
        argv = [*ray, "--address", f"{net.address(0)}:{RAY_PORT}", "--resources", units, *common]
    proc = net.run(i, argv, workdir / f"ray-start-{i}.log")
    if proc.wait(timeout=120) != 0:
        raise RuntimeError(
            f"ray start on node {i} failed: {(workdir / f'ray-start-{i}.log').read_text()[-2000:]}"
        )


SERVE_CONFIG = f"""
models = ["smollm2-tiny-dummy"]
instances = 2
device_memory_bytes = 100000000
host_memory_bytes = 100000000
dtype = "float32"
api_keys = ["{KEY}"]
shutdown_grace_s = 5.0
session_idle_s = 600.0
"""


class Server:
    """``talaria serve --ray`` on the head (node 0), reached from outside at :attr:`url`."""

    def __init__(self, net: Network, workdir: Path) -> None:
        self.net, self.workdir = net, workdir
        self.url = f"http://{net.address(0)}:{SERVE_PORT}"
        self.proc: subprocess.Popen[bytes] | None = None
        (workdir / "serve.toml").write_text(SERVE_CONFIG)

    def start(self, timeout_s: float = 300.0) -> None:
        argv = [sys.executable, "-m", "talaria.cli", "serve", "--config",
                str(self.workdir / "serve.toml"), "--host", self.net.address(0),
                "--port", str(SERVE_PORT), "--ray", f"{self.net.address(0)}:{RAY_PORT}",
                "--log-level", "warning"]  # fmt: skip
        self.proc = self.net.run(0, argv, self.workdir / "serve.log")
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float, instances: int = 2) -> float:
        """Seconds until ``/health`` reports ``instances`` healthy instances."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"serve exited: {(self.workdir / 'serve.log').read_text()[-3000:]}"
                )
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = httpx.get(f"{self.url}/health", timeout=5).json()
                if sum(bool(v) for v in body.get("instances", {}).values()) >= instances:
                    return time.monotonic() - t0
            time.sleep(0.25)
        log = (self.workdir / "serve.log").read_text()[-3000:]
        raise TimeoutError(f"no {instances} healthy instances after {timeout_s} s; serve: {log}")

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self.proc = None

    def healthy(self) -> dict[str, bool]:
        body = httpx.get(f"{self.url}/health", timeout=5).json()
        return {k: bool(v) for k, v in body.get("instances", {}).items()}

    def integrity(self) -> str:
        return str(
            httpx.get(f"{self.url}/health", params={"integrity": "true"}, timeout=30)
            .json()
            .get("integrity")
        )


@contextlib.contextmanager
def cluster(workers: int = 2) -> Iterator[tuple[Network, Server, Path]]:
    """The network, a Ray head and ``workers`` Ray workers, and the server on the head."""
    with (
        tempfile.TemporaryDirectory(prefix="talaria-multinode-") as tmp,
        Network(workers + 1) as net,
    ):
        workdir = Path(tmp)
        ray_start(net, 0, workdir, head=True)
        for i in range(1, workers + 1):
            ray_start(net, i, workdir, head=False)
        server = Server(net, workdir)
        try:
            server.start()
            yield net, server, workdir
        finally:
            server.kill()
