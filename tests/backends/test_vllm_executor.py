"""The vLLM executor's contract with the live loop, against engines that need no vLLM.

``FakeEngines`` is an :class:`~talaria.backends.vllm.engines.EngineSet` whose requests are
answered by a background thread (a token per millisecond, each id a function of the prompt
and its position; prefix-cache hits in whole blocks of the prompts it saw), so the
executor's admission, token hand-out, ends, switches and failures are checked exactly in
the default suite. The real engines are tested under the ``vllm`` marker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from talaria.backends.vllm.catalog import VllmModel
from talaria.backends.vllm.cluster import instance_specs
from talaria.backends.vllm.engines import EngineSet, Stream, SwitchTiming
from talaria.backends.vllm.executor import VllmExecutor
from talaria.config import ClusterConfig
from talaria.core.cluster import ClusterCore
from talaria.cost import cluster_estimators
from talaria.engine.arch import ModelArch
from talaria.engine.catalog import entry
from talaria.errors import InstanceFailed
from talaria.executor import Executor, Layout
from talaria.generation import SamplingParams, StopChecker
from talaria.policy.baselines import POLICIES
from talaria.runtime.live import LiveCluster
from talaria.runtime.streams import Delta, Failed, Finished
from talaria.types import TokenSeq
from tests.helpers import sk

pytestmark = pytest.mark.anyio
BLOCK = 32
EOS = 2


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def token_at(prompt: Sequence[int], n: int) -> int:
    return (sum(prompt) + 7 * n) % 1000 + 10


@attrs.define
class Submitted:
    request_id: str
    model: str
    prompt: tuple[int, ...]
    session_id: str | None
    cache_salt: str | None
    switches_before: int
    forced: tuple[int, ...] | None


class FakeEngines(EngineSet):
    """Engines answered by a thread (see the module docstring)."""

    def __init__(
        self,
        names: Sequence[str],
        eos_at: int | None = None,
        quit_after: tuple[int, str] | None = None,
        sleep_mode: bool = False,
    ) -> None:
        super().__init__([VllmModel(n, Path("/nonexistent")) for n in names])
        self.sleep_mode = sleep_mode  # with it one model is awake at a time, else all
        self.awake = {names[0]} if sleep_mode else set(names)
        self.submitted: list[Submitted] = []
        self.aborted: list[str] = []
        self.failing: set[str] = set()  # models whose requests fail
        self.eos_at = eos_at
        self.quit_after = quit_after  # (n, reason): end streams after n tokens, no more
        self._seen: list[tuple[str | None, tuple[int, ...]]] = []

    def _cached(self, salt: str | None, prompt: tuple[int, ...]) -> int:
        best = 0
        for s, p in self._seen:
            if s != salt:
                continue
            n = 0
            while n < min(len(p), len(prompt)) and p[n] == prompt[n]:
                n += 1
            best = max(best, n // BLOCK * BLOCK)
        return min(best, (len(prompt) - 1) // BLOCK * BLOCK)

    def submit(
        self,
        request_id: str,
        model: str,
        prompt_ids: Sequence[int],
        params: Any,
        *,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Stream:
        sp, forced = params
        prompt = tuple(prompt_ids)
        stream = Stream(model, request_id)
        with self.cond:
            stream.cached_tokens = self._cached(cache_salt, prompt)
            self._seen.append((cache_salt, prompt))
            self.streams[request_id] = stream
            self.submitted.append(
                Submitted(
                    request_id, model, prompt, session_id, cache_salt, len(self.switches), forced
                )
            )

        def emit() -> None:
            for n in range(sp.max_tokens):
                time.sleep(0.001)
                with self.cond:
                    if request_id in self.aborted:
                        return
                    if self.quit_after is not None and n == self.quit_after[0]:
                        stream.finished, stream.finish_reason = True, self.quit_after[1]
                        self.cond.notify_all()
                        return
                    if model in self.failing:
                        stream.error = RuntimeError("engine died")
                        self.cond.notify_all()
                        return
                    eos = self.eos_at is not None and n == self.eos_at
                    tok = forced[n] if forced else (EOS if eos else token_at(prompt, n))
                    stream.tokens.append(tok)
                    stream.finished = eos or n == sp.max_tokens - 1
                    self.cond.notify_all()
                    if eos:
                        return

        threading.Thread(target=emit, daemon=True).start()
        return stream

    def abort(self, request_id: str) -> None:
        with self.cond:
            self.aborted.append(request_id)
            self.streams.pop(request_id, None)

    def switch(self, slept: str | None, woke: str) -> SwitchTiming:
        timing = SwitchTiming(slept, woke, 0.0, 0.0)
        self.switches.append(timing)
        if self.sleep_mode:
            self.awake = {woke}
        return timing


def tiny_arch() -> ModelArch:
    config = entry("smollm2-tiny-dummy").config
    assert config is not None
    return ModelArch.from_hf_config(config)


def make_live(
    names: Sequence[str],
    engines: FakeEngines,
    policy: str = "talaria",
    sleep_mode: bool = False,
    wrap: Callable[[str, Layout, VllmExecutor], Executor] | None = None,
) -> LiveCluster:
    """The cluster ``cluster_over`` builds: one instance whose models take turns (with
    ``sleep_mode`` on a 4 GB device, half of it per engine); ``wrap`` puts each instance's
    executor behind another (the Ray wire)."""
    arch = tiny_arch()
    models = [
        VllmModel(n, Path("/nonexistent"), max_model_len=4096, gpu_memory_utilization=0.5)
        for n in names
    ]
    archs = dict.fromkeys(names, arch)
    specs = instance_specs(
        models,
        archs,
        sleep_mode=sleep_mode,
        hardware="cpu",
        host_memory_bytes=10**9,
        block_size=BLOCK,
        memory_utilization=0.9,
        device_total_bytes=4 * 10**9 if sleep_mode else None,
    )
    cluster = ClusterConfig([m.spec(arch) for m in models], specs)
    pol = attrs.evolve(POLICIES[policy], slot_max_s=0.2, slot_linger_s=0.02)
    core = ClusterCore(cluster, pol, cluster_estimators(cluster))
    runners = {
        name: VllmExecutor(
            list(inst.models),
            engines,
            vocab_sizes=dict.fromkeys(names, arch.vocab_size),
            eos_token_ids=dict.fromkeys(names, (EOS,)),
            step_timeout_s=10.0,
            params_factory=lambda p, forced, limit, vocab: (p, forced),
        )
        for name, inst in core.instances.items()
    }
    if wrap is None:
        return LiveCluster(core, runners)
    wrapped = {n: wrap(n, core.instances[n].layout, r) for n, r in runners.items()}
    return LiveCluster(core, wrapped)


async def call(
    live: LiveCluster,
    session: str,
    model: str,
    prompt: TokenSeq,
    max_tokens: int = 6,
    *,
    tenant: str = "default",
    forced: tuple[int, ...] | None = None,
) -> tuple[tuple[int, ...], Finished]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    checker = StopChecker(params, (EOS,))
    async with live.session(sk(session, tenant)).lock:
        _, receive = await live.submit(
            sk(session, tenant), model, prompt, params, checker, forced=forced
        )
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


def prompt(i: int, n: int = 80) -> TokenSeq:
    return TokenSeq([(11 * i + 5 * k) % 500 + 3 for k in range(n)])


async def test_a_call_gets_the_engines_tokens_session_and_tenant() -> None:
    engines = FakeEngines(["a"])
    async with make_live(["a"], engines) as live:
        p = prompt(1)
        ids, fin = await call(live, "s1", "a", p, 6, tenant="acme")
        # the session grows: the next prompt starts with the first's 80 tokens
        longer = p.extend([9] * 30)
        _, fin2 = await call(live, "s1", "a", longer, 4, tenant="acme")
        live.check_integrity()
    assert ids == tuple(token_at(p.tokens(), n) for n in range(6))
    assert (fin.completion_tokens, fin.cached_tokens, fin.instance) == (6, 0, "vllm-0")
    assert fin2.cached_tokens == 64  # the engine's whole blocks, not Talaria's estimate
    first = engines.submitted[0]
    assert (first.session_id, first.cache_salt, first.prompt) == ("s1", "acme", p.tokens())
    drift = live.core.instances["vllm-0"].kv_drift
    assert [(d.engine_cached, d.core_cached) for d in drift] == [(0, 0), (64, 64)]


async def test_an_end_token_stops_the_call_and_the_engine_request() -> None:
    engines = FakeEngines(["a"], eos_at=3)
    async with make_live(["a"], engines) as live:
        ids, fin = await call(live, "s1", "a", prompt(2), 10)
        live.check_integrity()
    assert (len(ids), fin.finish_reason) == (4, "stop")
    assert ids[-1] == EOS


async def test_a_stream_vllm_ends_early_counts_only_its_tokens() -> None:
    """vLLM ends a stream on its own (an end id only it knew) with no token this step: the
    call ends with the tokens it had, and the core counts no phantom one."""
    engines = FakeEngines(["a"], quit_after=(3, "stop"))
    async with make_live(["a"], engines) as live:
        ids, fin = await call(live, "s1", "a", prompt(4), 10)
        live.check_integrity()
        (req,) = [r for r in live.core.instances["vllm-0"].finished if r.key == (sk("s1"), 0)]
    assert len(ids) == 3 and fin.completion_tokens == 3
    assert req.generated == 3


async def test_a_stream_vllm_aborts_fails_its_call() -> None:
    engines = FakeEngines(["a"], quit_after=(2, "abort"))
    async with make_live(["a"], engines) as live:
        with pytest.raises(InstanceFailed, match="without an answer"):
            await call(live, "s1", "a", prompt(4), 10)
        live.check_integrity()


async def test_forced_answers_reach_the_engine() -> None:
    engines = FakeEngines(["a"])
    forced = (31, 32, 33, 34)
    async with make_live(["a"], engines) as live:
        ids, _ = await call(live, "s1", "a", prompt(3), 4, forced=forced)
    assert ids == forced
    assert engines.submitted[0].forced == forced


async def test_with_sleep_mode_calls_reach_an_engine_only_in_their_models_slot() -> None:
    """Two models taking turns on one device, interleaved sessions: every call is submitted
    after the switch that made its model the awake one, and the awake model serves it."""
    engines = FakeEngines(["a", "b"], sleep_mode=True)
    async with make_live(["a", "b"], engines, sleep_mode=True) as live:
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(call, live, f"s{i}", "ab"[i % 2], prompt(i), 5)
        live.check_integrity()
    assert len(engines.submitted) == 6
    for sub in engines.submitted:
        woke = engines.switches[sub.switches_before - 1].woke if sub.switches_before else "a"
        assert woke == sub.model, (sub, engines.switches)


async def test_resident_engines_take_turns_without_sleeping() -> None:
    """Without sleep mode the engines are resident but share one slot: calls of two models
    run in turns, and no engine is ever put to sleep."""
    engines = FakeEngines(["a", "b"])
    live = make_live(["a", "b"], engines)
    assert list(live.drivers) == ["vllm-0"]
    async with live, anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(call, live, f"s{i}", "ab"[i % 2], prompt(i + 20), 5)
    assert {s.model for s in engines.submitted} == {"a", "b"}
    assert all(s.slept is None for s in engines.switches)
    assert [s.woke for s in engines.switches][:2] in (["a", "b"], ["b", "a"])


async def test_a_failing_engine_fails_only_its_calls() -> None:
    engines = FakeEngines(["a", "b"])
    engines.failing.add("b")
    async with make_live(["a", "b"], engines) as live:
        with pytest.raises(InstanceFailed, match="engine died"):
            await call(live, "sb", "b", prompt(5), 5)
        ids, fin = await call(live, "sa", "a", prompt(6), 5)
        live.check_integrity()
    assert len(ids) == 5 and fin.finish_reason == "length"
