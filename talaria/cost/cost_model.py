"""Roofline cost model: seconds for engine iterations and copies on one instance.

An instance is a tensor-parallel group of ``n_devices`` devices of one
:class:`~talaria.cost.hardware.HardwareProfile`. Everything here is pure and deterministic:
the same arguments give the same seconds, and nothing is tuned here (efficiency factors
come from the profile).

Units: tokens (counts), bytes, FLOPs, seconds (floats).

Model of one engine iteration (continuous batching: a chunk of prefill tokens plus one decode
token for each running sequence)::

    step = max(compute, memory) + tp_communication + step_overhead

- compute = (matrix FLOPs of every token + attention FLOPs) / (n * peak_flops_bf16 * mfu)
- memory  = (weight bytes touched + KV bytes read and written) / (n * hbm_Bps * hbm_efficiency)
- tp_communication (n > 1 only) = 2 allreduces per layer, each a ring allreduce of
  ``hidden_size * tokens * 2`` bytes (bf16 activations): ``2 (n-1)/n * bytes`` sent per
  device over ``interconnect_Bps * interconnect_efficiency``, plus ``allreduce_latency_s``.
  Inference engines run these allreduces between the matmuls, so they add to the roofline
  time rather than overlap with it.

Approximations, stated so they can be checked:

- MoE weights touched: the parameters that are not experts are estimated from the model's
  shape (attention projections ``2 h (H + K) d`` per layer plus untied input and output
  embeddings ``2 V h``); everything else counts as experts. One token uses the fraction
  ``p = (active - shared) / (total - shared)`` of the expert parameters (``p = top_k / E``),
  and a batch of ``T`` tokens touches, with uniform independent routing, the expected
  fraction ``1 - (1 - p)^T``. One token touches exactly ``active_params``; many tokens
  approach ``total_params`` and never exceed it. Dense models (active == total) always
  read all weights.
- Prefill KV traffic: the chunk's new KV is written once, and attention reads the KV of the
  chunk's average context (``prefill_attn_tokens / prefill_tokens``) once, as a fused
  attention kernel does for one sequence. Prefill is compute-bound at these sizes, so the
  memory term rarely decides.
- KV heads are replicated when the TP degree exceeds the KV head count (as vLLM does), so KV
  traffic and storage per token are multiplied by ``max(1, n / n_kv_heads)``.
"""

from __future__ import annotations

import math
from typing import Final

import attrs

from talaria.config import ModelSpec
from talaria.cost.hardware import HardwareProfile
from talaria.cost.step_shape import StepShape, check_count
from talaria.errors import BadRequest, ConfigError
from talaria.types import Link

ACTIVATION_BYTES: Final = 2
"""Bytes per activation element exchanged by tensor-parallel allreduces (bf16)."""

ALLREDUCES_PER_LAYER: Final = 2
"""Megatron-style TP: one allreduce after attention, one after the MLP."""


def shared_params_estimate(model: ModelSpec) -> int:
    """Parameters that every token uses: attention projections and untied embeddings.

    ``n_layers * 2 * h * d * (H + K)`` (Q and O are ``h x H d``, K and V are ``h x K d``)
    plus ``2 * V * h`` (input embedding and LM head), capped at ``active_params``.
    """
    h, d = model.hidden_size, model.head_dim
    attention = model.n_layers * 2 * h * d * (model.n_heads + model.n_kv_heads)
    embeddings = 2 * model.vocab_size * h
    return min(attention + embeddings, model.active_params)


