"""Rotary embedding kernel (kernels.rope): the torch reference's bits for strided, partial and batched
inputs; the reference itself for autograd and other dtypes."""

from __future__ import annotations

import pytest
import torch

from kernels import kernel_available
from kernels.rope import apply_rotary, rotary_reference

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")


def _inputs(t: int, heads: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    angle = torch.rand(t, d // 2, generator=gen) * 50
    angle = torch.cat((angle, angle), dim=-1)  # [T, D], rotate-half layout
    return torch.randn(t, heads, d, generator=gen) * 4, angle.cos(), angle.sin()


@needs_kernel
@pytest.mark.parametrize(("t", "heads", "d"), [(1, 1, 2), (3, 4, 64), (17, 16, 128), (256, 16, 128)])
def test_rope_kernel_equals_reference_bitwise(t: int, heads: int, d: int) -> None:
    x, cos, sin = _inputs(t, heads, d)
    assert torch.equal(apply_rotary(x, cos, sin), rotary_reference(x, cos, sin))


@needs_kernel
def test_rope_kernel_on_strided_views() -> None:
    """q / k as views of a fused projection, and the rotary part of partial rotary (x[..., :r])."""
    x, cos, sin = _inputs(9, 6, 96, seed=1)
    qkv = torch.randn(9, 10, 96)
    q = qkv[:, 2:8]  # [T, 6, D] with a token stride of 10 * D
    assert torch.equal(apply_rotary(q, cos, sin), rotary_reference(q, cos, sin))
    part = x[..., :32]  # partial rotary: D = 32 of 96
    assert torch.equal(apply_rotary(part, cos[:, :32], sin[:, :32]), rotary_reference(part, cos[:, :32], sin[:, :32]))


@needs_kernel
def test_rope_row_is_batch_invariant() -> None:
    x, cos, sin = _inputs(40, 4, 64, seed=2)
    full = apply_rotary(x, cos, sin)
    for t in range(40):
        assert torch.equal(apply_rotary(x[t : t + 1], cos[t : t + 1], sin[t : t + 1]), full[t : t + 1])


def test_rope_autograd_and_bf16_take_the_reference() -> None:
    x, cos, sin = _inputs(5, 2, 16, seed=3)
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.randn(5, 2, 16)
    (apply_rotary(xg, cos, sin) * weights).sum().backward()
    (rotary_reference(xr, cos, sin) * weights).sum().backward()
    assert xg.grad is not None and torch.equal(xg.grad, xr.grad)
    xb = x.bfloat16()
    out = apply_rotary(xb, cos.bfloat16(), sin.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, rotary_reference(xb, cos.bfloat16(), sin.bfloat16()))
