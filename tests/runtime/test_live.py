"""The live cluster loop on real (tiny, random-weight) engines with the wall clock."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from talaria.backends.embedded import EmbeddedCluster
from talaria.errors import (
    BadRequest,
    CallFailed,
    InstanceFailed,
    ShuttingDown,
    UnknownModel,
    UnknownSession,
)
from talaria.generation import SamplingParams, StopChecker
from talaria.runtime.live import LiveCluster
from talaria.runtime.streams import Delta, Failed, Finished
from talaria.types import Call, EventKind, TokenSeq
from tests.helpers import sk, tiny_cluster

pytestmark = pytest.mark.anyio

MB = 10**6


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def live_of(c: EmbeddedCluster, **kw: Any) -> LiveCluster:
    return LiveCluster(c.core, c.runners, **kw)


def prompt_for(i: int, n: int = 40) -> TokenSeq:
    return TokenSeq([(7 * i + 3 * k) % 120 + 1 for k in range(n)])


async def tenant_call(live: LiveCluster, sid: str, tenant: str, i: int) -> None:
    """One call of ``prompt_for(i)`` (6 tokens answered) as ``tenant``, drained to its end."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    async with live.session(sk(sid, tenant)).lock:
        _, receive = await live.submit(
            sk(sid, tenant), "llama-tiny", prompt_for(i), params, StopChecker(params)
        )
        async with receive:
            events = [ev async for ev in receive]
    assert isinstance(events[-1], Finished)


async def run_call(
    live: LiveCluster, session: str, model: str, prompt: TokenSeq, max_tokens: int = 6
) -> tuple[tuple[int, ...], Finished]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with live.session(sk(session)).lock:
        _, receive = await live.submit(sk(session), model, prompt, params, StopChecker(params))
        ids: list[int] = []
        async with receive:
            async for ev in receive:
                if isinstance(ev, Delta):
                    ids.extend(ev.token_ids)
                elif isinstance(ev, Failed):
                    raise ev.error
                else:
                    return tuple(ids), ev
    raise AssertionError("stream ended without Finished")


async def alone(model: str, prompt: TokenSeq, max_tokens: int = 6) -> tuple[int, ...]:
    async with live_of(tiny_cluster()) as live:
        ids, _ = await run_call(live, "solo", model, prompt, max_tokens)
        return ids


