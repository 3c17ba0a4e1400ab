"""Paper-scale models: three >100B models with their published shapes, for the simulator only.

Each entry is built from the fields of the model's Hugging Face ``config.json`` (layers,
hidden size, attention and KV heads, head dim, vocabulary, MLP / expert sizes, context) and
its parameter counts are computed from that architecture, so every number traces back to the
config; the model cards' rounded figures (235B/22B, 123B, 141B/39B) are checked against the
computed counts in the tests.

Parameter counting (no biases in any of the three): per layer, attention ``Q, O: h x H d``
and ``K, V: h x K d``; SwiGLU MLPs of three ``h x I`` matrices (per expert for MoE, plus an
``h x E`` router); two RMSNorm vectors of ``h`` (Qwen3 adds ``q_norm`` and ``k_norm`` of
``d``); then untied input and output embeddings ``2 V h`` and a final norm ``h``. Active
parameters count ``top_k`` experts instead of all ``E``.

Together the three need ~997 GB of bf16 weights: more than one 8 x H200 server can hold
next to a useful KV pool, which is what forces model switching on the paper's testbed.
"""

from __future__ import annotations

from typing import Any, Final, cast

import attrs

from talaria.config import ClusterConfig, ModelSpec
from talaria.cost.hardware import profile
from talaria.errors import ConfigError


@attrs.frozen
class HFShape:
    """The ``config.json`` fields the catalog reads (names mapped to Hugging Face keys).

    ``n_experts`` is 0 for a dense model (``num_local_experts`` / ``num_experts`` otherwise);
    ``mlp_size`` is ``intermediate_size`` for dense models and ``moe_intermediate_size`` (Qwen3)
    or ``intermediate_size`` (Mixtral) per expert for MoE models.
    """

    repo: str
    n_layers: int  # num_hidden_layers
    hidden_size: int  # hidden_size
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim (or hidden_size / num_attention_heads)
    vocab_size: int  # vocab_size
    mlp_size: int
    max_context: int  # max_position_embeddings
    n_experts: int = 0
    top_k: int = 0  # num_experts_per_tok
    qk_norm: bool = False
    model_card: str = ""

    @property
    def config_url(self) -> str:
        return f"https://huggingface.co/{self.repo}/blob/main/config.json"


def param_counts(shape: HFShape) -> tuple[int, int]:
    """(total, active) parameters of a Llama/Mixtral/Qwen3-MoE style decoder with this shape."""
    h, d = shape.hidden_size, shape.head_dim
    attention = 2 * h * shape.n_heads * d + 2 * h * shape.n_kv_heads * d
    norms = 2 * h + (2 * d if shape.qk_norm else 0)
    mlp = 3 * h * shape.mlp_size
    if shape.n_experts:
        router = h * shape.n_experts
        layer_total = attention + norms + router + shape.n_experts * mlp
        layer_active = attention + norms + router + shape.top_k * mlp
    else:
        layer_total = layer_active = attention + norms + mlp
    outside = 2 * shape.vocab_size * h + h  # untied embeddings + final norm
    return (
        shape.n_layers * layer_total + outside,
        shape.n_layers * layer_active + outside,
    )


def model_spec(shape: HFShape) -> ModelSpec:
    """A bf16 :class:`ModelSpec` for ``shape``, citing its config.json and model card."""
    total, active = param_counts(shape)
    source = f"{shape.config_url}; params computed from it"
    if shape.model_card:
        source += f" (model card: {shape.model_card})"
    return ModelSpec.of_shape(
        shape,
        shape.repo,
        total_params=total,
        active_params=active,
        dtype_bytes=2.0,
        kv_dtype_bytes=2,
        source=source,
    )


PAPER_SHAPES: Final = (
    HFShape(
        repo="Qwen/Qwen3-235B-A22B",
        n_layers=94,
        hidden_size=4096,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        mlp_size=1536,  # moe_intermediate_size
        # config.json says 40,960 (32,768 native); the model card documents 131,072 with YaRN
        # (rope_scaling factor 4), the setting for long agent histories, so we serve that.
        max_context=131072,
        n_experts=128,
        top_k=8,
        qk_norm=True,
        model_card="235B total, 22B activated, 94 layers, 64 Q / 4 KV heads, 128 experts, 8 "
        "activated; https://huggingface.co/Qwen/Qwen3-235B-A22B",
    ),
    HFShape(
        repo="mistralai/Mistral-Large-Instruct-2411",
        n_layers=88,
        hidden_size=12288,
        n_heads=96,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=32768,
        mlp_size=28672,  # intermediate_size
        max_context=131072,
        model_card="123B dense, 128k context; "
        "https://huggingface.co/mistralai/Mistral-Large-Instruct-2411",
    ),
    HFShape(
        repo="mistralai/Mixtral-8x22B-Instruct-v0.1",
        n_layers=56,
        hidden_size=6144,
        n_heads=48,
        n_kv_heads=8,
        head_dim=128,  # hidden_size / num_attention_heads
        vocab_size=32768,
        mlp_size=16384,  # intermediate_size, per expert
        max_context=65536,
        n_experts=8,
        top_k=2,
        model_card="141B total, 39B active (Mistral AI, 'Cheaper, Better, Faster, Stronger', "
        "2024); https://huggingface.co/mistralai/Mixtral-8x22B-Instruct-v0.1",
    ),
)
"""The published shapes of the paper's three models, from their config.json files."""

PAPER_MODELS: Final = tuple(model_spec(s) for s in PAPER_SHAPES)
"""Qwen3-235B-A22B (MoE), Mistral-Large-Instruct-2411 (dense), Mixtral-8x22B (MoE), bf16."""


def paper_cluster(n_instances: int = 1, servers: int = 1) -> ClusterConfig:
    """The paper's testbed: the three models on ``servers`` 8 x H200 servers, each split
    into ``n_instances / servers`` equal tensor-parallel instances.

    ``n_instances=1`` is one TP8 instance (the paper's setting); 2 gives two TP4 instances;
    4 on two servers gives four TP4 instances (``h200-tp8-0`` .. ``-3``). Raises ConfigError
    when the instances do not split evenly over the servers, or a model no longer fits any
    instance (Qwen3-235B needs more than TP2).
    """
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ConfigError(f"servers must be a positive integer, got {servers!r}")
    if n_instances % servers:
        raise ConfigError(f"{n_instances} instances do not split evenly over {servers} servers")
    per_server = profile("h200-tp8").instances(n_instances // servers)
    instances = [
        attrs.evolve(inst, name=f"h200-tp8-{k * len(per_server) + i}")
        for k in range(servers)
        for i, inst in enumerate(per_server)
    ]
    # ClusterConfig's fields use ``converter=tuple``, whose __init__ type the attrs mypy plugin
    # cannot resolve (Iterable[_T_co]); Any keeps this call valid before and after a fix.
    return ClusterConfig(models=cast(Any, PAPER_MODELS), instances=cast(Any, instances))
