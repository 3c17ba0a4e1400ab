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
