"""vLLM's request extensions and the OpenAI fields beyond the basics, over HTTP on a real
``Talaria`` (SmolLM2-135M in float32) and each against the same request on the in-process API
(a ``SyncTalaria`` of the same configuration): ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``repetition_penalty``, ``presence_penalty`` / ``frequency_penalty``,
``n`` > 1 (prefix cache and session), ``logprobs`` / ``top_logprobs`` (chat, streamed and
whole; legacy completions), ``/tokenize`` and ``/detokenize``, and unknown fields."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from talaria.api import SyncTalaria
from talaria.generation import SamplingParams
from tests.server import smollm2_live
from tests.server.conftest import requires_smollm2, sse

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
PROMPT = "Write one short sentence about the sea."

pytestmark = requires_smollm2


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with smollm2_live.served() as base:
        yield base


@pytest.fixture(scope="module")
def tal() -> Iterator[SyncTalaria]:
    with SyncTalaria(smollm2_live.config()) as t:
        yield t


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


def msgs(text: str = PROMPT) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def post(http: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_ignore_eos_and_min_tokens(http: httpx.Client, tal: SyncTalaria) -> None:
    short = msgs("Answer with one word: yes or no?")
    plain = tal.chat(short, MODEL, params=SamplingParams(max_tokens=40, temperature=0))
    assert plain.finish_reason == "stop" and plain.usage.completion_tokens < 20
    end_id = plain.token_ids[-1]  # the model's end of turn
    forced = tal.chat(
        short, MODEL, params=SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    )
    assert forced.finish_reason == "length" and forced.usage.completion_tokens == 40
    assert forced.token_ids[: len(plain.token_ids) - 1] == plain.token_ids[:-1]
    least = tal.chat(
        short, MODEL, params=SamplingParams(max_tokens=40, temperature=0, min_tokens=20)
    )
    assert least.usage.completion_tokens > 20
    assert end_id not in least.token_ids[:20]  # masked, not just ignored
    for kw, want in (({"ignore_eos": True}, forced), ({"min_tokens": 20}, least)):
        got = post(http, CHAT, messages=short, max_tokens=40, temperature=0, **kw)
        assert got["choices"][0]["message"]["content"] == want.text, kw
        assert got["choices"][0]["finish_reason"] == want.finish_reason
        assert got["usage"]["completion_tokens"] == want.usage.completion_tokens


def test_stop_token_ids_end_the_answer_at_that_token(http: httpx.Client, tal: SyncTalaria) -> None:
    plain = tal.chat(msgs(), MODEL, params=SamplingParams(max_tokens=12, temperature=0))
    stop_id = plain.token_ids[3]
    first = plain.token_ids.index(stop_id)
    cut = tal.chat(
        msgs(), MODEL, params=SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id])
    )
    assert cut.finish_reason == "stop" and cut.token_ids == plain.token_ids[: first + 1]
    assert cut.text == tal.detokenize(MODEL, plain.token_ids[:first])
    got = post(http, CHAT, messages=msgs(), max_tokens=12, temperature=0, stop_token_ids=[stop_id])
    assert got["choices"][0]["message"]["content"] == cut.text
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == first + 1


@pytest.mark.parametrize(
    "kw",
    [{"repetition_penalty": 1.8}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}],
    ids=["repetition", "frequency", "presence"],
)
def test_penalties_change_the_answer_as_on_the_api(
    http: httpx.Client, tal: SyncTalaria, kw: dict[str, float]
) -> None:
    text = "sea, sea, sea, sea, sea, sea, sea,"
    plain = tal.complete(text, MODEL, params=SamplingParams(max_tokens=16, temperature=0))
    penalised = tal.complete(text, MODEL, params=SamplingParams(max_tokens=16, temperature=0, **kw))

    def most(ids: tuple[int, ...]) -> int:
        return max(ids.count(i) for i in ids)

    # greedy, the model goes on repeating; penalised, no token repeats as often
    assert most(penalised.token_ids) < most(plain.token_ids)
    got = post(http, "/v1/completions", prompt=text, max_tokens=16, temperature=0, **kw)
    assert got["choices"][0]["text"] == penalised.text


def test_n_choices_share_the_prompt_and_the_session_continues_from_choice_0(
    http: httpx.Client, tal: SyncTalaria
) -> None:
    long = msgs("Here is a story about a lighthouse keeper and his cat, told in detail. " * 4)
    kw: dict[str, Any] = {"max_tokens": 10, "temperature": 1.0, "seed": 11}
    r = tal.chat(long, MODEL, session_id="n-api", n=3, params=SamplingParams(**kw))
    assert [c.index for c in r.choices] == [0, 1, 2] and r.text == r.choices[0].text
    prompt = r.choices[0].usage.prompt_tokens
    assert r.usage.prompt_tokens == prompt
    assert r.usage.completion_tokens == sum(c.usage.completion_tokens for c in r.choices)
    first = r.choices[0].usage.cached_tokens  # the template's system prompt, at most
    assert r.usage.cached_tokens == first < prompt - 16
    for c in r.choices[1:]:  # the prefix cache serves the prompt's full blocks
        assert c.usage.cached_tokens >= prompt - 16
    # choice i samples with seed + i: choice 1 is a one-choice call with seed 12
    alone = tal.chat(long, MODEL, params=SamplingParams(max_tokens=10, temperature=1.0, seed=12))
    assert alone.token_ids == r.choices[1].token_ids
    nxt = tal.chat(
        [*long, {"role": "assistant", "content": r.text}, {"role": "user", "content": "More."}],
        MODEL,
        session_id="n-api",
        params=SamplingParams(max_tokens=4, temperature=0),
    )
    assert nxt.usage.cached_tokens >= prompt  # the session's history is choice 0's
    assert tal.event("n-api", "end") is not None
    assert tal.stats()["sessions"]["active"] == 0  # choices 1..n-1 were one-call sessions

    got = post(http, CHAT, messages=long, n=3, **kw)
    assert [c["message"]["content"] for c in got["choices"]] == [c.text for c in r.choices]
    assert got["usage"]["prompt_tokens"] == prompt
    assert got["usage"]["completion_tokens"] == r.usage.completion_tokens
    chunks = sse(
        http.post(
            CHAT,
            json={
                "model": MODEL,
                "messages": long,
                "n": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
                **kw,
            },
        )
    )
    texts = ["", "", ""]
    finished = []
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] += c["delta"].get("content", "")
            if c["finish_reason"] is not None:
                finished.append(c["index"])
    assert texts == [c.text for c in r.choices] and sorted(finished) == [0, 1, 2]
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == []
    assert chunks[-2]["usage"]["completion_tokens"] == r.usage.completion_tokens


def test_chat_logprobs_whole_streamed_and_on_the_api(
    http: httpx.Client, tal: SyncTalaria, url: str
) -> None:
    r = tal.chat(msgs(), MODEL, params=SamplingParams(max_tokens=8, temperature=0, logprobs=3))
    assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids) == 8
    for lp, tid in zip(r.logprobs, r.token_ids, strict=True):
        assert lp.token_id == tid and len(lp.top) == 3
        assert lp.top[0].token_id == tid and lp.top[0].logprob == lp.logprob  # greedy
        assert lp.logprob <= 0 and bytes(lp.bytes).decode() == lp.token
    assert "".join(lp.token for lp in r.logprobs) == r.text

    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    got = oa.chat.completions.create(
        model=MODEL, messages=msgs(), max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )  # type: ignore[call-overload]
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [lp.token for lp in r.logprobs]
    assert [c.logprob for c in content] == pytest.approx(
        [lp.logprob for lp in r.logprobs], abs=1e-4
    )
    assert [len(c.top_logprobs) for c in content] == [3] * 8
    assert content[0].bytes == list(r.logprobs[0].bytes)

    stream = http.post(
        CHAT,
        json={
            "model": MODEL,
            "messages": msgs(),
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "stream": True,
        },
    )
    streamed = [
        e
        for ch in sse(stream)[:-1]
        for c in ch["choices"]
        if c["logprobs"]
        for e in c["logprobs"]["content"]
    ]
    assert [e["token"] for e in streamed] == [lp.token for lp in r.logprobs]
    assert all(e["top_logprobs"] == [] for e in streamed)  # logprobs without top_logprobs
    none = post(http, CHAT, messages=msgs(), max_tokens=2)
    assert none["choices"][0]["logprobs"] is None


def test_completion_logprobs_have_the_legacy_shape(http: httpx.Client, tal: SyncTalaria) -> None:
    r = tal.complete(
        "The sea is", MODEL, params=SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    )
    got = post(
        http, "/v1/completions", prompt="The sea is", max_tokens=6, temperature=0, logprobs=2
    )
    lp = got["choices"][0]["logprobs"]
    assert got["choices"][0]["text"] == r.text == "".join(lp["tokens"])
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in r.logprobs or ()], abs=1e-4)
    assert [len(t) for t in lp["top_logprobs"]] == [2] * 6
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    assert all(
        math.isclose(max(t.values()), v, abs_tol=1e-6)
        for t, v in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True)
    )


def test_tokenize_and_detokenize_as_vllm(http: httpx.Client, tal: SyncTalaria) -> None:
    text = "Hello, sea! ¿Qué tal?"
    api = tal.tokenize(MODEL, prompt=text)
    got = post(http, "/tokenize", prompt=text, return_token_strs=True)
    assert got == {
        "count": len(api.token_ids),
        "max_model_len": 8192,
        "tokens": list(api.token_ids),
        "token_strs": list(api.token_strs),
    }
    assert api.token_strs[1] == "," and tal.detokenize(MODEL, api.token_ids) == text
    assert post(http, "/detokenize", tokens=got["tokens"]) == {"prompt": text}
    # model may be left out when one is served; messages count as a chat call's prompt
    chat = http.post("/tokenize", json={"messages": msgs()}).json()
    assert chat["token_strs"] is None
    answer = tal.chat(msgs(), MODEL, params=SamplingParams(max_tokens=1, temperature=0))
    assert chat["count"] == answer.usage.prompt_tokens
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "x", "messages": msgs()})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = http.post("/tokenize", json={"prompt": "x", "chat_template": "{{ x }}"})
    assert r.status_code == 400 and "chat_template" in r.text


def test_unknown_fields_are_ignored_and_named_unhonoured_ones_refused(http: httpx.Client) -> None:
    r = http.post(
        CHAT, json={"model": MODEL, "messages": msgs(), "max_tokens": 2, "frobnicate": 1, "zz": {}}
    )
    assert r.status_code == 200 and r.headers["x-talaria-ignored-fields"] == "frobnicate,zz"
    neutral = {"use_beam_search": False, "skip_special_tokens": True, "min_p": 0.0, "store": False}
    r = http.post(CHAT, json={"model": MODEL, "messages": msgs(), "max_tokens": 2, **neutral})
    assert r.status_code == 200 and "x-talaria-ignored-fields" not in r.headers
    r = http.post(
        CHAT, json={"model": MODEL, "messages": msgs(), "include_stop_str_in_output": True}
    )
    body = json.loads(r.text)
    assert r.status_code == 400 and body["error"]["param"] == "include_stop_str_in_output"
