"""A serverless pool's catalog: 40 models of published shapes with Zipf popularity.

Every entry is an :class:`~talaria.sim.catalog.HFShape` built from the fields of the model's
Hugging Face ``config.json`` (the repo is the source; :func:`~talaria.sim.catalog.param_counts`
counts the parameters, and the tests check them against the model cards' rounded figures).
The mix is what a serverless multi-model pool hosts: dense models of 7B to 72B (Llama 2/3,
Mistral, Qwen 2.5/3, Yi, Code Llama and fine-tunes of them) and MoE models over 100B
(Mixtral-8x22B, DBRX, and the 123B dense Mistral Large beside them), several fine-tunes
sharing one base shape as a real catalog does. Together they need ~5.4 TB of bf16 weights:
more than the device memory of the default pool (8 TP4 instances on four 8 x H200 servers,
4.5 TB), so most models live on disk or in host memory and a request for one of them is a
cold start. Qwen3-235B-A22B (470 GB) is left out on purpose: a weight region is the size of
the largest model an instance serves (:class:`~talaria.memory.weights.WeightArena`), and a
470 GB region would leave a TP4 instance 37 GB of KV for every model.

**Popularity.** Sessions pick a model by a Zipf law over the catalog's popularity ranks,
``p(rank k) = k^-s / sum_j j^-s``. The exponent ``s`` is a knob; its default 1.0 is an
ASSUMPTION: no published serverless or LLM-serving trace with a fitted Zipf exponent for
model popularity was found when this was written (Azure Functions' trace, Shahrad et al.
ATC'20, reports heavy skew of invocations per function but fits no Zipf exponent; S-LoRA
and dLoRA draw adapter popularity from a power law with the exponent as a free parameter).
1.0 is the classic Zipf law (Breslau et al., INFOCOM'99 measured web popularity at
0.64-0.83). Ranks follow :data:`POOL_SHAPES` order.

Pure: plain data in, plain data out; nothing mutates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final, cast

import attrs

from talaria.config import ClusterConfig, InstanceSpec, ModelSpec, find_model
from talaria.cost.hardware import profile
from talaria.errors import ConfigError, UnknownModel
from talaria.sim.catalog import PAPER_SHAPES, HFShape, model_spec

DEFAULT_ZIPF_S: Final = 1.0
"""Zipf exponent of model popularity: an assumption (module docstring), not a fitted value."""

INSTANCES_PER_SERVER: Final = 2
"""A pool instance is a TP4 group, half of one 8 x H200 server (``h200-tp8``)."""


def _dense(repo: str, layers: int, hidden: int, heads: int, kv: int, vocab: int, mlp: int,
           context: int, card: str, head_dim: int = 128) -> HFShape:  # fmt: skip
    """A Llama-architecture dense shape (Llama, Mistral, Qwen2/2.5, Phi-3; untied
    embeddings; ``head_dim`` is config.json's, else hidden / heads: 128 for every entry)."""
    return HFShape(repo, layers, hidden, heads, kv, head_dim, vocab, mlp, context,
                   model_card=card)  # fmt: skip


def _qwen3(repo: str, layers: int, hidden: int, heads: int, mlp: int, card: str) -> HFShape:
    """A Qwen3 dense shape (8 KV heads, head_dim 128, q/k norms, untied, 40,960 context)."""
    return HFShape(repo, layers, hidden, heads, 8, 128, 151936, mlp, 40960, qk_norm=True,
                   model_card=card)  # fmt: skip


def _same(base: HFShape, repo: str, **changes: Any) -> HFShape:
    """Another repo with ``base``'s shape (a fine-tune or re-upload; ``changes``: the
    config.json fields in which it differs, e.g. a 32,000-token vocabulary)."""
    return attrs.evolve(base, repo=repo, model_card=f"shape of {base.repo}", **changes)


_PAPER = {s.repo: s for s in PAPER_SHAPES}
_MIXTRAL_8X22B = _PAPER["mistralai/Mixtral-8x22B-Instruct-v0.1"]
_MISTRAL_LARGE = _PAPER["mistralai/Mistral-Large-Instruct-2411"]
_DBRX = HFShape(
    # config.json: d_model, n_heads, n_layers, attn_config.kv_n_heads,
    # ffn_config.ffn_hidden_size, ffn_config.moe_num_experts / moe_top_k, max_seq_len
    "databricks/dbrx-instruct", 40, 6144, 48, 8, 128, 100352, 10752, 32768,
    n_experts=16, top_k=4, model_card="132B total, 36B active",
)  # fmt: skip
_MIXTRAL_8X7B = HFShape(
    "mistralai/Mixtral-8x7B-Instruct-v0.1", 32, 4096, 32, 8, 128, 32000, 14336, 32768,
    n_experts=8, top_k=2, model_card="46.7B total, 12.9B active",
)  # fmt: skip
_QWEN3_30B = HFShape(
    "Qwen/Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 151936, 768, 40960,
    n_experts=128, top_k=8, qk_norm=True, model_card="30.5B total, 3.3B activated",
)  # fmt: skip

POOL_SHAPES: Final[tuple[HFShape, ...]] = (
    _dense("meta-llama/Llama-3.1-8B-Instruct", 32, 4096, 32, 8, 128256, 14336, 131072, "8B"),
    _dense("Qwen/Qwen2.5-7B-Instruct", 28, 3584, 28, 4, 152064, 18944, 32768, "7.61B"),
    _dense("meta-llama/Llama-3.1-70B-Instruct", 80, 8192, 64, 8, 128256, 28672, 131072, "70B"),
    _dense("mistralai/Mistral-7B-Instruct-v0.3", 32, 4096, 32, 8, 32768, 14336, 32768, "7.25B"),
    _qwen3("Qwen/Qwen3-8B", 36, 4096, 32, 12288, "8.2B"),
    _MIXTRAL_8X22B,
    _dense("Qwen/Qwen2.5-72B-Instruct", 80, 8192, 64, 8, 152064, 29568, 32768, "72.7B"),
    _dense("Qwen/Qwen2.5-32B-Instruct", 64, 5120, 40, 8, 152064, 27648, 32768, "32.5B"),
    _qwen3("Qwen/Qwen3-32B", 64, 5120, 64, 25600, "32.8B"),
    _dense("meta-llama/Llama-3.3-70B-Instruct", 80, 8192, 64, 8, 128256, 28672, 131072, "70B"),
    _DBRX,
    _dense("Qwen/Qwen2.5-14B-Instruct", 48, 5120, 40, 8, 152064, 13824, 32768, "14.7B"),
    _qwen3("Qwen/Qwen3-14B", 40, 5120, 40, 17408, "14.8B"),
    _MIXTRAL_8X7B,
    _dense(
        "mistralai/Mistral-Small-24B-Instruct-2501", 40, 5120, 32, 8, 131072, 32768, 32768, "24B"
    ),
    _MISTRAL_LARGE,
    _QWEN3_30B,
    _dense("mistralai/Mistral-Nemo-Instruct-2407", 40, 5120, 32, 8, 131072, 14336, 1024000, "12B"),
    _dense(
        "deepseek-ai/DeepSeek-R1-Distill-Llama-70B", 80, 8192, 64, 8, 128256, 28672, 131072, "70B"
    ),
    _dense(
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", 64, 5120, 40, 8, 152064, 27648, 131072, "32B"
    ),
    _same(_MIXTRAL_8X22B, "mistralai/Mixtral-8x22B-v0.1"),
    _dense("Qwen/Qwen2.5-Coder-32B-Instruct", 64, 5120, 40, 8, 152064, 27648, 32768, "32.5B"),
    _dense("Qwen/QwQ-32B", 64, 5120, 40, 8, 152064, 27648, 40960, "32.5B"),
    _same(_DBRX, "databricks/dbrx-base"),
    _dense(
        "nvidia/Llama-3.1-Nemotron-70B-Instruct-HF", 80, 8192, 64, 8, 128256, 28672, 131072, "70B"
    ),
    _dense("NousResearch/Hermes-3-Llama-3.1-70B", 80, 8192, 64, 8, 128256, 28672, 131072, "70B"),
    _dense("Qwen/Qwen2-72B-Instruct", 80, 8192, 64, 8, 152064, 29568, 32768, "72.7B"),
    _same(_MISTRAL_LARGE, "mistralai/Mistral-Large-Instruct-2407"),
    _dense("microsoft/Phi-3-medium-128k-instruct", 40, 5120, 40, 10, 32064, 17920, 131072, "14B"),
    _dense("Qwen/Qwen2-7B-Instruct", 28, 3584, 28, 4, 152064, 18944, 32768, "7.6B"),
    _dense("mistralai/Codestral-22B-v0.1", 56, 6144, 48, 8, 32768, 16384, 32768, "22B"),
    _same(_MIXTRAL_8X7B, "mistralai/Mixtral-8x7B-v0.1"),
    _same(_QWEN3_30B, "Qwen/Qwen3-30B-A3B-Instruct-2507", max_context=262144),
    _dense("Qwen/Qwen1.5-110B-Chat", 80, 8192, 64, 8, 152064, 49152, 32768, "111B"),
    _same(_MIXTRAL_8X22B, "alpindale/WizardLM-2-8x22B", vocab_size=32000),
    _dense("meta-llama/Llama-3.1-70B", 80, 8192, 64, 8, 128256, 28672, 131072, "70B"),
    _same(_MIXTRAL_8X22B, "mistral-community/Mixtral-8x22B-v0.1", vocab_size=32000),
    _dense(
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", 32, 4096, 32, 8, 128256, 14336, 131072, "8B"
    ),
    _dense(
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", 48, 5120, 40, 8, 152064, 13824, 131072, "14.8B"
    ),
    _dense("NousResearch/Hermes-3-Llama-3.1-8B", 32, 4096, 32, 8, 128256, 14336, 131072, "8B"),
    _dense("Qwen/Qwen2.5-Coder-7B-Instruct", 28, 3584, 28, 4, 152064, 18944, 32768, "7.61B"),
    _dense("mistralai/Ministral-8B-Instruct-2410", 36, 4096, 32, 8, 131072, 12288, 32768, "8.02B"),
    _same(_MIXTRAL_8X22B, "HuggingFaceH4/zephyr-orpo-141b-A35b-v0.1", vocab_size=32000),
)
"""The pool's catalog in popularity-rank order (rank 1 first), each from its config.json."""


def zipf_probabilities(n: int, s: float = DEFAULT_ZIPF_S) -> tuple[float, ...]:
    """``p(k) = k^-s / sum_j j^-s`` for ranks ``k = 1..n``: sums to 1, non-increasing
    (uniform at ``s = 0``). ``ConfigError`` for ``n < 1`` or ``s`` negative or not finite."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"a Zipf law needs at least one rank, got n={n!r}")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
        raise ConfigError(f"the Zipf exponent must be a finite number >= 0, got {s!r}")
    weights = [k ** -float(s) for k in range(1, n + 1)]
    total = math.fsum(weights)
    return tuple(w / total for w in weights)


@attrs.frozen
class PoolCatalog:
    """The models a pool serves, most popular first, with the Zipf probability of each
    (``probabilities[i]`` is the share of sessions that pick ``models[i]``)."""

    models: tuple[ModelSpec, ...]
    zipf_s: float
    probabilities: tuple[float, ...]

    @property
    def weight_bytes(self) -> int:
        """Bytes of all the catalog's weights (bf16)."""
        return sum(m.weight_bytes for m in self.models)

    def model(self, name: str) -> ModelSpec:
        """The catalog's model ``name``; ``UnknownModel`` naming the catalog otherwise."""
        return find_model(self.models, name, "the catalog holds")


def pool_catalog(
    n_models: int = len(POOL_SHAPES),
    zipf_s: float = DEFAULT_ZIPF_S,
    names: Sequence[str] | None = None,
) -> PoolCatalog:
    """The first ``n_models`` of :data:`POOL_SHAPES` (12 to all of them), or the models
    ``names`` in that order, ranked for popularity in the order given. ``UnknownModel``
    for a name not in the catalog; ``ConfigError`` for a bad size or exponent."""
    by_repo = {s.repo: s for s in POOL_SHAPES}
    if names is not None:
        missing = [n for n in names if n not in by_repo]
        if missing:
            raise UnknownModel(f"unknown models {missing}; the pool catalog holds {list(by_repo)}")
        if len(set(names)) != len(names):
            raise ConfigError(f"a catalog names each model once, got {list(names)}")
        shapes = tuple(by_repo[n] for n in names)
    else:
        if isinstance(n_models, bool) or not isinstance(n_models, int):
            raise ConfigError(f"n_models must be an integer, got {n_models!r}")
        if not 1 <= n_models <= len(POOL_SHAPES):
            raise ConfigError(f"n_models must be in 1..{len(POOL_SHAPES)}, got {n_models}")
        shapes = POOL_SHAPES[:n_models]
    probs = zipf_probabilities(len(shapes), zipf_s)
    return PoolCatalog(tuple(model_spec(s) for s in shapes), float(zipf_s), probs)


def pool_instances(n_instances: int) -> tuple[InstanceSpec, ...]:
    """``n_instances`` TP4 instances (an even number: two per 8 x H200 server), named
    ``h200-tp4-0`` ... ``ConfigError`` for an odd or non-positive count."""
    if isinstance(n_instances, bool) or not isinstance(n_instances, int) or n_instances < 1:
        raise ConfigError(f"n_instances must be a positive integer, got {n_instances!r}")
    if n_instances % INSTANCES_PER_SERVER:
        raise ConfigError(
            f"a pool instance is half an 8 x H200 server (TP4); {n_instances} instances do "
            f"not fill whole servers: use an even number"
        )
    per_server = profile("h200-tp8").instances(INSTANCES_PER_SERVER)
    return tuple(
        attrs.evolve(inst, name=f"h200-tp4-{k * INSTANCES_PER_SERVER + i}")
        for k in range(n_instances // INSTANCES_PER_SERVER)
        for i, inst in enumerate(per_server)
    )


def pool_cluster(catalog: PoolCatalog, n_instances: int = 8) -> ClusterConfig:
    """The catalog on ``n_instances`` TP4 instances, every instance serving every model
    (one weight region each: a model switch is a copy from host memory, or from disk then
    host memory for a model not in the instance's host tier).

    Raises ``ConfigError`` naming the first model that fits no instance with room for at
    least one KV block of a call at its full context beside it (the weight region is the
    largest model's)."""
    instances = pool_instances(n_instances)
    usable = instances[0].usable_device_bytes
    for m in catalog.models:
        if m.weight_bytes >= usable:
            raise ConfigError(
                f"catalog model {m.name} needs {m.weight_bytes / 1e9:.1f} GB of weights; a "
                f"pool instance (TP4 H200) has {usable / 1e9:.1f} GB usable: it fits no instance"
            )
    # ClusterConfig's converters are typed Iterable[_T_co] by the attrs mypy plugin; see
    # talaria.sim.catalog.paper_cluster.
    return ClusterConfig(models=cast(Any, catalog.models), instances=cast(Any, instances))


def device_memory_bytes(cluster: ClusterConfig) -> int:
    """All the device memory of ``cluster``'s instances together (bytes)."""
    return sum(i.device_memory_bytes for i in cluster.instances)
