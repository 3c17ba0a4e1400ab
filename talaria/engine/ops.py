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


_FEW_ROWS: Final = 256
"""Up to this many rows :func:`linear` computes ``w @ x.T`` on CPU (see there)."""


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, contiguous: bool = False
) -> torch.Tensor:
    """``x @ w.T + b`` for ``x`` ``[M, in]``, ``w`` ``[out, in]``: ``[M, out]``.

    On CPU with at most :data:`_FEW_ROWS` rows it is computed as ``(w @ x.T).T``, and one row
    as ``mv``: PyTorch's CPU GEMM is faster with the weight as the left operand at decode
    sizes. Measured here (SmolLM2-135M's matmuls, bf16, one thread): M=1 36 -> 25 ms (mv),
    M=8 38 -> 25 ms, M=32 45 -> 31 ms; about equal at M=1024. The result is then a transposed
    view unless ``contiguous`` (callers that feed SDPA or hand rows out ask for it);
    elementwise ops and views accept either. Same products and sums as ``F.linear``; only the
    accumulation order inside the GEMM may differ.
    """
    m = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or m > _FEW_ROWS:
        return F.linear(x, w, b)
    if m == 1:
        y = torch.mv(w, x[0]) if b is None else torch.addmv(b, w, x[0])
        return y.unsqueeze(0)
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