async def test_concurrent_sessions_get_their_own_answers_and_reuse_their_prefix() -> None:
    """6 sessions x 3 calls over two models, concurrently: every answer equals the same
    prompt answered alone; from the second call on the prefix is cached."""
    c = tiny_cluster(device_bytes=4 * MB)
    results: dict[tuple[int, int], tuple[tuple[int, ...], Finished, TokenSeq]] = {}
    async with live_of(c) as live:

        async def session(i: int) -> None:
            model = "llama-tiny" if i % 2 else "qwen-tiny"
            prompt = prompt_for(i)
            for k in range(3):
                ids, fin = await run_call(live, f"s{i}", model, prompt)
                results[(i, k)] = (ids, fin, prompt)
                prompt = prompt.extend(ids).extend([5, 6, 7])
                live.event(sk(f"s{i}"), EventKind.TOOL_START, expected_s=0.01)
                await anyio.sleep(0.01)
            live.event(sk(f"s{i}"), EventKind.END)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(session, i)
        live.check_integrity()
        assert not live.sessions and live.ended_sessions == 6
        assert not c.core.instances["cpu-0"].admission.held  # ended sessions hold nothing
    assert len(results) == 18
    for (i, k), (ids, fin, prompt) in results.items():
        assert fin.completion_tokens == 6 and len(ids) == 6
        assert fin.prompt_tokens == len(prompt)
        if k > 0:
            assert fin.cached_tokens >= 16 * (len(prompt) // 16 - 1), (i, k)
    for i in (0, 1):  # spot-check answers against a fresh cluster, one call at a time
        model = "llama-tiny" if i % 2 else "qwen-tiny"
        ids, _, prompt = results[(i, 2)]
        assert await alone(model, prompt) == ids
    counters = c.core.instances["cpu-0"].counters
    assert counters.model_switches >= 2 and counters.calls_finished == 18


async def test_bad_input_raises_typed_errors_and_changes_nothing() -> None:
    c = tiny_cluster()
    async with live_of(c) as live:
        params = SamplingParams(max_tokens=4)
        with pytest.raises(UnknownModel):
            await live.submit(sk("a"), "nope", prompt_for(1), params, StopChecker(params))
        with pytest.raises(BadRequest, match="vocabulary"):
            await live.submit(
                sk("a"), "llama-tiny", TokenSeq([1, 500]), params, StopChecker(params)
            )
        with pytest.raises(UnknownSession):
            live.event(sk("never-seen"), EventKind.TOOL_START, expected_s=1.0)
        assert not live.sessions and not live.calls
        ids, _ = await run_call(live, "a", "llama-tiny", prompt_for(1))
        with pytest.raises(BadRequest, match="expected_s"):
            live.event(sk("a"), EventKind.TOOL_START, expected_s=-1.0)
        with pytest.raises(TypeError, match="expected"):
            live.event(sk("a"), EventKind.TOOL_START, expected=1.0)  # type: ignore[call-arg]
        assert len(ids) == 6
        live.check_integrity()


async def test_a_failing_step_fails_its_calls_and_the_instance_keeps_serving() -> None:
    c = tiny_cluster()
    runner = c.runners["cpu-0"]
    real = runner.execute
    calls = {"n": 0}

    def flaky(work: Any) -> Any:
        if work.schedule.step is not None and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("injected device fault")
        return real(work)

    runner.execute = flaky  # type: ignore[method-assign]
    async with live_of(c) as live:
        with pytest.raises(InstanceFailed, match="injected device fault"):
            await run_call(live, "victim", "llama-tiny", prompt_for(2))
        live.check_integrity()
        ids, fin = await run_call(live, "next", "llama-tiny", prompt_for(3))
        assert len(ids) == 6 and fin.finish_reason == "length"
        live.check_integrity()
        assert live.calls_failed == 1


async def test_a_sampling_failure_fails_that_call_alone_and_the_step_commits() -> None:
    """Two calls decode side by side; every draw of one of them raises. That call fails
    with CallFailed (500, public), the other finishes exactly as alone, in the same steps,
    and the instance never counts a failure (it stays in routing)."""
    expected = await alone("llama-tiny", prompt_for(5))
    c = tiny_cluster()
    runner = c.runners["cpu-0"]
    real = runner._draw

    def draw(logits: Any, rec: Any) -> Any:
        if rec.key[0].id == "victim":
            raise ValueError("injected sampler fault")
        return real(logits, rec)

    runner._draw = draw  # type: ignore[method-assign]
    async with live_of(c) as live:

        async def victim() -> None:
            with pytest.raises(CallFailed, match="injected sampler fault"):
                await run_call(live, "victim", "llama-tiny", prompt_for(4))

        survivor: list[tuple[int, ...]] = []

        async def other() -> None:
            survivor.append((await run_call(live, "other", "llama-tiny", prompt_for(5)))[0])

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            tg.start_soon(other)
        assert survivor == [expected]
        assert live.calls_failed == 1
        assert live.drivers["cpu-0"].failures == 0 and not live.drivers["cpu-0"].down
        live.check_integrity()
        ids, _ = await run_call(live, "after", "llama-tiny", prompt_for(5))
        assert ids == expected


async def test_an_instance_that_keeps_failing_is_taken_out_and_the_other_serves() -> None:
    c = tiny_cluster(instances=2)
    broken = c.runners["cpu-0"]

    def always(sched: Any) -> Any:
        if sched.step is not None:
            raise RuntimeError("dead device")
        return type(broken).execute(broken, sched)

    broken.execute = always  # type: ignore[method-assign]
    async with live_of(c) as live:
        answered = failed = 0
        for i in range(8):
            try:
                await run_call(live, f"s{i}", "llama-tiny", prompt_for(i))
                answered += 1
            except InstanceFailed:
                failed += 1
        assert failed <= 3 and answered == 8 - failed
        assert live.drivers["cpu-0"].down
        live.check_integrity()


async def test_cancel_releases_the_call() -> None:
    c = tiny_cluster()
    async with live_of(c) as live:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        async with live.session(sk("c")).lock:
            lc, receive = await live.submit(
                sk("c"), "llama-tiny", prompt_for(4), params, StopChecker(params)
            )
            async with receive:
                first = await receive.receive()
                assert isinstance(first, Delta)
                live.cancel(lc.key, BadRequest("client went away"))
                rest = [ev async for ev in receive]
        assert isinstance(rest[-1], Failed)
        with anyio.fail_after(2):
            while live.core.instances["cpu-0"].running:
                await anyio.sleep(0.01)
        live.check_integrity()
        assert not live.calls and live.sessions[sk("c")].in_flight == 0


async def test_sessions_without_an_end_expire() -> None:
    c = tiny_cluster()
    ends: list[Any] = []
    async with live_of(c, session_idle_s=0.2, on_session_end=ends.append) as live:
        await run_call(live, "quiet", "llama-tiny", prompt_for(5))
        with anyio.fail_after(3):
            while sk("quiet") in live.sessions:
                await anyio.sleep(0.05)
        assert live.expired_sessions == 1 and ends[0].expired and ends[0].calls == 1
        with pytest.raises(UnknownSession):
            live.event(sk("quiet"), EventKind.TOOL_START, expected_s=1.0)
        assert sk("quiet") not in c.core.sessions
        live.check_integrity()


async def test_shutdown_fails_what_cannot_finish_and_refuses_new_calls() -> None:
    c = tiny_cluster()
    live = live_of(c, shutdown_grace_s=0.05)
    seen: list[Any] = []
    async with live:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        async with live.session(sk("long")).lock:
            _, receive = await live.submit(
                sk("long"), "llama-tiny", prompt_for(6), params, StopChecker(params)
            )

        async def drain(r: AsyncIterator[Any]) -> None:
            async for ev in r:
                seen.append(ev)

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain, receive)
            await anyio.sleep(0.05)
            await live.shutdown()
    assert isinstance(seen[-1], Failed) and isinstance(seen[-1].error, ShuttingDown)
    with pytest.raises(ShuttingDown):
        await live.submit(sk("x"), "llama-tiny", prompt_for(1), params, StopChecker(params))
    c.core.check_integrity()
    assert not any(i.running for i in c.core.instances.values())
    assert math.isfinite(live.clock.now())


async def test_a_session_back_after_thirty_minutes_in_a_tool_gap_is_served() -> None:
    """Issue 11: a session idle far past the gap model's old range (it raised past ~970 s
    without a hint, ~4 ms after a 0 s hint) is just an unlikely return. On a virtual clock
    with ``session_idle_s`` raised to an hour, two sessions sit in tool gaps for 30 minutes
    (one without a hint, one with the smallest hint the wire format allows) while others are
    served on both models; then both come back and get their answers."""
    from talaria.clock import VirtualClock
    from talaria.policy.gaps import HINT_MIN_S

    clock = VirtualClock()
    c = tiny_cluster()
    async with live_of(c, clock=clock, session_idle_s=3600.0) as live:
        first = {}
        for sid in ("quiet", "hinted"):
            first[sid], _ = await run_call(live, sid, "llama-tiny", prompt_for(8))
        live.event(sk("hinted"), EventKind.TOOL_START, expected_s=HINT_MIN_S)
        served = 0
        for minute in range(1, 31):  # others keep calling while the two stay away
            clock.advance_to(60.0 * minute)
            model = "llama-tiny" if minute % 2 else "qwen-tiny"
            ids, _ = await run_call(live, f"busy{minute}", model, prompt_for(minute))
            served += len(ids) == 6
            await anyio.sleep(0.01)  # the drivers plan on the advanced clock meanwhile
        assert served == 30
        for sid in ("quiet", "hinted"):
            assert live.sessions[sk(sid)].in_flight == 0  # not expired: the idle limit is 1 h
            again = prompt_for(8).extend(first[sid]).extend([9, 9, 9])
            ids, fin = await run_call(live, sid, "llama-tiny", again)
            assert len(ids) == 6 and fin.finish_reason == "length"
        inst = c.core.instances["cpu-0"]
        assert inst.counters.policy_faults == 0 and not live.drivers["cpu-0"].down
        live.check_integrity()


async def test_a_failure_in_planning_takes_the_instance_out_only_for_a_while() -> None:
    """A bug that escapes planning fails the calls the instance holds, takes it out of
    routing, and after the recovery wait (integrity checked) it serves again: no input
    takes an instance down for ever."""
    c = tiny_cluster()
    core = c.core.instances["cpu-0"]
    real = core.schedule
    broken = {"left": 1}

    def plan(now: float) -> Any:
        sched = real(now)
        if broken["left"] and not sched.empty:
            broken["left"] -= 1
            raise RuntimeError("injected planning bug")
        return sched

    core.schedule = plan  # type: ignore[method-assign]
    async with live_of(c, recover_after_s=0.05) as live:
        with pytest.raises(InstanceFailed, match="injected planning bug"):
            await run_call(live, "victim", "llama-tiny", prompt_for(2))
        with anyio.fail_after(10):
            while live.drivers["cpu-0"].down:
                await anyio.sleep(0.02)
        ids, fin = await run_call(live, "after", "llama-tiny", prompt_for(3))
        assert len(ids) == 6 and fin.finish_reason == "length"
        assert live.drivers["cpu-0"].downs == 1
        live.check_integrity()


async def test_a_gap_policy_bug_for_one_session_is_isolated_to_that_session() -> None:
    """Defence in depth: if the gap model raises for one session (any bug in policy code),
    that session becomes an unlikely return (its reservation dropped, its KV kept cached),
    the instance stays in service and every session, that one included, gets its answers."""
    import attrs as attrs_mod

    from talaria.policy.gaps import GapModel

    @attrs_mod.frozen
    class Broken(GapModel):
        def expected_remaining_s(self, elapsed_s: float, expected_s: float | None) -> float:
            if expected_s == 0.5:  # the hint the victim sends
                raise ZeroDivisionError("injected gap-model bug")
            return super().expected_remaining_s(elapsed_s, expected_s)

    c = tiny_cluster()
    inst = c.core.instances["cpu-0"]
    inst.gaps = inst.admission.gaps = Broken()
    async with live_of(c) as live:
        first, _ = await run_call(live, "victim", "llama-tiny", prompt_for(1))
        live.event(sk("victim"), EventKind.TOOL_START, expected_s=0.5)
        assert sk("victim") in inst.admission.held
        for i in range(3):  # another model waits: the idle slot asks about the victim
            ids, _ = await run_call(live, f"other{i}", "qwen-tiny", prompt_for(10 + i))
            assert len(ids) == 6
        assert inst.counters.policy_faults >= 1 and not live.drivers["cpu-0"].down
        assert sk("victim") not in inst.admission.held
        again = prompt_for(1).extend(first).extend([4, 4])
        ids, fin = await run_call(live, "victim", "llama-tiny", again)
        assert len(ids) == 6 and fin.cached_tokens > 0  # its KV was kept
        live.check_integrity()


async def test_past_max_calls_a_call_is_refused_with_429_and_nothing_changes() -> None:
    """The bound on calls in flight: the third of three concurrent calls is refused with a
    typed 429 before anything changes; once one finishes, calls are taken again."""
    from talaria.errors import TooManyRequests
    from talaria.server.errors import from_talaria

    c = tiny_cluster()
    async with live_of(c, max_calls=2) as live:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        held = []
        for i in range(2):
            async with live.session(sk(f"s{i}")).lock:
                held.append(
                    await live.submit(
                        sk(f"s{i}"), "llama-tiny", prompt_for(i), params, StopChecker(params)
                    )
                )
        with pytest.raises(TooManyRequests, match="max_calls") as err:
            await live.submit(sk("s2"), "llama-tiny", prompt_for(2), params, StopChecker(params))
        http = from_talaria(err.value)
        assert http.status == 429 and "Retry-After" in http.headers
        assert sk("s2") not in live.sessions and live.gate.refused == 1 and len(live.calls) == 2
        for _, receive in held:  # drain both answers
            async with receive:
                async for _ev in receive:
                    pass
        ids, fin = await run_call(live, "s2", "llama-tiny", prompt_for(2))
        assert len(ids) == 6 and fin.finish_reason == "length"
        live.check_integrity()
    with pytest.raises(BadRequest, match="max_calls"):
        live_of(tiny_cluster(), max_calls=0)


