"""Checks every live server must pass the same way (the embedded backend's and the vLLM
backend's): the malformed-request matrix (status, error words, a healthy server afterwards)
and a streamed answer that equals the whole one."""

from __future__ import annotations

from typing import Any

import httpx
import openai

CHAT = "/v1/chat/completions"
Row = tuple[str, str, Any, dict[str, str], int, str]


def malformed_matrix(model: str, key: str) -> list[Row]:
    """(name, path, body, headers, status, words in the error message) for ``model``."""
    auth = {"Authorization": f"Bearer {key}"}

    def ask(text: str, **kw: Any) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": text}], **kw}

    return [
        ("bad json", CHAT, b'{"model": ', auth, 400, "not valid JSON"),
        ("missing messages", CHAT, {"model": model}, auth, 400, "messages: this field is required"),
        (
            "missing model",
            CHAT,
            {"messages": [{"role": "user", "content": "x"}]},
            auth,
            400,
            "model",
        ),
        ("unknown model", CHAT, ask("x") | {"model": "gpt-7"}, auth, 404, model),
        # a prompt that does not fit (a max_tokens that does not is clamped, test_anthropic)
        ("context too long", CHAT, ask("w " * 9000, max_tokens=16), auth, 400, "tokens"),
        ("negative max_tokens", CHAT, ask("hi", max_tokens=-3), auth, 400, "max_tokens"),
        ("zero max_tokens", CHAT, ask("hi", max_tokens=0), auth, 400, "max_tokens"),
        ("wrong type", CHAT, ask("hi", temperature="warm"), auth, 400, "temperature"),
        ("wrong message type", CHAT, {"model": model, "messages": "hi"}, auth, 400, "messages"),
        ("oversized", CHAT, ask("x" * 300_000), auth, 413, "exceeds"),
        ("unknown session", "/v1/sessions/nobody/events", {"event": "end"}, auth, 404, "nobody"),
        ("missing key", CHAT, ask("hi"), {"Authorization": ""}, 401, "API key"),
        ("bad key", CHAT, ask("hi"), {"Authorization": "Bearer nope"}, 401, "API key"),
    ]


def check_malformed(
    http: httpx.Client,
    model: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    words: str,
) -> None:
    """Send one matrix row: the typed error, no traceback, and the server still answers."""
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers=headers)
    else:
        r = http.post(path, json=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"]
    assert "Traceback" not in r.text
    assert http.get("/health").json()["status"] == "ok"
    ask = {"model": model, "messages": [{"role": "user", "content": "Say hi."}]}
    ok = http.post(CHAT, json=ask | {"max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"]


def check_stream_matches(oa: openai.OpenAI, model: str, messages: Any, text: str) -> int:
    """The same greedy chat streamed (usage included) gives ``text``; returns its
    completion tokens from the final usage chunk."""
    stream = oa.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None
    return chunks[-1].usage.completion_tokens
