"""Soak: ``talaria serve`` under a long mix of agent sessions, its memory and descriptors watched.

Sessions arrive for ``--minutes``; each makes a few calls with tool gaps between them (some
announced with ``tool_start`` / ``tool_end`` hints, up to ``--max-gap-s`` long), streams some of
its answers, abandons some streams after the first chunk (the client closes the connection),
and ends with an ``end`` event or simply goes quiet (the server expires it after
``session_idle_s``). A sampler reads the server's resident memory, open file descriptors,
threads and ``/metrics`` every few seconds. After the last session the soak waits for every
quiet session to expire and asks ``/health?integrity=true``.

    python benchmarks/soak.py --minutes 30 --max-gap-s 600 --json benchmarks/results/soak.json

The report: calls answered, answers lost (a call that got no 200 and was not abandoned on
purpose), streams abandoned, sessions ended and expired, the resource readings at the start
of the steady state, at the end and at their peak, resident memory at each tenth of the run,
and the *trend* of resident memory over the last third of the sessions' time: the
least-squares slope of every sample there (MiB per minute; endpoints alone would take one
noisy reading for a trend). Exit status 1 if an answer was lost, the invariants fail,
sessions are left open, descriptors grew, or memory still grows over the last third faster
than ``MAX_RSS_SLOPE_MIB_MIN`` (a leak of that rate would take an hour to cost
``60 * MAX_RSS_SLOPE_MIB_MIN`` MiB). The trend is judged only when the last third spans at
least ``MIN_TREND_WINDOW_S``: over seconds, one allocator arena taken (a few MiB at once)
reads as a rate of MiB per minute that says nothing about a leak; a short soak is judged
by its growth and its descriptors instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_process import KEY, TINY, Server, emit, serving, tiny_fields

CHAT = "/v1/chat/completions"
MiB = 2**20
MAX_RSS_SLOPE_MIB_MIN = 0.5  # the last third's resident-memory trend a soak passes with
MIN_TREND_WINDOW_S = 180.0  # the shortest last third whose trend is judged
TOOLS = ("bash", "edit", "pytest", "grep")


@attrs.define
class Tally:
    answered: int = 0
    lost: int = 0
    abandoned: int = 0
    hints: int = 0
    ended: int = 0
    quiet: int = 0  # sessions that stopped without an end event
    sessions: int = 0
    errors: list[str] = attrs.field(factory=list)

    def lose(self, what: str) -> None:
        self.lost += 1
        if len(self.errors) < 10:
            self.errors.append(what)


@attrs.frozen
class Sample:
    t_s: float
    rss_bytes: int
    open_fds: int
    threads: int
    sessions_active: float


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def _call(
    client: httpx.AsyncClient, sid: str, messages: list[dict[str, str]], stream: bool,
    abandon: bool, tally: Tally,
) -> str | None:  # fmt: skip
    body: dict[str, Any] = {"model": TINY, "messages": messages, "max_tokens": 12}
    headers = {"X-Session-ID": sid}
    try:
        if not stream:
            r = await client.post(CHAT, json=body, headers=headers)
            if r.status_code != 200:
                tally.lose(f"{r.status_code} {r.text[:200]}")
                return None
            tally.answered += 1
            return str(r.json()["choices"][0]["message"]["content"])
        parts = []
        async with client.stream("POST", CHAT, json=body | {"stream": True}, headers=headers) as r:
            if r.status_code != 200:
                tally.lose(f"{r.status_code} {(await r.aread())[:200]!r}")
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if abandon:  # the client goes away after the first chunk
                    tally.abandoned += 1
                    return None
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    tally.lose(str(chunk["error"]))
                    return None
                parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
        tally.answered += 1
        return "".join(parts)
    except httpx.HTTPError as exc:
        tally.lose(f"{type(exc).__name__}: {exc}")
        return None


async def session(url: str, n: int, rng: random.Random, max_gap_s: float, tally: Tally) -> None:
    """One agent: a few calls with tool gaps between them."""
    sid = f"soak-{n}"
    tally.sessions += 1
    messages = [{"role": "user", "content": f"Task {n}: fix the failing test in module {n % 17}"}]
    calls = rng.randint(1, 6)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    ) as client:
        for k in range(calls):
            stream = rng.random() < 0.5
            abandon = stream and rng.random() < 0.2
            answer = await _call(client, sid, messages, stream, abandon, tally)
            if answer is None:
                return  # a lost or abandoned call ends this agent
            if k == calls - 1:
                break
            gap = min(max_gap_s, rng.expovariate(1 / max(0.1, max_gap_s / 8)))
            hinted = rng.random() < 0.5
            tool = rng.choice(TOOLS)
            if hinted:
                await client.post(
                    f"/v1/sessions/{sid}/events",
                    json={"event": "tool_start", "tool": tool, "expected_s": gap},
                )
                tally.hints += 1
            await asyncio.sleep(gap)
            if hinted:
                await client.post(
                    f"/v1/sessions/{sid}/events",
                    json={"event": "tool_end", "tool": tool, "measured_s": gap},
                )
                tally.hints += 1
            messages = [
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"{tool} said: ok after {gap:.1f} s"},
            ]
        if rng.random() < 0.6:
            r = await client.post(f"/v1/sessions/{sid}/events", json={"event": "end"})
            tally.ended += r.status_code == 200
        else:
            tally.quiet += 1


async def sampler(server: Server, out: list[Sample], t0: float, every_s: float) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        while True:
            try:
                text = (await client.get("/metrics")).text
                active = _metric(text, "talaria_sessions_active")
            except httpx.HTTPError:
                active = float("nan")
            out.append(
                Sample(
                    time.monotonic() - t0,
                    server.rss_bytes(),
                    server.open_fds(),
                    server.threads(),
                    active,
                )
            )
            await asyncio.sleep(every_s)


@attrs.frozen
class SoakReport:
    minutes: float
    max_gap_s: float
    session_idle_s: float
    sessions: int
    answered: int
    lost: int
    abandoned: int
    hints: int
    ended: int
    expired_quietly: int
    sessions_left: float
    integrity: Any
    rss_steady_bytes: int  # at the end of the first fifth (warm: the model loaded, caches up)
    rss_end_bytes: int
    rss_peak_bytes: int
    fds_idle_start: int  # before the first session
    fds_steady: int
    fds_end: int  # after the last session, every client gone
    fds_peak: int
    threads_end: int
    errors: tuple[str, ...]
    # resident memory at each tenth of the run (the shape, not just the ends)
    rss_by_tenth_bytes: tuple[int, ...] = ()
    # least-squares slope of resident memory over the last third of the sessions' time
    rss_slope_last_third_mib_min: float = 0.0
    last_third_s: float = 0.0  # how long that window is

    @property
    def trend_judged(self) -> bool:
        """Whether the window is long enough for its slope to be read as a trend."""
        return self.last_third_s >= MIN_TREND_WINDOW_S

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.integrity == "ok"
            and self.sessions_left == 0
            and self.fds_end <= self.fds_idle_start
            and (not self.trend_judged or self.rss_slope_last_third_mib_min < MAX_RSS_SLOPE_MIB_MIN)
        )

    @property
    def rss_growth_bytes(self) -> int:
        """Resident memory gained from the steady state to the end."""
        return self.rss_end_bytes - self.rss_steady_bytes


def rss_slope_mib_min(samples: Sequence[Sample], start_s: float, end_s: float) -> float:
    """Least-squares slope of resident memory (MiB per minute) over the samples taken in
    ``[start_s, end_s]``; 0 with fewer than three of them."""
    window = [s for s in samples if start_s <= s.t_s <= end_s]
    if len(window) < 3:
        return 0.0
    t = np.array([s.t_s / 60 for s in window])
    rss = np.array([s.rss_bytes / MiB for s in window])
    slope, _ = np.polyfit(t, rss, 1)
    return float(slope)


async def soak(
    server: Server, minutes: float, max_gap_s: float, session_idle_s: float, rate_per_s: float,
    seed: int, sample_s: float,
) -> SoakReport:  # fmt: skip
    rng = random.Random(seed)
    tally = Tally()
    samples: list[Sample] = []
    fds_start = server.open_fds()
    t0 = time.monotonic()
    watch = asyncio.ensure_future(sampler(server, samples, t0, sample_s))
    agents: list[asyncio.Task[None]] = []
    n = 0
    while time.monotonic() - t0 < minutes * 60:
        sub = random.Random(rng.getrandbits(64))
        agents.append(asyncio.ensure_future(session(server.url, n, sub, max_gap_s, tally)))
        n += 1
        await asyncio.sleep(rng.expovariate(rate_per_s))
    await asyncio.gather(*agents)
    sessions_end_s = time.monotonic() - t0
    # let every quiet session expire (the server checks about once a second)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        deadline = time.monotonic() + session_idle_s + 30
        left = float("nan")
        while time.monotonic() < deadline:
            left = _metric((await client.get("/metrics")).text, "talaria_sessions_active")
            if left == 0:
                break
            await asyncio.sleep(1)
        health = (await client.get("/health", params={"integrity": "true"})).json()
    await asyncio.sleep(sample_s)  # one sample of the quiet server
    watch.cancel()
    await asyncio.sleep(0.5)  # the sampler's connection closes
    steady = samples[max(0, len(samples) // 5 - 1)]
    return SoakReport(
        minutes=minutes,
        max_gap_s=max_gap_s,
        session_idle_s=session_idle_s,
        sessions=tally.sessions,
        answered=tally.answered,
        lost=tally.lost,
        abandoned=tally.abandoned,
        hints=tally.hints,
        ended=tally.ended,
        expired_quietly=tally.quiet,
        sessions_left=left,
        integrity=health.get("integrity"),
        rss_steady_bytes=steady.rss_bytes,
        rss_end_bytes=samples[-1].rss_bytes,
        rss_peak_bytes=server.peak_rss_bytes(),
        fds_idle_start=fds_start,
        fds_steady=steady.open_fds,
        fds_end=server.open_fds(),
        fds_peak=max(s.open_fds for s in samples),
        threads_end=samples[-1].threads,
        errors=tuple(tally.errors),
        rss_by_tenth_bytes=tuple(
            samples[min(len(samples) - 1, k * len(samples) // 10)].rss_bytes for k in range(10)
        )
        + tuple(s.rss_bytes for s in samples[-1:]),
        rss_slope_last_third_mib_min=rss_slope_mib_min(
            samples, sessions_end_s * 2 / 3, sessions_end_s
        ),
        last_third_s=sessions_end_s / 3,
    )


def run(
    minutes: float, max_gap_s: float, session_idle_s: float, rate_per_s: float = 2.0,
    seed: int = 0, sample_s: float = 5.0,
) -> SoakReport:  # fmt: skip
    """Start ``talaria serve`` (tiny model) and soak it; returns the report."""
    fields = tiny_fields(session_idle_s=session_idle_s)
    with tempfile.TemporaryDirectory() as tmp, serving(Path(tmp), fields) as server:
        return asyncio.run(
            soak(server, minutes, max_gap_s, session_idle_s, rate_per_s, seed, sample_s)
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long sessions arrive (30)")
    ap.add_argument("--max-gap-s", type=float, default=600.0, help="longest tool gap (600)")
    ap.add_argument(
        "--session-idle-s", type=float, default=300.0, help="the server's session expiry (300)"
    )
    ap.add_argument("--rate", type=float, default=2.0, help="sessions started per second (2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args(argv)
    if min(args.minutes, args.max_gap_s, args.session_idle_s, args.rate) <= 0:
        ap.error("--minutes, --max-gap-s, --session-idle-s and --rate must be positive")
    rep = run(args.minutes, args.max_gap_s, args.session_idle_s, args.rate, args.seed)
    extra = {
        "ok": rep.ok,
        "trend_judged": rep.trend_judged,
        "rss_growth_bytes": rep.rss_growth_bytes,
    }
    emit(attrs.asdict(rep) | extra, args.json)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
