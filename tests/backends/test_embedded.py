from __future__ import annotations

import pytest
import torch

from talaria.backends.embedded import EmbeddedInstance, build_embedded
from talaria.config import InstanceSpec
from talaria.errors import BadRequest, ConfigError, UnknownModel
from talaria.policy.baselines import POLICIES
from talaria.runtime.local import LocalInstance
from talaria.types import Call, TokenSeq

GB = 10**9


def cpu_instance() -> InstanceSpec:
    return InstanceSpec(
        name="cpu-0",
        hardware="cpu",
        device_memory_bytes=2 * GB,
        host_memory_bytes=2 * GB,
        block_size=16,
        memory_utilization=0.9,
    )


@pytest.fixture(scope="module")
def smol() -> EmbeddedInstance:
    return build_embedded(cpu_instance(), ["smollm2-135m"], POLICIES["talaria"], torch.bfloat16)


def test_smollm2_answers_a_chat_and_keeps_serving_after_a_bad_request(
    smol: EmbeddedInstance,
) -> None:
    local = smol.instance
    tok = smol.tokenizers["smollm2-135m"]
    assert tok is not None
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    prompt = TokenSeq(tok.encode(text, add_special_tokens=False))
    with pytest.raises(BadRequest, match="vocabulary"):
        local.submit(Call("bad", 0, "smollm2-135m", TokenSeq([10**6]), 8), now=0.0)
    call = Call("s", 0, "smollm2-135m", prompt, 16)
    out = local.generate([call])
    answer = tok.decode(list(out[call.key]), skip_special_tokens=True)
    assert answer.strip()
    assert local.idle and not local.records
    local.core.check_integrity()


def test_unknown_model_and_empty_list_are_refused() -> None:
    with pytest.raises(UnknownModel, match="catalog"):
        build_embedded(cpu_instance(), ["gpt-5"], POLICIES["talaria"])
    with pytest.raises(ConfigError):
        build_embedded(cpu_instance(), [], POLICIES["talaria"])


def test_steps_use_the_builders_thread_count_on_whichever_thread_runs_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.set_num_threads holds for the thread that calls it (each thread's OpenMP team
    starts at the process default): a cluster built under 1 thread sets 1 on the worker
    thread that executes each of its steps, as the live runtime runs them."""
    import threading

    from tests.helpers import tiny_cluster

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cluster = tiny_cluster()
    finally:
        torch.set_num_threads(before)
    name, runner = next(iter(cluster.runners.items()))
    assert runner.threads == 1
    local = LocalInstance(cluster.core.instances[name], runner)
    seen: list[tuple[int, int]] = []
    real = torch.set_num_threads

    def record(n: int) -> None:
        seen.append((threading.get_ident(), n))
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", record)
    out: list[object] = []
    call = Call("s", 0, "llama-tiny", TokenSeq(range(1, 20)), 3)
    worker = threading.Thread(target=lambda: out.append(local.generate([call])))
    worker.start()
    worker.join()
    assert out and seen  # it ran, and set the threads
    assert {ident for ident, _ in seen} == {worker.ident}
    assert {n for _, n in seen} == {1}
    assert len(seen) >= 3  # once per step: a prefill and the decodes
    monkeypatch.undo()
    torch.set_num_threads(before)


def test_a_runner_needs_a_thread() -> None:
    from talaria.backends.embedded import cluster_from_loaded
    from talaria.engine.loader import load_dummy
    from tests.helpers import llama_config

    loaded = {"llama-tiny": load_dummy(llama_config().to_dict(), seed=1, dtype=torch.float32)}
    with pytest.raises(ConfigError, match="at least one thread"):
        cluster_from_loaded([cpu_instance()], loaded, POLICIES["talaria"], torch.float32, threads=0)
