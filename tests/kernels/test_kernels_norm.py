"""Row-wise RMSNorm kernel (kernels.norm): torch reference, bitwise batch invariance, bad input."""

from __future__ import annotations

import pytest
import torch

from kernels import kernel_available
from kernels.norm import rms_norm_reference, rms_norm_rows

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")


@needs_kernel
@pytest.mark.parametrize("h", [8, 64, 203, 1024])
def test_rms_norm_matches_reference_and_the_model_norm(h: int) -> None:
    from engine.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(h)
    x = torch.randn(7, h, generator=gen) * 3
    norm = RMSNorm(h, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=gen)
    ref = rms_norm_reference(x, norm.weight, 1e-6)
    assert torch.equal(ref, norm(x).detach())  # autograd on (weight requires grad): the torch expression
    out = rms_norm_rows(x, norm.weight, 1e-6)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    with torch.no_grad():  # inference in fp32 on CPU: the model's norm is the kernel, any leading shape
        assert torch.equal(norm(x), out)
        assert torch.equal(norm(x.view(7, 1, h)), out.view(7, 1, h))


@needs_kernel
def test_rms_norm_row_is_bitwise_batch_invariant() -> None:
    """A row's bits alone equal its bits in any batch of M = 1..16 rows, under any permutation."""
    h = 200
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, h, generator=gen), torch.randn(h, generator=gen)
    alone = torch.cat([rms_norm_rows(x[i : i + 1], w, 1e-5) for i in range(16)])
    for m in range(1, 17):
        rows = torch.randperm(16, generator=gen)[:m]
        assert torch.equal(rms_norm_rows(x[rows], w, 1e-5), alone[rows]), m


def test_rms_norm_rejects_bad_shapes() -> None:
    if not kernel_available():
        pytest.skip("C++ kernel could not be built here")
    with pytest.raises(ValueError, match=r"\[M, H\]"):
        rms_norm_rows(torch.randn(2, 8), torch.ones(7), 1e-6)