async def test_one_tenants_overload_leaves_room_for_another() -> None:
    """``max_calls_per_tenant``: tenant A fills its share and its next call is refused (429);
    tenant B is still served meanwhile."""
    from talaria.errors import TooManyRequests

    c = tiny_cluster()
    async with live_of(c, max_calls=8, max_calls_per_tenant=2) as live:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        held = []
        for i in range(2):
            async with live.session(sk(f"a{i}", "A")).lock:
                held.append(
                    await live.submit(
                        sk(f"a{i}", "A"), "llama-tiny", prompt_for(i), params, StopChecker(params)
                    )
                )
        with pytest.raises(TooManyRequests, match="max_calls_per_tenant"):
            await live.submit(
                sk("a2", "A"), "llama-tiny", prompt_for(2), params, StopChecker(params)
            )
        short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        async with live.session(sk("b0", "B")).lock:
            _, receive = await live.submit(
                sk("b0", "B"), "llama-tiny", prompt_for(3), short, StopChecker(short)
            )
            async with receive:
                events = [ev async for ev in receive]
        assert isinstance(events[-1], Finished)  # B was served while A held its share
        for _, r in held:
            async with r:
                async for _ev in r:
                    pass
        live.check_integrity()


async def test_a_tenant_past_its_token_budget_waits_and_others_are_served() -> None:
    """``tokens_per_minute_per_tenant`` = 100 on a virtual clock: tenant A's two calls of 46
    tokens (40 prompt + 6 answer) leave 8; its third is refused with the exact wait, 22.8 s
    ((46 - 8) / (100 / 60)), as ``Retry-After: 23`` over HTTP; tenant B is served; after the
    wait A is served again, and nothing else changed."""
    from talaria.clock import VirtualClock
    from talaria.errors import TooManyRequests
    from talaria.server.errors import from_talaria

    clock = VirtualClock()
    c = tiny_cluster()

    async with live_of(c, clock=clock, tokens_per_minute_per_tenant=100) as live:
        await tenant_call(live, "a0", "A", 0)
        await tenant_call(live, "a1", "A", 1)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        with pytest.raises(TooManyRequests, match="100 tokens per minute") as err:
            await live.submit(
                sk("a2", "A"), "llama-tiny", prompt_for(2), params, StopChecker(params)
            )
        assert err.value.retry_after_s == pytest.approx(22.8)
        assert from_talaria(err.value).headers["Retry-After"] == "23"
        assert sk("a2", "A") not in live.sessions and live.gate.refused == 1
        await tenant_call(live, "b0", "B", 3)  # B's budget is its own
        clock.advance_to(22.8)
        await tenant_call(live, "a2", "A", 2)
        live.check_integrity()


async def test_a_tenant_at_its_session_share_opens_no_new_session_until_one_ends() -> None:
    """``max_sessions_per_tenant`` = 2: tenant A's third session is refused (429) while its
    two open sessions keep being served and tenant B opens its own; once A ends one, A's
    next new session is accepted."""
    from talaria.errors import TooManyRequests

    c = tiny_cluster()

    async with live_of(c, max_sessions_per_tenant=2) as live:
        await tenant_call(live, "a0", "A", 0)
        await tenant_call(live, "a1", "A", 1)
        with pytest.raises(TooManyRequests, match="max_sessions_per_tenant"):
            await tenant_call(live, "a2", "A", 2)
        assert sk("a2", "A") not in live.sessions and live.gate.refused == 1
        await tenant_call(live, "a0", "A", 3)  # an open session keeps its calls
        await tenant_call(live, "b0", "B", 4)  # another tenant's share is its own
        live.event(sk("a1", "A"), EventKind.END)
        await tenant_call(live, "a2", "A", 2)
        assert sorted(live.sessions) == [sk("a0", "A"), sk("a2", "A"), sk("b0", "B")]
        live.check_integrity()
    with pytest.raises(BadRequest, match="max_sessions_per_tenant"):
        live_of(tiny_cluster(), max_sessions_per_tenant=0)


async def test_a_call_placed_on_an_idle_instance_is_planned_before_the_next_is_routed() -> None:
    """A burst (three first calls in one tick) on two idle instances: each placement on an
    idle instance plans that instance's schedule at once, as the simulator plans after each
    arrival, so the next call is routed against the switch it started; the placements are
    the ones a core driven that way makes, and every call is answered."""
    models = ("llama-tiny", "qwen-tiny", "llama-tiny")
    ref = tiny_cluster(instances=2).core  # driven as the simulator drives it
    expected = []
    for i, model in enumerate(models):
        call = Call(f"s{i}", 0, model, prompt_for(i), 4, None, "default", 0.0)
        inst, _, _ = ref.place(call, 4, None, 0.0)
        if inst.spec.name not in expected:  # busy once it has planned
            inst.schedule(0.0)
        expected.append(inst.spec.name)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async with live_of(tiny_cluster(instances=2)) as live:
        await live.until_idle()  # both drivers wait for work
        placed, streams = [], []
        for i, model in enumerate(models):  # no await that yields in between: one tick
            lc, receive = await live.submit(
                sk(f"s{i}"), model, prompt_for(i), params, StopChecker(params)
            )
            driver = live.drivers[lc.instance]
            if lc.instance not in placed:  # planned already: its switch is under way
                assert driver.planned is not None and driver.planned.switch is not None
                assert live.core.instances[lc.instance].arena.active_model == model
            placed.append(lc.instance)
            streams.append(receive)
        for receive in streams:
            async with receive:
                events = [ev async for ev in receive]
            assert isinstance(events[-1], Finished)
        live.check_integrity()
    assert placed == expected


