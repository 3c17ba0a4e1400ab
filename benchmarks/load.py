"""Load: many concurrent agent sessions against ``talaria serve`` over a real socket.

Each session is a conversation of ``--calls`` chat calls (every other call streamed), each
call resending the whole history plus a new user turn, as an agent does. Every answer is
then asked again alone (the same messages, greedy, one call at a time, a fresh session) and
must be equal: an answer delivered to the wrong session, twice, or not at all shows up as a
difference. From the second call on a session's prompt must find its prefix cached.

    python benchmarks/load.py --sessions 1000 --calls 3 --json benchmarks/results/load.json

starts ``talaria serve`` with the tiny random-weight model (``smollm2-tiny-dummy``, small
memory budgets), runs the load, checks every answer, and reports latency percentiles, the
server's peak resident memory and its open file descriptors. ``--url`` targets a running
server instead (then memory is not read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_process import KEY, TINY, emit, serving, tiny_fields

CHAT = "/v1/chat/completions"


@attrs.frozen
class CallRecord:
    """One call as the client saw it."""

    session: int
    index: int
    messages: tuple[dict[str, str], ...]
    status: int
    text: str
    cached: int
    latency_s: float
    stream: bool
    session_header: str | None
    finishes: int  # finish_reason chunks (streams) or choices (whole answers) received
    error: str | None = None
    ended: bool | None = None  # the session's end event answered 200 (its last call only)


def opening(i: int) -> str:
    base = 100 + 37 * i
    return f"Repeat after me: {base}, {base + 1}, {base + 2}"


def next_turn(i: int, k: int) -> str:
    n = 100 + 37 * i + 10 * (k + 1)
    return f"And now {n}, {n + 1}"


def _body(messages: Sequence[dict[str, str]], max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": TINY,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def call(
    client: httpx.AsyncClient,
    session_id: str,
    messages: Sequence[dict[str, str]],
    max_tokens: int,
    stream: bool,
) -> tuple[int, str, int, str | None, int, str | None]:
    """One chat call: (status, text, cached tokens, X-Session-ID, finishes, error)."""
    headers = {"X-Session-ID": session_id}
    body = _body(messages, max_tokens, stream)
    if not stream:
        r = await client.post(CHAT, json=body, headers=headers)
        if r.status_code != 200:
            return r.status_code, "", 0, None, 0, r.text[:300]
        data = r.json()
        cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        text = data["choices"][0]["message"]["content"]
        return 200, text, cached, r.headers.get("x-session-id"), len(data["choices"]), None
    parts, cached, finishes, done = [], 0, 0, 0
    async with client.stream("POST", CHAT, json=body, headers=headers) as r:
        if r.status_code != 200:
            return r.status_code, "", 0, None, 0, (await r.aread()).decode()[:300]
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done += 1
                continue
            chunk = json.loads(payload)
            for choice in chunk.get("choices", []):
                parts.append(choice["delta"].get("content") or "")
                finishes += choice.get("finish_reason") is not None
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        header = r.headers.get("x-session-id")
    error = None if done == 1 else f"{done} [DONE] markers"
    return 200, "".join(parts), cached, header, finishes, error


async def run_session(
    client: httpx.AsyncClient, i: int, calls: int, max_tokens: int, tag: str
) -> list[CallRecord]:
    """Session ``i``: ``calls`` calls, each resending the history plus a new user turn."""
    sid = f"{tag}-{i}"
    messages: list[dict[str, str]] = [{"role": "user", "content": opening(i)}]
    out = []
    for k in range(calls):
        stream = (i + k) % 2 == 1
        t0 = time.perf_counter()
        try:
            status, text, cached, header, finishes, error = await call(
                client, sid, messages, max_tokens, stream
            )
        except httpx.HTTPError as exc:
            status, text, cached, header, finishes = 0, "", 0, None, 0
            error = f"{type(exc).__name__}: {exc} ({exc.__cause__!r})"
        latency = time.perf_counter() - t0
        out.append(
            CallRecord(
                i, k, tuple(messages), status, text, cached, latency, stream, header, finishes,
                error,
            )
        )  # fmt: skip
        if status != 200:
            break
        messages = [*messages, {"role": "assistant", "content": text}]
        messages.append({"role": "user", "content": next_turn(i, k)})
    if out and out[-1].status == 200:
        try:
            r = await client.post(f"/v1/sessions/{sid}/events", json={"event": "end"})
            ended = r.status_code == 200
        except httpx.HTTPError:
            ended = False
        out[-1] = attrs.evolve(out[-1], ended=ended)
    return out


def _client(url: str, key: str, timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s
    )


async def _own_client(
    url: str, key: str, timeout_s: float, i: int, calls: int, max_tokens: int, tag: str
) -> list[CallRecord]:
    # one client (one connection) per session, as each agent process has its own; a pool
    # shared by a thousand sessions hands idle connections around and races their closing
    async with _client(url, key, timeout_s) as client:
        return await run_session(client, i, calls, max_tokens, tag)


async def run_load(
    url: str, sessions: int, calls: int, *, key: str = KEY, max_tokens: int = 8,
    timeout_s: float = 600.0, tag: str = "load",
) -> tuple[list[CallRecord], float]:  # fmt: skip
    """Every session at once; returns the calls and the wall time."""
    t0 = time.perf_counter()
    per = await asyncio.gather(
        *(_own_client(url, key, timeout_s, i, calls, max_tokens, tag) for i in range(sessions))
    )
    return [r for rs in per for r in rs], time.perf_counter() - t0


async def answers_alone(
    url: str, records: Sequence[CallRecord], *, key: str = KEY, max_tokens: int = 8
) -> list[str]:
    """Each record's messages asked again, one call at a time, in a fresh session."""
    out = []
    async with _client(url, key, 600.0) as client:
        for r in records:
            _, text, _, _, _, _ = await call(
                client, f"alone-{r.session}-{r.index}", r.messages, max_tokens, False
            )
            out.append(text)
    return out


