"""The serverless pool's catalog: published shapes, Zipf popularity, the pool it runs on."""

from __future__ import annotations

import itertools
import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from talaria.cost import cluster_estimators
from talaria.errors import ConfigError, UnknownModel
from talaria.policy.baselines import TALARIA
from talaria.sim.catalog import PAPER_SHAPES, model_spec, param_counts
from talaria.sim.pool_catalog import (
    POOL_SHAPES,
    PoolCatalog,
    device_memory_bytes,
    pool_catalog,
    pool_cluster,
    pool_instances,
    zipf_probabilities,
)
from talaria.sim.simulator import Simulator
from talaria.types import ScriptedCall, SessionScript, TokenSeq

BY_REPO = {s.repo: s for s in POOL_SHAPES}

# (total, active) in billions as the model cards round them
CARDS = {
    "meta-llama/Llama-3.1-8B-Instruct": (8.0, 8.0),
    "Qwen/Qwen2.5-7B-Instruct": (7.61, 7.61),
    "meta-llama/Llama-3.1-70B-Instruct": (70.0, 70.0),
    "mistralai/Mistral-7B-Instruct-v0.3": (7.25, 7.25),
    "Qwen/Qwen3-8B": (8.2, 8.2),
    "Qwen/Qwen2.5-72B-Instruct": (72.7, 72.7),
    "Qwen/Qwen2.5-32B-Instruct": (32.5, 32.5),
    "Qwen/Qwen3-32B": (32.8, 32.8),
    "databricks/dbrx-instruct": (132.0, 36.0),
    "Qwen/Qwen2.5-14B-Instruct": (14.7, 14.7),
    "Qwen/Qwen3-14B": (14.8, 14.8),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": (46.7, 12.9),
    "mistralai/Mistral-Small-24B-Instruct-2501": (24.0, 24.0),
    "Qwen/Qwen3-30B-A3B": (30.5, 3.3),
    "mistralai/Mistral-Nemo-Instruct-2407": (12.0, 12.0),
    "microsoft/Phi-3-medium-128k-instruct": (14.0, 14.0),
    "mistralai/Codestral-22B-v0.1": (22.0, 22.0),
    "Qwen/Qwen1.5-110B-Chat": (111.0, 111.0),
    "mistralai/Ministral-8B-Instruct-2410": (8.02, 8.02),
    "mistralai/Mixtral-8x22B-Instruct-v0.1": (141.0, 39.0),
    "mistralai/Mistral-Large-Instruct-2411": (123.0, 123.0),
}


@pytest.mark.parametrize(("repo", "card"), sorted(CARDS.items()))
def test_param_counts_match_the_model_cards(repo: str, card: tuple[float, float]) -> None:
    total, active = param_counts(BY_REPO[repo])
    # a card rounds to its last digit: within 3% (Mistral-Nemo's "12B" is 12.25B)
    assert total / 1e9 == pytest.approx(card[0], rel=0.03)
    assert active / 1e9 == pytest.approx(card[1], rel=0.03)


def test_every_entry_reuses_the_paper_shapes_counting_and_is_cited() -> None:
    assert 12 <= len(POOL_SHAPES) <= 64
    assert len({s.repo for s in POOL_SHAPES}) == len(POOL_SHAPES)
    paper = {s.repo for s in PAPER_SHAPES}
    assert "mistralai/Mixtral-8x22B-Instruct-v0.1" in paper & set(BY_REPO)
    for m in pool_catalog().models:
        assert m.source.startswith(f"https://huggingface.co/{m.name}/blob/main/config.json")


def test_catalog_mixes_dense_7_to_70b_and_moe_over_100b() -> None:
    dense = [s for s in POOL_SHAPES if not s.n_experts]
    moe_big = [s for s in POOL_SHAPES if s.n_experts and param_counts(s)[0] > 100e9]
    assert len(moe_big) >= 4
    assert sum(1 for s in dense if 7e9 <= param_counts(s)[0] <= 73e9) >= 20


def test_catalog_weights_exceed_the_default_pool_device_memory() -> None:
    catalog = pool_catalog()
    cluster = pool_cluster(catalog, 8)
    assert device_memory_bytes(cluster) == 8 * 4 * 141 * 10**9
    assert catalog.weight_bytes > device_memory_bytes(cluster)


