"""The tensor ops of the Llama-family forward pass: RMSNorm, linear and rotary embedding.

Stateless functions on plain tensors, with Hugging Face transformers' numerics (RMSNorm in
float32, rotary embeddings in the "rotate_half" layout) and CPU-friendly forms where they are
faster at decode sizes. :class:`~talaria.engine.model.LlamaModel` composes them with the paged
attention of :mod:`talaria.engine.attention`.
"""

from __future__ import annotations

from typing import Final

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as transformers computes it (in float32, the normalised value
    rounded to ``x``'s dtype, then times ``weight``). PyTorch's fused ``rms_norm`` accumulates
    in float32 for bf16 input and gives bit-identical results (checked) in one op where the
    spelled-out form is seven; decode runs it twice a layer."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


TRANSPOSED_ROWS: Final = (32, 256)
"""Row counts (inclusive) at which :func:`linear` computes a bf16 product on CPU as
``(w @ x.T).T`` (see there)."""


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, contiguous: bool = False
) -> torch.Tensor:
    """``x @ w.T + b`` for ``x`` ``[M, in]``, ``w`` ``[out, in]``: ``[M, out]``.

    For bf16 on CPU with ``TRANSPOSED_ROWS`` rows (32 to 256) it is computed as
    ``(w @ x.T).T``: PyTorch's CPU GEMM is a little faster there with the weight as the left
    operand. Below 32 rows ``F.linear`` (oneDNN) is faster, most on the larger models.
    Measured 2026-12-03 on this repository's 2-core AVX512-BF16 machine, 2 threads, on a
    worker thread as the engine runs (``python benchmarks/cpu_linear.py``, rows in
    ``benchmarks/results/cpu_linear.json``): one layer's projections at 4 rows take 2.01x as
    long transposed on Llama-3.2-1B, 1.17x on Qwen2.5-0.5B and 1.18x on SmolLM2-135M, and at
    8 rows 1.62x, 1.06x and 1.09x; at 48 rows 0.78x, 0.85x and 0.75x. (Until then every product
    of up to 256 rows was transposed, from SmolLM2-135M on one thread.) Above the range, and
    for other dtypes (not measured), ``F.linear``. The
    transposed result is a view unless ``contiguous`` (callers that feed SDPA or hand rows
    out ask for it); elementwise ops and views accept either. Same products and sums as
    ``F.linear``; only the accumulation order inside the GEMM may differ.
    """
    lo, hi = TRANSPOSED_ROWS
    m = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype != torch.bfloat16 or not lo <= m <= hi:
        return F.linear(x, w, b)
    y = (torch.mm(w, x.t()) if b is None else torch.addmm(b.unsqueeze(1), w, x.t())).t()
    return y.contiguous() if contiguous else y


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos`` / ``signed_sin`` ``[T, 1, head_dim]``.

    transformers computes ``x * cos + cat(-x2, x1) * sin`` (``x1``, ``x2`` the halves of
    ``x``); here the sign sits in ``signed_sin`` (``sin`` with its first half negated, made
    once a step) and ``cat(x2, x1)`` is one ``roll``: the same products and sums, three ops
    fewer per call.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin
