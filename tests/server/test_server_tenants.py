"""Tenants over HTTP: each API key is a tenant whose sessions, hints and cached prefixes are
its own (issue 16's first finding: key B saw key A's prefix in ``cached_tokens``, and ended
A's session). SmolLM2-135M on CPU, on a real socket."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from talaria.api import TalariaConfig
from talaria.server.app import app_for_config
from talaria.server.middleware import tenant_of_key
from tests.server.conftest import requires_smollm2
from tests.server.server_fakes import live_server

MODEL = "smollm2-135m"
KEY_A, KEY_B = "key-for-team-a", "key-for-team-b"
CHAT = "/v1/chat/completions"
PROMPT = "Tell me about the history of the printing press in Europe. " * 12

pytestmark = requires_smollm2


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = TalariaConfig(
        models=(MODEL,),
        device_memory_bytes=10**9,
        host_memory_bytes=10**9,
        dtype="float32",
        api_keys=(KEY_A,),
        tenants={KEY_B: "team-b"},
        shutdown_grace_s=5.0,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with live_server(app_for_config(config)) as base:
            yield base
    finally:
        torch.set_num_threads(threads)


def client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def ask(session: str, text: str = PROMPT) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "session_id": session,
    }


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_tenant_never_sees_another_tenants_prefix(url: str) -> None:
    with client(url, KEY_A) as a, client(url, KEY_B) as b:
        assert cached(a.post(CHAT, json=ask("a-1"))) == 0
        assert cached(a.post(CHAT, json=ask("a-2"))) > 100  # A's own prefix is reused
        assert cached(b.post(CHAT, json=ask("b-1"))) == 0  # the same prompt, cold for B
        assert cached(b.post(CHAT, json=ask("b-2"))) > 100  # and then B's own


def test_a_tenant_cannot_end_hint_or_continue_another_tenants_session(url: str) -> None:
    other = "A different story: the history of the steam engine in England. " * 12
    with client(url, KEY_A) as a, client(url, KEY_B) as b:
        assert a.post(CHAT, json=ask("shared-name", other)).status_code == 200
        for body in ({"event": "end"}, {"event": "tool_start", "tool": "bash"}):
            r = b.post("/v1/sessions/shared-name/events", json=body)
            assert r.status_code == 404, r.text  # B has no session of that name
        assert cached(a.post(CHAT, json=ask("a-check", other))) > 100  # A's prefix is there
        # B's call under A's session id is B's own session: of A's KV it reuses nothing, at
        # most the chat template's opening block that B's own earlier calls cached
        assert cached(b.post(CHAT, json=ask("shared-name", other))) <= 16
        end = a.post("/v1/sessions/shared-name/events", json={"event": "end"})
        assert end.status_code == 200 and end.json()["summary"]["calls"] == 1


def test_tenant_names() -> None:
    assert tenant_of_key(KEY_B, {KEY_B: "team-b"}) == "team-b"
    name = tenant_of_key(KEY_A, {})
    assert name.startswith("key-") and len(name) == 16 and KEY_A not in name


def test_two_tenants_each_get_at_most_half_the_door_by_default() -> None:
    """With two or more tenants and no max_calls_per_tenant set, one tenant may hold half of
    max_calls (the others always find the rest free); one tenant, or an explicit setting,
    keeps what it had."""
    from talaria.api import TalariaConfig
    from talaria.server.app import app_and_talaria

    two = app_and_talaria(TalariaConfig(api_keys=("key-a", "key-b"), max_calls=100))[1]
    assert two.config.max_calls_per_tenant == 50
    one = app_and_talaria(TalariaConfig(api_keys=("key-a",), max_calls=100))[1]
    assert one.config.max_calls_per_tenant is None  # the whole door
    same = TalariaConfig(api_keys=("k1", "k2"), tenants={"k1": "team", "k2": "team"})
    assert app_and_talaria(same)[1].config.max_calls_per_tenant is None  # one tenant
    set_by_hand = TalariaConfig(api_keys=("key-a",), max_calls=100, max_calls_per_tenant=90)
    assert app_and_talaria(set_by_hand, api_keys=("key-b",))[1].config.max_calls_per_tenant == 90