def test_zipf_exact_values() -> None:
    assert zipf_probabilities(3, 1.0) == pytest.approx((6 / 11, 3 / 11, 2 / 11))
    assert zipf_probabilities(4, 0.0) == pytest.approx((0.25,) * 4)


@given(st.integers(1, 64), st.floats(0.0, 3.0))
def test_zipf_sums_to_one_and_is_monotone(n: int, s: float) -> None:
    p = zipf_probabilities(n, s)
    assert len(p) == n and math.isclose(sum(p), 1.0, rel_tol=1e-9)
    assert all(a >= b for a, b in itertools.pairwise(p))


@pytest.mark.parametrize(("n", "s"), [(0, 1.0), (3, -0.5), (3, math.nan), (True, 1.0)])
def test_zipf_bad_input(n: int, s: float) -> None:
    with pytest.raises(ConfigError):
        zipf_probabilities(n, s)


def test_catalog_sizes_and_unknown_models() -> None:
    assert len(pool_catalog(12).models) == 12
    with pytest.raises(ConfigError):
        pool_catalog(len(POOL_SHAPES) + 1)
    with pytest.raises(UnknownModel, match="no/such-model"):
        pool_catalog(names=["Qwen/Qwen3-8B", "no/such-model"])
    with pytest.raises(UnknownModel, match="no/such-model"):
        pool_catalog(12).model("no/such-model")
    picked = pool_catalog(names=["Qwen/Qwen3-8B", "Qwen/Qwen3-14B"], zipf_s=2.0)
    assert [m.name for m in picked.models] == ["Qwen/Qwen3-8B", "Qwen/Qwen3-14B"]
    assert picked.probabilities == pytest.approx((0.8, 0.2))


def test_a_model_that_fits_no_instance_is_named() -> None:
    huge = model_spec(
        attrs.evolve(BY_REPO["databricks/dbrx-instruct"], repo="x/huge-dbrx", n_layers=120)
    )
    catalog = PoolCatalog((*pool_catalog(12).models, huge), 1.0, zipf_probabilities(13))
    with pytest.raises(ConfigError, match="x/huge-dbrx"):
        pool_cluster(catalog, 8)


@pytest.mark.parametrize("n", [0, 3, -2])
def test_pool_instances_are_whole_servers(n: int) -> None:
    with pytest.raises(ConfigError):
        pool_instances(n)
    assert [i.name for i in pool_instances(4)] == [f"h200-tp4-{i}" for i in range(4)]
    assert {i.n_devices for i in pool_instances(64)} == {4}


def _one_session(model: str) -> SessionScript:
    prompt = TokenSeq(list(range(200)))
    call = ScriptedCall(
        prompt=prompt,
        history=prompt.extend(list(range(8))),
        output_tokens=8,
        max_new_tokens=8,
        tool_seconds=0.0,
    )
    return SessionScript("s", model, 0.0, (call,))


def test_a_model_off_the_host_tier_is_a_cold_start_from_disk() -> None:
    # host weight budget per TP4 instance: 0.65 x 800 GB = 520 GB; Mixtral-8x22B (281 GB)
    # is preloaded, then neither DBRX (263 GB) nor Mistral Large (245 GB) fits beside it
    names = [
        "mistralai/Mixtral-8x22B-Instruct-v0.1",
        "databricks/dbrx-instruct",
        "mistralai/Mistral-Large-Instruct-2411",
    ]
    cluster = pool_cluster(pool_catalog(names=names), 2)
    sim = Simulator(cluster, TALARIA, cluster_estimators(cluster))
    warm = sim.run([_one_session(names[0])])
    cold = sim.run([_one_session(names[1])])
    assert warm.counters["cold_loads"] == 0 and cold.counters["cold_loads"] == 1
    # the disk read (263 GB at 52 GB/s x 0.5) is priced into the cold session's time
    assert cold.sessions[0].sct_s - warm.sessions[0].sct_s > 263e9 / 26e9 * 0.9
    assert cold.counters["device_busy_ms"] > warm.counters["device_busy_ms"] > 0
