"""The forward pass's tensor ops (talaria.engine.ops) against transformers' formulas."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_rms_norm_bit_for_bit(dtype: torch.dtype) -> None:
    """transformers: weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)."""
    from talaria.engine.ops import rms_norm

    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(37, 96, generator=gen) * 5).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-5), expected)


@pytest.mark.parametrize("rows", [1, 2, 31, 32, 100, 256, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_x_times_w_transposed_plus_bias_at_every_row_count(
    rows: int, dtype: torch.dtype, bias: bool
) -> None:
    """Either form (F.linear, or the transposed product at TRANSPOSED_ROWS in bf16) computes
    x @ w.T + b: equal to a float64 reference within the dtype's rounding, the right shape,
    and contiguous when asked."""
    from talaria.engine.ops import TRANSPOSED_ROWS, linear

    lo, hi = TRANSPOSED_ROWS
    assert (lo, hi) == (32, 256)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    w = torch.randn(48, 64, generator=gen).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype) if bias else None
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    y = linear(x, w, b, contiguous=True)
    assert y.shape == (rows, 48) and y.dtype == dtype and y.is_contiguous()
    tol = 1e-4 if dtype is torch.float32 else 0.1
    assert torch.allclose(y.double(), ref, atol=tol, rtol=1e-2)
    transposed = dtype is torch.bfloat16 and lo <= rows <= hi
    assert linear(x, w, b).is_contiguous() is not transposed
