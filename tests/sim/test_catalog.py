"""Paper-scale catalog: published shapes, hand-computed sizes, and the does-not-fit premise."""

from __future__ import annotations

import pytest

from talaria.config import GB
from talaria.cost.hardware import profile
from talaria.errors import ConfigError
from talaria.sim.catalog import PAPER_MODELS, PAPER_SHAPES, paper_cluster, param_counts

BY_NAME = {m.name: m for m in PAPER_MODELS}
QWEN = BY_NAME["Qwen/Qwen3-235B-A22B"]
LARGE = BY_NAME["mistralai/Mistral-Large-Instruct-2411"]
MIXTRAL = BY_NAME["mistralai/Mixtral-8x22B-Instruct-v0.1"]


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        # layers, hidden, heads, kv heads, head dim, vocab, max context (config.json)
        ("Qwen/Qwen3-235B-A22B", (94, 4096, 64, 4, 128, 151936, 131072)),
        ("mistralai/Mistral-Large-Instruct-2411", (88, 12288, 96, 8, 128, 32768, 131072)),
        ("mistralai/Mixtral-8x22B-Instruct-v0.1", (56, 6144, 48, 8, 128, 32768, 65536)),
    ],
)
def test_published_shapes(name: str, shape: tuple[int, ...]) -> None:
    m = BY_NAME[name]
    got = (m.n_layers, m.hidden_size, m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size)
    assert (*got, m.max_context) == shape
    assert m.dtype_bytes == 2.0 and m.kv_dtype_bytes == 2
    assert m.source.startswith(f"https://huggingface.co/{m.name}/blob/main/config.json")


def test_kv_bytes_per_token_by_hand() -> None:
    # 2 (K and V) * layers * kv heads * head dim * 2 bytes
    assert QWEN.kv_bytes_per_token == 2 * 94 * 4 * 128 * 2 == 192_512  # 188 KiB
    assert LARGE.kv_bytes_per_token == 2 * 88 * 8 * 128 * 2 == 360_448  # 352 KiB
    assert MIXTRAL.kv_bytes_per_token == 2 * 56 * 8 * 128 * 2 == 229_376  # 224 KiB


def test_qwen3_parameter_counts_by_hand() -> None:
    attention = 4096 * 8192 * 2 + 4096 * 512 * 2  # Q, O (64 x 128) and K, V (4 x 128)
    norms = 2 * 4096 + 2 * 128  # input/post-attention RMSNorm, q_norm, k_norm
    expert = 3 * 4096 * 1536
    router = 4096 * 128
    outside = 2 * 151936 * 4096 + 4096  # untied embeddings, final norm
    total = 94 * (attention + norms + router + 128 * expert) + outside
    active = 94 * (attention + norms + router + 8 * expert) + outside
    assert (QWEN.total_params, QWEN.active_params) == (total, active)
    assert total == 235_093_634_560
    assert active == 22_190_763_520


def test_mistral_large_parameter_counts_by_hand() -> None:
    layer = 12288 * 12288 * 2 + 12288 * 1024 * 2 + 3 * 12288 * 28672 + 2 * 12288
    total = 88 * layer + 2 * 32768 * 12288 + 12288
    assert LARGE.total_params == LARGE.active_params == total == 122_610_069_504


def test_mixtral_parameter_counts_by_hand() -> None:
    base = 6144 * 6144 * 2 + 6144 * 1024 * 2 + 2 * 6144 + 6144 * 8  # attention, norms, router
    expert = 3 * 6144 * 16384
    outside = 2 * 32768 * 6144 + 6144
    assert MIXTRAL.total_params == 56 * (base + 8 * expert) + outside == 140_630_071_296
    assert MIXTRAL.active_params == 56 * (base + 2 * expert) + outside == 39_161_468_928


@pytest.mark.parametrize(
    ("name", "card_total", "card_active"),
    [
        ("Qwen/Qwen3-235B-A22B", 235e9, 22e9),
        ("mistralai/Mistral-Large-Instruct-2411", 123e9, 123e9),
        ("mistralai/Mixtral-8x22B-Instruct-v0.1", 141e9, 39e9),
    ],
)
def test_counts_agree_with_model_cards(name: str, card_total: float, card_active: float) -> None:
    m = BY_NAME[name]
    assert m.total_params == pytest.approx(card_total, rel=0.01)
    assert m.active_params == pytest.approx(card_active, rel=0.01)


def test_param_counts_matches_specs() -> None:
    for shape, model in zip(PAPER_SHAPES, PAPER_MODELS, strict=True):
        assert param_counts(shape) == (model.total_params, model.active_params)


def test_weight_gb_by_hand() -> None:
    assert QWEN.weight_bytes == 470_187_269_120  # 470.2 GB
    assert LARGE.weight_bytes == 245_220_139_008  # 245.2 GB
    assert MIXTRAL.weight_bytes == 281_260_142_592  # 281.3 GB


def test_three_models_do_not_fit_one_tp8_server_with_a_useful_kv_pool() -> None:
    (tp8,) = profile("h200-tp8").instances(1)
    # 8 x 141 GB = 1,128 GB device memory; 90% usable = 1,015.2 GB; keeping 10% of that for
    # KV leaves 913.68 GB for weights, but the three models need 996.67 GB.
    assert tp8.usable_device_bytes == 1_015_200_000_000
    weights = sum(m.weight_bytes for m in PAPER_MODELS)
    assert weights == 996_667_550_720
    assert weights > tp8.usable_device_bytes * 0.9
    # each one alone fits with room to spare
    assert all(m.weight_bytes < tp8.usable_device_bytes / 2 for m in PAPER_MODELS)
    assert weights / GB == pytest.approx(996.67, abs=0.01)


def test_paper_cluster() -> None:
    one = paper_cluster()
    assert [i.n_devices for i in one.instances] == [8]
    assert one.models == PAPER_MODELS
    two = paper_cluster(2)
    assert [i.name for i in two.instances] == ["h200-tp8-0", "h200-tp8-1"]
    assert all(i.n_devices == 4 and i.hardware == "h200-tp8" for i in two.instances)
    # TP2 holds 253.8 GB usable: Qwen3-235B's 470 GB of weights cannot be served
    with pytest.raises(ConfigError, match="Qwen3-235B"):
        paper_cluster(4)
