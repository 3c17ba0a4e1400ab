"""Instances as Ray actors (``talaria.backends.ray``) on a local multi-node Ray cluster
(``ray.cluster_utils.Cluster``: a head without instances and two worker nodes offering one
``talaria_instance`` each), tiny random-weight models in float32: the same greedy answers
as in process (model switches and weight staging included), calls routed to the instance
(node) that holds the session's KV, a node removed mid-run with no other session lost and
the survivors' integrity intact, the lost instance rejoining on a node that joined, and the
HTTP server's malformed-request matrix answered as in process. Marker ``ray`` (``.ci/run``
installs the ``ray`` extra and runs them); about two minutes, most of it Ray starting."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio
import attrs
import httpx
import pytest
import torch

from talaria.api import TalariaConfig
from talaria.backends.embedded import cluster_from_loaded, load_catalog_model
from talaria.backends.ray.actor import Worker
from talaria.backends.vllm.executor import VllmExecutor
from talaria.config import InstanceSpec
from talaria.errors import InstanceLost
from talaria.executor import Executor, Layout
from talaria.generation import SamplingParams, StopChecker
from talaria.policy.baselines import POLICIES
from talaria.runtime.live import LiveCluster
from talaria.runtime.streams import Failed, Finished
from talaria.server.app import app_and_talaria
from talaria.types import TokenSeq
from tests.backends.test_vllm_executor import FakeEngines, make_live, prompt
from tests.backends.test_vllm_executor import call as vllm_call
from tests.helpers import sk
from tests.server.conftest import requires_smollm2
from tests.server.matrix import check_malformed, malformed_matrix
from tests.server.server_fakes import live_server

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

    from talaria.backends.ray.cluster import RayCluster

# The ray extra is imported by the fixtures, not here: a run that deselects these tests
# (the default markers) collects this module without it, and a run that selects them
# without it skips them, which fails under CI (tests/conftest.py).
pytestmark = [pytest.mark.ray, requires_smollm2]

MB = 10**6
MODELS = ("smollm2-tiny-dummy", "qwen2-tiny-dummy")
NODE = {"num_cpus": 1, "resources": {"talaria_instance": 1}}
POLICY = attrs.evolve(POLICIES["talaria"], slot_max_s=0.5, slot_linger_s=0.05)


def specs(device_bytes: int = 20 * MB) -> list[InstanceSpec]:
    """Two instances whose device budget holds one tiny model and a little KV (so a second
    model is switched in, partly from staging)."""
    return [
        InstanceSpec(
            name=f"cpu-{i}",
            hardware="cpu",
            device_memory_bytes=device_bytes,
            host_memory_bytes=60 * MB,
            block_size=16,
            memory_utilization=1.0,
        )
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        c.add_node(**NODE)
    ray.init(address=c.address, configure_logging=False, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def on_ray(cluster: Cluster) -> Iterator[RayCluster]:
    from talaria.backends.ray.cluster import build_ray_cluster

    rc = build_ray_cluster(specs(), MODELS, POLICY, address="auto", dtype="float32")
    try:
        yield rc
    finally:
        rc.close()


Answer = tuple[tuple[int, ...], str, int]


async def one_call(
    live: LiveCluster, sid: str, model: str, prompt: list[int], max_tokens: int = 8
) -> Answer | InstanceLost:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with live.session(sk(sid)).lock:
        _, events = await live.submit(sk(sid), model, TokenSeq(prompt), params, StopChecker(params))
        ids: list[int] = []
        async for ev in events:
            if isinstance(ev, Finished):
                return tuple(ids), ev.instance, ev.cached_tokens
            if isinstance(ev, Failed):
                if isinstance(ev.error, InstanceLost):
                    return ev.error
                raise ev.error
            ids += ev.token_ids
    raise AssertionError("the call's stream ended without Finished or Failed")


async def play(cluster: Any, sessions: int, calls: int) -> dict[tuple[int, int], Answer]:
    """``sessions`` concurrent sessions alternating the two models, ``calls`` each; each
    prompt is the last one plus its answer plus 30 tool-output tokens."""
    out: dict[tuple[int, int], Answer] = {}
    async with LiveCluster(cluster.core, cluster.runners) as live:

        async def session(i: int) -> None:
            prompt = list(range(5 + i, 105 + i))
            for c in range(calls):
                answer = await one_call(live, f"s{i}", MODELS[i % 2], prompt)
                assert not isinstance(answer, InstanceLost)
                out[(i, c)] = answer
                prompt = prompt + list(answer[0]) + list(range(200, 230))

        async with anyio.create_task_group() as tg:
            for i in range(sessions):
                tg.start_soon(session, i)
        live.check_integrity()
    return out


def test_actors_answer_as_the_in_process_engine(on_ray: RayCluster, cluster: Cluster) -> None:
    nodes = {r.info.node_id for r in on_ray.runners.values()}
    workers = {n.node_id for n in cluster.worker_nodes}
    assert len(nodes) == 2 and nodes <= workers  # one instance per node, none on the head
    remote = anyio.run(play, on_ray, 4, 3)
    loaded = {m: load_catalog_model(m, torch.float32) for m in MODELS}
    local = anyio.run(play, cluster_from_loaded(specs(), loaded, POLICY, torch.float32), 4, 3)
    assert {k: v[0] for k, v in remote.items()} == {k: v[0] for k, v in local.items()}
    switches = sum(i.counters.model_switches for i in on_ray.core.instances.values())
    assert switches >= 2  # both models ran on an instance that holds one at a time
    assert sum(r.steps for r in on_ray.runners.values()) > 0


async def sequential_sessions(cluster: Any) -> list[list[Answer]]:
    """Two sessions of four calls, one at a time."""
    seen: list[list[Answer]] = []
    async with LiveCluster(cluster.core, cluster.runners) as live:
        for i in range(2):
            prompt, answers = list(range(10 + i, 170 + i)), []
            for _ in range(4):
                answer = await one_call(live, f"kv{i}", MODELS[0], prompt)
                assert not isinstance(answer, InstanceLost)
                answers.append(answer)
                prompt = prompt + list(answer[0]) + list(range(300, 340))
            seen.append(answers)
        live.check_integrity()
    return seen


def test_calls_follow_the_session_kv(on_ray: RayCluster) -> None:
    """Each continuation lands on the instance (so the node) that computed its history and
    reuses as much of it as in process."""
    remote = anyio.run(sequential_sessions, on_ray)
    loaded = {m: load_catalog_model(m, torch.float32) for m in MODELS}
    local = anyio.run(
        sequential_sessions, cluster_from_loaded(specs(), loaded, POLICY, torch.float32)
    )
    for answers in remote:
        assert len({a[1] for a in answers}) == 1  # one instance for the whole session
    # the whole history but its last block (160-token prompts growing by 48 a call)
    assert [[a[2] for a in s] for s in remote] == [[0, 144, 192, 240]] * 2
    assert [[a[2] for a in s] for s in local] == [[0, 144, 192, 240]] * 2


def test_node_removed_mid_run_then_a_node_joins(on_ray: RayCluster, cluster: Cluster) -> None:
    """A node dies while both instances serve: the sessions on the survivor never notice;
    the dead instance's calls are rerouted (nothing streamed) or resumed on the survivor
    (they had streamed), or fail with InstanceLost and are retried by their client; every
    session completes; the survivor's integrity holds;
    its KV is recomputed where the sessions continue. A node that joins hosts the lost
    instance again and is routed to."""
    victim_name = "cpu-0"
    victim_node = on_ray.runners[victim_name].info.node_id
    node = next(n for n in cluster.worker_nodes if n.node_id == victim_node)
    lost: list[tuple[str, int]] = []
    done: dict[str, list[str]] = {}

    async def run() -> dict[str, Any]:
        async with LiveCluster(on_ray.core, on_ray.runners, recover_after_s=1.0) as live:
            started = anyio.Event()

            async def session(i: int) -> None:
                sid, prompt = f"f{i}", list(range(7 + i, 400 + i))
                where: list[str] = done.setdefault(sid, [])
                c = 0
                while c < 6:
                    answer = await one_call(live, sid, MODELS[0], prompt, max_tokens=24)
                    if isinstance(answer, InstanceLost):
                        lost.append((sid, c))
                        continue  # the client retries; the router picks a live instance
                    where.append(answer[1])
                    if c == 1:
                        started.set()
                    prompt = prompt + list(answer[0]) + list(range(500, 530))
                    c += 1

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(session, i)
                await started.wait()
                with anyio.fail_after(60):  # until the victim holds a call
                    while not any(lc.instance == victim_name for lc in live.calls.values()):
                        await anyio.sleep(0.005)
                await anyio.to_thread.run_sync(cluster.remove_node, node)
            survivors = [n for n in live.core.instances if n != victim_name]
            await live.check_integrity_between_steps()
            for name in survivors:
                live.core.instances[name].check_integrity()
            stats = {
                "lost": live.instances_lost,
                "rerouted": live.calls_rerouted,
                "resumed": live.calls_resumed,
                "recomputed": live.tokens_recomputed,
                "down": live.drivers[victim_name].down,
            }
            cluster.add_node(**NODE)
            with anyio.fail_after(120):
                while live.drivers[victim_name].down:
                    await anyio.sleep(0.2)
            back: list[str] = []
            async with anyio.create_task_group() as tg:

                async def fresh(i: int) -> None:
                    answer = await one_call(live, f"new{i}", MODELS[0], list(range(3, 300)))
                    assert not isinstance(answer, InstanceLost)
                    back.append(answer[1])

                for i in range(6):
                    tg.start_soon(fresh, i)
            live.check_integrity()
            stats["back"] = back
            return stats

    stats = anyio.run(run)
    assert all(len(w) == 6 for w in done.values()) and len(done) == 4  # no session lost
    assert stats["lost"] == 1 and stats["down"]
    # the victim's call went somewhere: rerouted (nothing streamed), resumed elsewhere
    # (it had streamed), or failed and retried by its client (nowhere to resume)
    assert stats["rerouted"] + stats["resumed"] + len(lost) >= 1
    assert stats["recomputed"] > 0  # sessions that moved recomputed their history
    moved = [w for w in done.values() if victim_name in w]
    assert moved and all(w[-1] != victim_name for w in moved)  # continued elsewhere
    assert victim_name in stats["back"]  # the rejoined instance is routed to
    assert on_ray.runners[victim_name].info.node_id != victim_node


@pytest.fixture(scope="module")
def server(cluster: Cluster) -> Iterator[httpx.Client]:
    config = TalariaConfig(
        models=("smollm2-tiny-dummy",),
        instances=2,
        device_memory_bytes=100 * MB,
        host_memory_bytes=100 * MB,
        dtype="float32",
        api_keys=("k",),
        ray="auto",
        shutdown_grace_s=5.0,
    )
    app, _ = app_and_talaria(config, max_body_bytes=256 * 1024)
    auth = {"Authorization": "Bearer k"}
    with (
        live_server(app, startup_timeout_s=300) as url,
        httpx.Client(base_url=url, headers=auth, timeout=60) as c,
    ):
        yield c


@pytest.mark.parametrize(
    ("name", "path", "body", "headers", "status", "words"),
    malformed_matrix("smollm2-tiny-dummy", "k"),
)
def test_malformed_requests_as_in_process(
    server: httpx.Client,
    name: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    words: str,
) -> None:
    check_malformed(server, "smollm2-tiny-dummy", path, body, headers, status, words)


# ------------------------------------------------------------------ vLLM's executor over the wire


class _Given(Worker):
    """A worker whose executor is given (vLLM's, over fake engines)."""

    def __init__(self, name: str, executor: VllmExecutor) -> None:
        super().__init__(name, executor.models)
        self.executor = executor

    def _ready(self, layout: Layout) -> VllmExecutor:
        return self.executor

    def _eos(self) -> dict[str, tuple[int, ...]]:
        return {m: tuple(sorted(ids)) for m, ids in self.executor.eos.items()}


class _Local:
    """An actor's methods called in this process: ``.remote`` runs them, and the answer
    stands for its own object ref."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def __getattr__(self, name: str) -> Any:
        return types.SimpleNamespace(remote=getattr(self.worker, name))


def over_wire(name: str, layout: Layout, executor: VllmExecutor) -> Executor:
    from talaria.backends.ray.executor import RayExecutor

    class InProcess(RayExecutor):
        def _await_step(self, ref: Any) -> Any:
            return ref

        def _check_health(self) -> None:
            return None

    worker = _Given(name, executor)
    return InProcess(name, layout, _Local(worker), worker.attach(layout))


class _Evicting(FakeEngines):
    """Engines whose prefix cache has lost a block of what the core counts as cached."""

    def _cached(self, salt: str | None, prompt: tuple[int, ...]) -> int:
        return max(0, super()._cached(salt, prompt) - 32)


def test_vllms_executor_over_the_wire_as_in_process() -> None:
    """The schedules of vLLM's executor cross the Ray wire whole: the engine's tokens, its
    prefix-cache hits (``cached``: here a block short of the core's count), a stream it
    ended on its own (``silent``: the core counts no phantom token), no KV moves executed;
    the same as in process, call for call."""

    async def play(wrap: Any) -> tuple[list[tuple[Any, ...]], list[tuple[int, int]]]:
        engines = _Evicting(["a"], quit_after=(3, "stop"))
        out = []
        async with make_live(["a"], engines, wrap=wrap) as live:
            inst = live.core.instances["vllm-0"]
            p = prompt(1)
            for i, n in enumerate((2, 2, 10)):  # the last call: vLLM stops it after 3
                ids, fin = await vllm_call(live, "s1", "a", p, n)
                (req,) = [r for r in inst.finished if r.key == (sk("s1"), i)]
                out.append((ids, fin.cached_tokens, fin.completion_tokens, req.generated))
                p = p.extend(list(ids) + [9] * (30 + i))
            live.check_integrity()
            assert not live.drivers["vllm-0"].runner.executes_kv_moves
            drift = [(d.engine_cached, d.core_cached) for d in inst.kv_drift]
        return out, drift

    wired = anyio.run(play, over_wire)
    assert wired == anyio.run(play, None)
    answers, drift = wired
    assert [a[1] for a in answers] == [0, 32, 64] and drift == [(0, 0), (32, 64), (64, 96)]
    assert answers[-1][2:] == (3, 3)