@attrs.frozen
class LoadReport:
    sessions: int
    calls: int
    answered: int
    lost: int  # calls without a 200 answer
    errors: tuple[str, ...]  # a sample
    crossed: int  # answers that differ from the same messages answered alone
    wrong_session: int  # answers whose X-Session-ID is not the session's
    not_once: int  # answers with other than one finish (and, streamed, one [DONE])
    uncached_continuations: int  # calls from the second on with no cached tokens
    ends_refused: int  # sessions whose end event was not answered 200
    wall_s: float
    latency_p50_s: float
    latency_p99_s: float
    peak_rss_bytes: int | None = None
    open_fds_after: int | None = None

    @property
    def ok(self) -> bool:
        bad = (self.lost, self.crossed, self.wrong_session, self.not_once, self.ends_refused)
        return not any(bad) and not self.uncached_continuations


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def report(
    records: Sequence[CallRecord], alone: Sequence[str], sessions: int, calls: int, wall_s: float,
    tag: str = "load",
) -> LoadReport:  # fmt: skip
    good = [r.status == 200 and r.error is None for r in records]
    ok = [r for r, g in zip(records, good, strict=True) if g]
    pairs = zip(records, alone, good, strict=True)
    crossed = sum(r.text != a for r, a, g in pairs if g)
    latencies = [r.latency_s for r in ok]
    return LoadReport(
        sessions=sessions,
        calls=sessions * calls,
        answered=len(ok),
        lost=sessions * calls - len(ok),
        errors=tuple(
            dict.fromkeys(
                f"{r.status} {r.error}" for r, g in zip(records, good, strict=True) if not g
            )
        )[:5],
        crossed=crossed,
        wrong_session=sum(r.session_header != f"{tag}-{r.session}" for r in ok),
        not_once=sum(r.finishes != 1 for r in ok),
        uncached_continuations=sum(r.index > 0 and r.cached == 0 for r in ok),
        ends_refused=sum(r.ended is False for r in records),
        wall_s=wall_s,
        latency_p50_s=percentile(latencies, 0.5),
        latency_p99_s=percentile(latencies, 0.99),
    )


def raise_fd_limit() -> None:
    """Let this process (and the server it starts) hold one socket per session."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def measure(sessions: int, calls: int, url: str | None, max_tokens: int) -> LoadReport:
    raise_fd_limit()
    if url is not None:
        records, wall = asyncio.run(run_load(url, sessions, calls, max_tokens=max_tokens))
        alone = asyncio.run(answers_alone(url, records, max_tokens=max_tokens))
        return report(records, alone, sessions, calls, wall)
    with tempfile.TemporaryDirectory() as tmp, serving(Path(tmp), tiny_fields()) as server:
        records, wall = asyncio.run(run_load(server.url, sessions, calls, max_tokens=max_tokens))
        peak = server.peak_rss_bytes()  # before the alone answers: the load's own peak
        alone = asyncio.run(answers_alone(server.url, records, max_tokens=max_tokens))
        rep = report(records, alone, sessions, calls, wall)
        return attrs.evolve(rep, peak_rss_bytes=peak, open_fds_after=server.open_fds())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=1000, help="concurrent sessions (1000)")
    ap.add_argument("--calls", type=int, default=3, help="calls per session (3)")
    ap.add_argument("--max-tokens", type=int, default=8, help="answer length cap (8)")
    ap.add_argument("--url", help="a running server (default: start talaria serve here)")
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.calls < 1 or args.max_tokens < 1:
        ap.error("--sessions, --calls and --max-tokens must be positive")
    rep = measure(args.sessions, args.calls, args.url, args.max_tokens)
    emit(attrs.asdict(rep) | {"ok": rep.ok}, args.json)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
