"""Several nodes for real (``tests/reliability/multinode.py``): a Ray head and two workers,
each in its own network namespace on a private subnet, ``talaria serve --ray`` on the head
with one instance per worker, and agent sessions sent from outside while a node dies
(``kill -9`` of every process it runs), is cut off for 30 s, comes back under the same name,
or the head's server restarts while the workers live.

Each test runs a bounded loop of sessions (some calls streamed) through the fault; a client
retries a call only on a 503 or a refused connection, as an agent would. Asserted after each:
no answer lost (every call of every session answered) or crossed (each answer is the very
text the same prompt gets alone, greedy, afterwards), every session continued, and
``/health?integrity=true`` is ok. The seconds to detect the fault (until ``/health`` shows
the instance down) and to recover (until it is back) print with ``-s`` and are quoted in
docs/reliability.md. Marker ``ray`` (the ``ray`` extra; root for the namespaces).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.multinode import AUTH, Network, Server, cluster, netns_available, ray_start

pytestmark = [pytest.mark.ray]

SESSIONS = 4
CALLS = 6
MAX_TOKENS = 12
RETRY_FOR_S = 180.0


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[Network, Server, Path]]:
    pytest.importorskip("ray")
    if not netns_available():
        pytest.skip("needs root and iproute2 to make network namespaces")
    with cluster(workers=2) as made:
        yield made


def _prompt(session: int, call: int) -> str:
    return f"session {session} step {call}: list the files, then " + "read the next one. " * (
        2 + call
    )


def _answer(url: str, sid: str, prompt: str, stream: bool) -> tuple[str, str]:
    """One call, retried on a 503 or a refused connection until ``RETRY_FOR_S``; returns
    (answer text, instance that served it)."""
    body = {"model": "smollm2-tiny-dummy", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": stream}  # fmt: skip
    headers = {**AUTH, "X-Session-ID": sid}
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            with httpx.Client(base_url=url, timeout=120) as http:
                if not stream:
                    r = http.post("/v1/completions", json=body, headers=headers)
                    if r.status_code == 200:
                        return r.json()["choices"][0]["text"], r.headers["x-talaria-instance"]
                    status, why = r.status_code, r.text[:300]
                else:
                    with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                        status, why = r.status_code, ""
                        if status == 200:
                            text, failed = _read_stream(r.iter_lines())
                            if not failed:
                                return text, r.headers["x-talaria-instance"]
                            status = 503
        except httpx.TransportError as exc:
            status, why = 0, repr(exc)  # the server is down or restarting
        if status not in (0, 503) or time.monotonic() > deadline:
            raise AssertionError(f"{sid}: answered {status}: {why}")
        time.sleep(0.5)


def _read_stream(lines: Iterator[str]) -> tuple[str, bool]:
    text, failed = [], False
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            failed = True
            continue
        text.extend(c.get("text", "") for c in event.get("choices", []))
    return "".join(text), failed


def _sessions(url: str, tag: str, answers: dict[tuple[str, int], str]) -> list[threading.Thread]:
    def session(s: int) -> None:
        sid = f"{tag}-{s}"
        for c in range(CALLS):
            text, _ = _answer(url, sid, _prompt(s, c), stream=c % 2 == 1)
            answers[(sid, c)] = text
            time.sleep(0.2)  # the tool gap

    threads = [threading.Thread(target=session, args=(s,), daemon=True) for s in range(SESSIONS)]
    for t in threads:
        t.start()
    return threads


def _until(check: Callable[[], bool], timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if check():
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"not within {timeout_s} s")


def _settle(
    server: Server, threads: list[threading.Thread], answers: dict[Any, str], tag: str
) -> None:
    """Every session finished; each answer is what its prompt gets alone; intact."""
    for t in threads:
        t.join(timeout=600)
        assert not t.is_alive(), "a session never finished"
    assert len(answers) == SESSIONS * CALLS  # no answer lost
    for (sid, c), text in sorted(answers.items()):
        s = int(sid.rsplit("-", 1)[1])
        alone, _ = _answer(server.url, f"{tag}-alone-{s}-{c}", _prompt(s, c), stream=False)
        assert text == alone, f"{sid} call {c}: crossed or changed"
    assert server.integrity() == "ok"


def _report(what: str, **seconds: float) -> None:
    print(f"\n{what}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))


def test_a_worker_node_killed_mid_stream_comes_back_under_the_same_name(
    nodes: tuple[Network, Server, Path],
) -> None:
    net, server, workdir = nodes
    answers: dict[tuple[str, int], str] = {}
    threads = _sessions(server.url, "kill", answers)
    _until(lambda: len(answers) >= SESSIONS, 120)  # mid-run: calls in flight on both
    t_fault = time.monotonic()
    net.kill(1)
    detect = _until(lambda: not all(server.healthy().values()), 120)
    ray_start(net, 1, workdir, head=False)  # the same node, the same address
    t_back = time.monotonic()
    recover = server.wait_healthy(300)
    _settle(server, threads, answers, "kill")
    _report("worker killed", detect=detect, recover=recover, outage=time.monotonic() - t_fault)
    assert t_back > t_fault


def test_a_worker_cut_off_for_30_s_heals(nodes: tuple[Network, Server, Path]) -> None:
    net, server, workdir = nodes
    answers: dict[tuple[str, int], str] = {}
    threads = _sessions(server.url, "cut", answers)
    _until(lambda: len(answers) >= SESSIONS, 120)
    net.cut(2)
    t_cut = time.monotonic()
    try:
        detect = _until(lambda: not all(server.healthy().values()), 60)
    finally:
        time.sleep(max(0.0, 30.0 - (time.monotonic() - t_cut)))
        net.heal(2)
    t_heal = time.monotonic()
    try:  # the node comes back by itself, unless Ray declared it dead meanwhile
        server.wait_healthy(45)
    except TimeoutError:
        if _raylet_alive(net, 2):
            raise
        ray_start(net, 2, workdir, head=False)  # declared dead: it rejoins as a new node
        server.wait_healthy(300)
    recover = time.monotonic() - t_heal
    _settle(server, threads, answers, "cut")
    _report("worker partitioned 30 s", detect=detect, recover_after_heal=recover)


def _raylet_alive(net: Network, i: int) -> bool:
    for pid in net.pids(i):
        try:
            if "raylet" in Path(f"/proc/{pid}/cmdline").read_text():
                return True
        except OSError:
            continue
    return False


def test_the_head_server_restarts_while_the_workers_live(
    nodes: tuple[Network, Server, Path],
) -> None:
    net, server, _ = nodes
    answers: dict[tuple[str, int], str] = {}
    threads = _sessions(server.url, "restart", answers)
    _until(lambda: len(answers) >= SESSIONS, 120)
    t0 = time.monotonic()
    server.kill()
    server.start()
    recover = time.monotonic() - t0
    _settle(server, threads, answers, "restart")
    _report("server restarted", back_serving=recover)
    assert net.pids(1) and net.pids(2)  # the workers lived through it
