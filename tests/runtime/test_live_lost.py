"""An instance whose process is lost (``InstanceLost``: a Ray actor, a node) in the live
loop, on tiny in-process engines whose executor can be made to vanish: out of routing at
once, its calls that streamed nothing answered by another instance with the same ids, a
streaming one failed with ``InstanceLost``, and the instance back on a fresh core (its
memory empty) once its process answers again."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from talaria.engine.runner import EngineRunner
from talaria.errors import InstanceLost
from talaria.executor import Layout, Work
from talaria.generation import SamplingParams, StopChecker
from talaria.runtime.live import LiveCluster
from talaria.runtime.streams import Delta, Failed, Finished
from talaria.schedule import Executed
from talaria.types import TokenSeq
from tests.helpers import sk, tiny_cluster
from tests.runtime.test_live import prompt_for, run_call

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Vanishing:
    """An ``EngineRunner`` that behaves like an instance in another process: while
    ``gone``, ``execute`` raises ``InstanceLost`` and so does ``restart``;
    ``dies_in_step``: it goes while executing its next step (the node died mid-step)."""

    def __init__(self, runner: EngineRunner) -> None:
        self.inner = runner
        self.gone = False
        self.dies_in_step = False
        self.restarts = 0

    def _check(self) -> None:
        if self.gone:
            raise InstanceLost("the test took it away")

    @property
    def executes_kv_moves(self) -> bool:
        return self.inner.executes_kv_moves

    def vocab_size(self, model: str) -> int | None:
        return self.inner.vocab_size(model)

    def execute(self, work: Work) -> Executed:
        if not work.schedule.empty:
            self.gone = self.gone or self.dies_in_step
        self._check()
        return self.inner.execute(work)

    def restart(self, layout: Layout) -> None:
        self._check()
        self.restarts += 1
        self.inner.restart(layout)


def vanishing_cluster() -> tuple[LiveCluster, dict[str, Vanishing]]:
    c = tiny_cluster(device_bytes=4 * 10**6, instances=2)
    subs = {name: Vanishing(r) for name, r in c.runners.items()}
    return LiveCluster(c.core, subs, recover_after_s=0.2), subs


async def expected_ids(prompts: Sequence[TokenSeq]) -> list[tuple[int, ...]]:
    c = tiny_cluster(device_bytes=4 * 10**6, instances=2)
    async with LiveCluster(c.core, c.runners) as live:
        return [(await run_call(live, f"e{i}", "llama-tiny", p))[0] for i, p in enumerate(prompts)]


async def test_unstarted_calls_move_to_another_instance_with_the_same_answers() -> None:
    prompts = [prompt_for(i) for i in range(6)]
    want = await expected_ids(prompts)
    live, subs = vanishing_cluster()
    subs["cpu-0"].dies_in_step = True  # its first step: the calls in it streamed nothing
    got: dict[int, tuple[tuple[int, ...], Finished]] = {}
    async with live:

        async def one(i: int) -> None:
            got[i] = await run_call(live, f"s{i}", "llama-tiny", prompts[i])

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        await live.check_integrity_between_steps()
        assert [got[i][0] for i in range(6)] == want
        assert {fin.instance for _, fin in got.values()} == {"cpu-1"}
        assert live.instances_lost == 1 and live.calls_rerouted >= 1
        assert live.drivers["cpu-0"].down and live.drivers["cpu-0"].lost
        assert live.calls_failed == 0


async def stream_and_lose(
    live: LiveCluster, subs: dict[str, Vanishing], sid: str, prompt: TokenSeq,
    params: SamplingParams, lose_after: int = 1,
) -> tuple[list[int], list[object], str]:  # fmt: skip
    """Stream one call; its instance is lost after ``lose_after`` deltas. Returns the ids
    the client saw, every event, and the instance that was lost."""
    ids: list[int] = []
    seen: list[object] = []
    async with live.session(sk(sid)).lock:
        lc, events = await live.submit(sk(sid), "llama-tiny", prompt, params, StopChecker(params))
        victim = lc.instance
        async with events:
            async for ev in events:
                seen.append(ev)
                if isinstance(ev, Delta):
                    ids.extend(ev.token_ids)
                    if sum(isinstance(e, Delta) for e in seen) == lose_after:
                        subs[victim].gone = True
    return ids, seen, victim


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True,
            presence_penalty=0.4, repetition_penalty=1.2,
        ),
    ],
    ids=["greedy", "seeded with penalties"],
)  # fmt: skip
async def test_a_streaming_call_is_resumed_on_another_instance_exactly(
    params: SamplingParams,
) -> None:
    """Lost after it streamed: the call goes on on the other instance (its prompt plus what
    it streamed prefilled there) and the client gets one uninterrupted answer, the very ids
    it would have got without the loss; usage counts the original prompt and every id."""
    prompt = prompt_for(3)
    c = tiny_cluster(device_bytes=4 * 10**6, instances=2)
    async with LiveCluster(c.core, c.runners) as whole, whole.session("w").lock:
        _, events = await whole.submit(sk("w"), "llama-tiny", prompt, params, StopChecker(params))
        async with events:
            want = [i for ev in [e async for e in events] if isinstance(ev, Delta)
                    for i in ev.token_ids]  # fmt: skip
    live, subs = vanishing_cluster()
    async with live:
        ids, seen, victim = await stream_and_lose(live, subs, "v", prompt, params, lose_after=3)
        assert ids == want and len(ids) == 24
        fin = seen[-1]
        assert isinstance(fin, Finished) and fin.instance != victim
        assert (fin.prompt_tokens, fin.completion_tokens) == (len(prompt), 24)
        assert live.calls_resumed == 1 and live.calls_failed == 0
        await live.check_integrity_between_steps()


async def test_a_streaming_call_with_nowhere_to_go_fails_and_the_instance_rejoins_empty() -> None:
    """One instance: lost mid-stream, the call has nowhere to resume and fails with
    InstanceLost; the instance rejoins on a fresh core once its process answers, and the
    session goes on there, recomputing its history."""
    c = tiny_cluster(device_bytes=4 * 10**6, instances=1)
    subs = {name: Vanishing(r) for name, r in c.runners.items()}
    live = LiveCluster(c.core, subs, recover_after_s=0.2)
    async with live:
        _, first = await run_call(live, "a", "llama-tiny", prompt_for(1))
        victim = first.instance
        old_core = live.core.instances[victim]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        prompt = prompt_for(1).extend(range(1, 30))
        _, seen, lost = await stream_and_lose(live, subs, "a", prompt, params)
        assert lost == victim
        assert isinstance(seen[-1], Failed) and isinstance(seen[-1].error, InstanceLost)
        assert live.drivers[victim].down and live.calls_resumed == 0
        subs[victim].gone = False  # its process is back
        with anyio.fail_after(10):
            while live.drivers[victim].down:
                await anyio.sleep(0.05)
        fresh = live.core.instances[victim]
        assert fresh is not old_core and subs[victim].restarts == 1
        assert fresh.arena.active_model is None and fresh.kv.device_free == fresh.kv.device_blocks
        assert subs[victim].inner.layout == fresh.layout
        await live.check_integrity_between_steps()
        _, again = await run_call(live, "a", "llama-tiny", prompt)
        assert again.instance == victim and live.tokens_recomputed > 0