@attrs.frozen
class CostModel:
    """Seconds for one instance: ``n_devices`` devices of ``hw`` in one tensor-parallel group."""

    hw: HardwareProfile
    n_devices: int

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.hw, HardwareProfile):
            raise ConfigError(f"hw must be a HardwareProfile, got {type(self.hw).__name__}")
        n = self.n_devices
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.hw.n_devices:
            raise ConfigError(
                f"n_devices must be an integer in 1..{self.hw.n_devices} "
                f"(devices of profile {self.hw.name}), got {n!r}"
            )

    # -- rates -----------------------------------------------------------------------------

    @property
    def flops_per_s(self) -> float:
        """Achieved matmul FLOP/s of the whole group."""
        return self.n_devices * self.hw.peak_flops_bf16 * self.hw.mfu

    @property
    def hbm_Bps(self) -> float:
        """Achieved device-memory read bandwidth of the whole group, bytes/s."""
        return self.n_devices * self.hw.hbm_bandwidth_Bps * self.hw.hbm_efficiency

    @property
    def attention_flops_per_s(self) -> float:
        """Achieved attention FLOP/s of the group (the matmul rate unless the profile says)."""
        rate = self.hw.attention_flops_per_s
        return self.flops_per_s if rate is None else self.n_devices * rate

    @property
    def kv_read_Bps(self) -> float:
        """Achieved rate of K/V reads and writes of the group (the HBM rate unless the
        profile says)."""
        rate = self.hw.kv_read_Bps
        return self.hbm_Bps if rate is None else self.n_devices * rate

    def kv_replication(self, model: ModelSpec) -> float:
        """KV copies kept per token: ``n / n_kv_heads`` when TP exceeds the KV heads, else 1."""
        return max(1.0, self.n_devices / model.n_kv_heads)

    def kv_bytes_per_token(self, model: ModelSpec) -> float:
        """Device bytes of K and V per token on this instance, replication included."""
        return model.kv_bytes_per_token * self.kv_replication(model)

    # -- parts of a step -------------------------------------------------------------------

    def weight_bytes_touched(self, model: ModelSpec, tokens: int) -> float:
        """Weight bytes read by a forward pass over ``tokens`` tokens (0 tokens: 0 bytes).

        Dense models read all weights; MoE models read the shared parameters plus the
        expected share of experts routed to (see the module docstring), capped at all weights.
        """
        t = check_count("tokens", tokens)
        if t == 0:
            return 0.0
        if model.active_params >= model.total_params:
            return float(model.weight_bytes)
        shared = shared_params_estimate(model)
        experts = model.total_params - shared
        p = (model.active_params - shared) / experts
        touched = shared + experts * (1.0 - math.pow(1.0 - p, t))
        return min(touched, float(model.total_params)) * model.dtype_bytes

    def compute_s(
        self, model: ModelSpec, tokens: int, prefill_attn_tokens: float, decode_context: int
    ) -> float:
        """Matmul time of ``tokens`` tokens plus attention over the given context sums."""
        attention = model.attention_flops(prefill_attn_tokens) + model.attention_flops(
            decode_context
        )
        return (
            tokens * model.flops_per_token / self.flops_per_s
            + attention / self.attention_flops_per_s
        )

    def tp_comm_s(self, model: ModelSpec, tokens: int) -> float:
        """Allreduce time of one step over ``tokens`` tokens; 0 with one device or no tokens."""
        n = self.n_devices
        if n == 1 or tokens == 0:
            return 0.0
        message = model.hidden_size * tokens * ACTIVATION_BYTES
        bandwidth = self.hw.interconnect_Bps * self.hw.interconnect_efficiency
        one = 2.0 * (n - 1) / n * message / bandwidth + self.hw.allreduce_latency_s
        return ALLREDUCES_PER_LAYER * model.n_layers * one

    # -- public costs ----------------------------------------------------------------------

    def step_s(self, model: ModelSpec, step: StepShape) -> float:
        """Seconds for one engine iteration of ``step``; 0.0 when it has no tokens at all. A
        profile with measured :class:`~talaria.cost.step_prices.StepPrices` prices it with
        them (the additive model), else with the roofline of the module docstring (which
        reads neither the chunk count nor the prefix)."""
        tokens = step.tokens
        if tokens == 0:
            return 0.0
        prices = self.hw.step_prices
        if prices is not None:  # measured parts that do not overlap (one device: no TP)
            return prices.step_s(model, step)
        prefill, attn = int(step.prefill_tokens), float(step.prefill_attn_tokens)
        context = int(step.decode_context_tokens)
        compute = self.compute_s(model, tokens, attn, context)
        # KV tokens written (the new ones) and read (the decode contexts, and the prefill's
        # mean attended context once)
        kv_tokens: float = tokens + context
        if prefill:
            kv_tokens += attn / prefill
        memory = self.weight_bytes_touched(model, tokens) / self.hbm_Bps
        memory += kv_tokens * self.kv_bytes_per_token(model) / self.kv_read_Bps
        per_seq = int(step.decode_seqs) * (self.hw.decode_seq_overhead_s or 0.0)
        return (
            max(compute, memory) + self.tp_comm_s(model, tokens) + self.hw.step_overhead_s + per_seq
        )

    def prefill_s(self, model: ModelSpec, new_tokens: int, cached_tokens: int = 0) -> float:
        """One step prefilling ``new_tokens`` after ``cached_tokens`` already in KV (one chunk)."""
        return self.step_s(model, StepShape.prefill(new_tokens, cached_tokens))

    def decode_step_s(self, model: ModelSpec, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` sequences whose contexts sum to ``context_tokens``."""
        return self.step_s(model, StepShape.decode(batch, context_tokens))

    def recompute_s(self, model: ModelSpec, tokens: int) -> float:
        """Rebuilding the KV of a ``tokens``-long prefix from scratch (a prefill, no cache)."""
        return self.prefill_s(model, tokens, 0)

    def copy_s(self, nbytes: int, link: Link) -> float:
        """Seconds to move ``nbytes`` over ``link`` on this instance; 0.0 for 0 bytes.

        DISK_TO_HOST: the server's disk at ``disk_Bps * disk_efficiency``.
        HOST_TO_DEVICE / DEVICE_TO_HOST: every TP rank copies its shard over its own host link,
        ``n * host_link_Bps * host_link_efficiency``.
        DEVICE_TO_DEVICE: an on-device copy reads and writes HBM, so half the bandwidth,
        ``n * hbm_bandwidth_Bps / 2 * d2d_efficiency``.
        Each copy adds ``copy_latency_s``. Contention between instances sharing the server's
        disk or host memory is the caller's to model.
        """
        size = check_count("nbytes", nbytes)
        if size == 0:
            return 0.0
        hw, n = self.hw, self.n_devices
        if link is Link.DISK_TO_HOST:
            rate = hw.disk_Bps * hw.disk_efficiency
        elif link in (Link.HOST_TO_DEVICE, Link.DEVICE_TO_HOST):
            rate = n * hw.host_link_Bps * hw.host_link_efficiency
        elif link is Link.DEVICE_TO_DEVICE:
            rate = n * hw.hbm_bandwidth_Bps / 2 * hw.d2d_efficiency
        else:
            raise BadRequest(f"unknown link {link!r}")
        return size / rate + hw.copy_latency_s
