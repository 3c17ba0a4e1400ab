"""The HTTP server over a fake API, on a real socket: shapes, sessions, streaming, events,
metrics, API keys."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from talaria.server.app import create_app
from tests.server.conftest import sse
from tests.server.server_fakes import FakeConfig, FakeTalaria, live_server

CHAT = "/v1/chat/completions"


def chat_body(text: str = "hello there", **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], **kw}


def test_chat_completion_shape_and_headers(client: httpx.Client) -> None:
    r = client.post(CHAT, json=chat_body(max_tokens=8))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "echo hello there"}
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] == 3
    assert usage["completion_tokens"] == 3
    assert usage["total_tokens"] == 6
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert r.headers["x-talaria-instance"] == "i0"
    assert r.headers["x-session-id"].startswith("one-")  # generated one-call session


def test_length_finish_and_max_completion_tokens(client: httpx.Client) -> None:
    r = client.post(CHAT, json=chat_body("a b c d e", max_completion_tokens=2))
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["message"]["content"] == "echo a"


def test_session_header_body_and_cached_tokens(client: httpx.Client, fake: FakeTalaria) -> None:
    messages = [{"role": "user", "content": "one two"}]
    r1 = client.post(
        CHAT, json={"model": "tiny", "messages": messages}, headers={"X-Session-ID": "s-h"}
    )
    assert r1.headers["x-session-id"] == "s-h"
    assert r1.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    messages += [r1.json()["choices"][0]["message"], {"role": "user", "content": "three"}]
    r2 = client.post(CHAT, json={"model": "tiny", "messages": messages, "session_id": "s-h"})
    assert r2.headers["x-session-id"] == "s-h"
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    both = client.post(
        CHAT, json={**chat_body(), "session_id": "s-h"}, headers={"X-Session-ID": "s-h"}
    )
    assert both.status_code == 200
    assert fake.calls[-1]["session_id"] == "s-h"


def test_session_header_and_body_disagree(client: httpx.Client) -> None:
    r = client.post(CHAT, json=chat_body(session_id="a"), headers={"X-Session-ID": "b"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "session_id"
    assert "differ" in r.json()["error"]["message"]


def test_sampling_options_reach_the_api(client: httpx.Client, fake: FakeTalaria) -> None:
    body = chat_body(temperature=0, top_p=0.5, top_k=-1, seed=7, stop=["x", "y"], max_tokens=5)
    body |= {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}
    body |= {"user": "u1", "unknown_extension": {"a": 1}}
    assert client.post(CHAT, json=body).status_code == 200
    call = fake.calls[-1]
    params = call["params"]
    assert params.temperature == 0.0
    assert params.top_p == 0.5
    assert params.top_k == 0
    assert params.seed == 7
    assert params.stop == ("x", "y")
    assert params.max_tokens == 5


def test_text_parts_are_joined(client: httpx.Client) -> None:
    parts = [{"type": "text", "text": "alpha "}, {"type": "text", "text": "beta"}]
    r = client.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": parts}]})
    assert r.json()["choices"][0]["message"]["content"] == "echo alpha beta"


def test_chat_stream_with_usage(client: httpx.Client) -> None:
    body = chat_body("a b c", stream=True, stream_options={"include_usage": True})
    with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-talaria-instance"] == "i0"
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "echo a b c"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["stop"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_chat_stream_without_usage(client: httpx.Client) -> None:
    with client.stream("POST", CHAT, json=chat_body("a", stream=True)) as r:
        events = sse(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in c for c in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_completions_plain_and_streamed(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["x y"], "max_tokens": 9})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "echo x y"
    assert body["usage"]["prompt_tokens"] == 2
    req = {
        "model": "tiny",
        "prompt": "x y",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=req) as r:
        events = sse(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "echo x y"
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["total_tokens"] == 5


def test_models(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "tiny"
    assert card["object"] == "model"
    assert card["context_length"] == 64
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404
    assert "tiny" in missing.json()["error"]["message"]


def test_session_events(client: httpx.Client) -> None:
    client.post(CHAT, json=chat_body(), headers={"X-Session-ID": "ev-1"})
    url = "/v1/sessions/ev-1/events"
    r = client.post(url, json={"event": "tool_start", "tool": "bash", "expected_s": 0.4})
    assert r.status_code == 200
    assert r.json() == {"session_id": "ev-1", "event": "tool_start"}
    assert client.post(url, json={"event": "tool_end", "measured_s": 0.3}).status_code == 200
    end = client.post(url, json={"event": "end"})
    assert end.json()["summary"] == {"sct_s": 12.5, "calls": 3}
    assert "talaria_session_completion_seconds_count 1.0" in client.get("/metrics").text


def test_health_and_metrics(client: httpx.Client) -> None:
    health = client.get("/health").json()
    assert health == {"status": "ok", "models": ["tiny"], "instances": {"i0": True}}
    client.post(CHAT, json=chat_body())
    text = client.get("/metrics").text
    assert (
        'talaria_http_requests_total{endpoint="chat_completions",model="tiny",status="200"}' in text
    )
    assert "talaria_time_to_first_token_seconds_count" in text
    assert 'talaria_queue_depth{instance="i0"} 4.0' in text
    assert 'talaria_kv_blocks{instance="i0",state="free",tier="host"} 7.0' in text
    assert 'talaria_reservations_held{instance="i0"} 2.0' in text
    assert 'talaria_active_model{instance="i0",model="tiny"} 1.0' in text
    assert 'talaria_instance_counter{counter="sp_admissions",instance="i0"} 6.0' in text
    assert "weird" not in text
    assert "talaria_model_switches_total 11.0" in text
    assert "talaria_bytes_moved_total 12345.0" in text
    assert "talaria_sessions_active" in text
    assert "talaria_stats_up 1.0" in text
    assert "talaria_session_events_total" in text


def test_each_app_has_its_own_registry() -> None:
    a = create_app(FakeTalaria())
    b = create_app(FakeTalaria())
    a.state.talaria.metrics.requests.labels("x", "", "200").inc()
    assert b.state.talaria.metrics.registry is not a.state.talaria.metrics.registry
    assert b.state.talaria.metrics.requests.labels("x", "", "200")._value.get() == 0


def test_create_app_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(FakeTalaria(), max_body_bytes=0)
    with pytest.raises(ValueError, match="API keys"):
        create_app(FakeTalaria(), api_keys=[" "])


def test_api_keys() -> None:
    fake = FakeTalaria(FakeConfig(api_keys=("k1", "k2")))
    with live_server(create_app(fake)) as url, httpx.Client(base_url=url) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1"}):
            r = c.post(CHAT, json=chat_body(), headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models").status_code == 401
        ok = c.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200
        metrics = c.get("/metrics").text
        assert 'endpoint="chat_completions",model="",status="401"' in metrics
        oa = openai.OpenAI(base_url=url + "/v1", api_key="k1")
        assert [m.id for m in oa.models.list()] == ["tiny"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="bad").models.list()


def test_openai_client(fake_url: str) -> None:
    oa = openai.OpenAI(base_url=fake_url + "/v1", api_key="unused")
    out = oa.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi you"}], max_tokens=5
    )
    assert out.choices[0].message.content == "echo hi you"
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    stream = oa.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi you"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo hi you"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    text = oa.completions.create(model="tiny", prompt="p q", max_tokens=4)
    assert text.choices[0].text == "echo p q"


def test_stream_is_closed_when_the_client_leaves() -> None:
    fake = FakeTalaria(context_length=200, delay_s=0.05)
    with live_server(create_app(fake)) as url, httpx.Client(base_url=url) as c:
        words = " ".join(f"w{i}" for i in range(40))
        with c.stream("POST", CHAT, json=chat_body(words, stream=True, max_tokens=50)) as r:
            next(r.iter_lines())  # the role chunk: generation is under way
        deadline = time.monotonic() + 5
        while fake.closed == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.closed == 1
        assert fake.finished == 0
        time.sleep(0.1)
        assert 'status="499"' in c.get("/metrics").text


def test_health_integrity_reports_what_is_broken(client: httpx.Client, fake: FakeTalaria) -> None:
    r = client.get("/health", params={"integrity": "true"})
    assert r.status_code == 200 and r.json()["integrity"] == "ok"
    assert "integrity" not in client.get("/health").json()
    fake.broken.append("kv: 3 blocks leaked")
    try:
        r = client.get("/health", params={"integrity": "1"})
        assert r.status_code == 503
        assert r.json()["integrity"] == ["kv: 3 blocks leaked"]
        assert client.get("/health").status_code == 200  # the shallow probe does not check
    finally:
        fake.broken.clear()
    r = client.get("/health", params={"integrity": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "integrity"


def test_the_user_field_is_recorded_not_taken_as_a_tenant(
    client: httpx.Client, fake: FakeTalaria, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "user": "mallory"}
    with caplog.at_level("INFO", logger="talaria.server.routes"):
        r = client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "u-1"})
    assert r.status_code == 200
    assert fake.calls[-1]["tenant"] == "default"  # the key decides the tenant, not `user`
    assert "session u-1, for user 'mallory'" in caplog.text