async def two_first_calls_in_one_tick(c: EmbeddedCluster) -> list[str]:
    """Submit the first calls of two sessions of llama-tiny in one tick on ``c``'s idle
    instances; check every answer is the prompt's answered alone; the instances they went
    to, in order."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async with live_of(c) as live:
        await live.until_idle()
        placed, streams = [], []
        for i in range(2):  # no await that yields in between: one tick
            lc, receive = await live.submit(
                sk(f"s{i}"), "llama-tiny", prompt_for(i), params, StopChecker(params)
            )
            placed.append(lc.instance)
            streams.append(receive)
        answers = []
        for receive in streams:
            async with receive:
                events = [ev async for ev in receive]
            assert isinstance(events[-1], Finished)
            answers.append(tuple(t for ev in events if isinstance(ev, Delta) for t in ev.token_ids))
        live.check_integrity()
    for i, ids in enumerate(answers):
        assert ids == await alone("llama-tiny", prompt_for(i), 4)
    return placed


@pytest.mark.parametrize(("target", "spread"), [(1, True), (2, False)])
async def test_the_autoscaler_scales_a_model_out_live_at_its_concurrency_target(
    target: int, spread: bool
) -> None:
    """Two first calls of one model in one tick on two idle instances, live: with a target
    of one call in flight per instance the second goes to the other instance, with two it
    joins the first; every answer is the prompt's answered alone."""
    c = tiny_cluster(instances=2, policy="autoscale", concurrency_target=target)
    placed = await two_first_calls_in_one_tick(c)
    assert placed == (["cpu-0", "cpu-1"] if spread else ["cpu-0", "cpu-0"])


@pytest.mark.parametrize(("slack", "placed"), [(0.0, ["cpu-0", "cpu-1"]), (10.0, ["cpu-0"] * 2)])
async def test_a_pack_slack_joins_the_models_batch_live(slack: float, placed: list[str]) -> None:
    """Two first calls of one model in one tick on two idle instances, talaria live: with
    no slack the second goes where it completes soonest (the other instance, no queue
    ahead); with a wide one it joins the first call's instance, where its model has a call
    in flight. Every answer is the prompt's answered alone."""
    c = tiny_cluster(instances=2, pack_slack=slack)
    assert await two_first_calls_in_one_tick(c) == placed


async def test_an_idle_instance_scales_to_zero_and_the_next_call_reloads_for_real() -> None:
    """No timer and no reservations (``serverless``): once its call is answered the instance
    gives its device back, its KV demoted to host; the session's next call switches the
    model in again and restores its prefix from host, and answers as a fresh cluster does."""
    c = tiny_cluster(policy="serverless", keep_alive_s=0.0)
    inst = c.core.instances["cpu-0"]
    first = prompt_for(3, n=48)
    async with live_of(c) as live:
        ids, _ = await run_call(live, "s", "llama-tiny", first)
        with anyio.fail_after(10):
            while not inst.released:
                await anyio.sleep(0.01)
        assert inst.counters.scale_to_zero == 1 and inst.arena.active_model is None
        assert inst.kv.session_kv(sk("s")).device_tokens == 0
        assert inst.kv.session_kv(sk("s")).host_tokens >= 32
        second = first.extend(ids).extend([5, 6, 7])
        ids2, fin = await run_call(live, "s", "llama-tiny", second)
        # woken by the call (it may scale to zero again at once after it: no timer)
        assert inst.counters.model_switches == 2 and inst.counters.scale_to_zero >= 1
        assert fin.cached_tokens >= 32  # restored from host, not recomputed
        live.check_integrity()
    assert await alone("llama-tiny", second) == ids2
