"""Tenants under contention, over HTTP: one tenant's overload does not starve another.

Tenant A queues far more calls than the batch holds; tenant B then sends one. With fair
share (``talaria.policy.tenant_share``) B's call is admitted at the next free place in the
batch, ahead of A's backlog, instead of after it. (That B never sees A's cached prefix and
cannot end, hint or continue A's sessions is ``tests/server/test_server_tenants.py``.)"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from benchmarks.serve_process import TINY
from talaria.api import Talaria
from tests.reliability.inprocess import requires_tiny_model, serve_talaria

pytestmark = requires_tiny_model

KEY_A, KEY_B = "key-of-a", "key-of-b"
CHAT = "/v1/chat/completions"
BACKLOG = 24
RUNNING = 2  # the batch holds two calls


@pytest.fixture
def served() -> Iterator[tuple[Talaria, str]]:
    with serve_talaria(
        api_keys=(),
        tenants={KEY_A: "a", KEY_B: "b"},
        policy_overrides={"max_running": RUNNING},
    ) as served:
        yield served


def body(i: int) -> dict[str, Any]:
    return {
        "model": TINY,
        "messages": [{"role": "user", "content": f"Count from {i}"}],
        "max_tokens": 48,
        "temperature": 0,
    }


def test_one_tenants_backlog_does_not_starve_another(served: tuple[Talaria, str]) -> None:
    talaria, url = served
    done: list[str] = []
    lock = threading.Lock()

    def ask(key: str, who: str, i: int) -> int:
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300
        ) as c:
            r = c.post(CHAT, json=body(i))
        with lock:
            done.append(who)
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(BACKLOG + 1) as pool:
        backlog = [pool.submit(ask, KEY_A, "a", i) for i in range(BACKLOG)]
        for _ in range(6000):  # until the server holds A's whole backlog
            if len(talaria.live.calls) == BACKLOG or all(f.done() for f in backlog):
                break
            time.sleep(0.01)
        with lock:
            a_done_before = len(done)
        assert a_done_before < BACKLOG - 2 * RUNNING, "A's backlog drained before B arrived"
        b = pool.submit(ask, KEY_B, "b", 0)
        assert b.result(300) == 200
        assert [f.result(300) for f in backlog] == [200] * BACKLOG
    a_ahead_of_b = done.index("b") - a_done_before
    # B waits for at most the calls already running and one more round of the batch, not
    # for A's whole backlog (first come first served would put it after all 24)
    assert a_ahead_of_b <= 2 * RUNNING, done
    health = httpx.get(url + "/health", params={"integrity": "true"}, timeout=60).json()
    assert health["integrity"] == "ok"
