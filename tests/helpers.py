"""Small builders shared by the tests: an estimator with round numbers and tiny model specs."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypothesis import settings

from talaria.config import InstanceSpec, ModelSpec
from talaria.cost.step_shape import StepShape
from talaria.types import DEFAULT_TENANT, Link, SessionKey

if TYPE_CHECKING:
    from talaria.backends.embedded import EmbeddedCluster

MB = 10**6


def examples(n: int) -> int:
    """A property test's example count ``n`` under the loaded hypothesis profile: ``n`` in
    the deterministic ``ci`` profile, ten times ``n`` in ``search`` (tests/conftest.py)."""
    return max(1, n * settings.default.max_examples // 100)


class RoundNumberEstimator:
    """Costs a test can compute by hand: prefill 1000 tok/s, restore 10000 tok/s, a decode
    step 0.01 s, copies at 1e9 B/s (an ``Estimator``)."""

    def step_s(self, model: str, step: StepShape) -> float:
        return step.prefill_tokens / 1000 + (0.01 if step.decode_seqs else 0.0)

    def copy_s(self, nbytes: int, link: Link) -> float:
        return nbytes / 1e9

    def prefill_tok_s(self, model: str) -> float:
        return 1000.0

    def restore_tok_s(self, model: str) -> float:
        return 10_000.0

    def decode_step_s(self, model: str, batch: int, context_tokens: int) -> float:
        return 0.01

    def stage_contention(self) -> None:
        return None

    def co_run_slowdown(self) -> None:
        return None

    def provision_s(self) -> float:
        return 0.0


def tiny_spec(name: str, weight_bytes: int = 1000, max_context: int = 131072) -> ModelSpec:
    """``weight_bytes`` of weights (one byte per parameter) and 32 bytes of KV per token."""
    return ModelSpec(
        name=name,
        n_layers=1,
        hidden_size=8,
        n_heads=1,
        n_kv_heads=1,
        head_dim=8,
        vocab_size=16,
        total_params=weight_bytes,
        active_params=weight_bytes,
        dtype_bytes=1,
        max_context=max_context,
    )


def randomize_hf(model: Any, seed: int) -> None:
    """Overwrite a transformers model's parameters with seeded values of realistic scale
    (norms near 1, biases small, matrices scaled by fan-in), so logits are well spread."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


def llama_config(**overrides: Any) -> Any:
    """A tiny random-weight-ready transformers LlamaConfig (overrides win)."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def qwen2_config(**overrides: Any) -> Any:
    """A tiny transformers Qwen2Config (attention bias on q/k/v; overrides win)."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return transformers.Qwen2Config(**kw)


def hf_model(config: Any, seed: int) -> Any:
    """A transformers model of ``config`` with every parameter seeded by ``randomize_hf``."""
    import torch
    import transformers

    cls = (
        transformers.Qwen2ForCausalLM
        if config.model_type == "qwen2"
        else transformers.LlamaForCausalLM
    )
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize_hf(model, seed)
    return model


def tiny_cluster(
    device_bytes: int = 2 * MB,
    instances: int = 1,
    policy: str = "talaria",
    keep_alive_s: float = math.inf,
    **knobs: Any,
) -> EmbeddedCluster:
    """Two tiny random-weight models (Llama, Qwen2) on ``instances`` CPU instances whose
    device budget holds one model's weights and a small KV pool (``knobs``: more of the
    policy's fields)."""
    import attrs
    import torch

    from talaria.backends.embedded import cluster_from_loaded
    from talaria.engine.loader import load_dummy
    from talaria.policy.baselines import POLICIES

    loaded = {
        "llama-tiny": load_dummy(llama_config().to_dict(), seed=1, dtype=torch.float32),
        "qwen-tiny": load_dummy(qwen2_config().to_dict(), seed=2, dtype=torch.float32),
    }
    specs = [
        InstanceSpec(
            name=f"cpu-{i}",
            hardware="cpu",
            device_memory_bytes=device_bytes,
            host_memory_bytes=4 * MB,
            block_size=16,
            memory_utilization=1.0,
        )
        for i in range(instances)
    ]
    pol = attrs.evolve(
        POLICIES[policy], slot_max_s=0.5, slot_linger_s=0.05, keep_alive_s=keep_alive_s, **knobs
    )
    return cluster_from_loaded(specs, loaded, pol, torch.float32)


REPO_ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(
    script: str, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<script>`` with this Python from the repository root, capturing its
    output as text (the exit status is the caller's to check)."""
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=timeout,
        check=False,
    )


def sk(session_id: str, tenant: str = DEFAULT_TENANT) -> SessionKey:
    """A session's key (tenant and id), the default tenant's unless told."""
    return SessionKey(tenant, session_id)
