"""Row-wise RMSNorm kernel (kernels.norm): torch reference, bitwise batch invariance, bad input; the residual add
fused with the norm and the per-head norm over strided rows, bitwise against the separate operations."""

from __future__ import annotations

import pytest
import torch

from kernels import kernel_available
from kernels.norm import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm_heads,
    rms_norm_reference,
    rms_norm_rows,
)

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


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 5, 130])
def test_add_rms_norm_equals_torch_add_then_the_row_norm(m: int, threads: int) -> None:
    """The sum is torch's x + y to the bit, the norm rms_norm_rows's; without a weight, the add alone."""
    gen = torch.Generator().manual_seed(m)
    x, y, w = torch.randn(m, 1030, generator=gen), torch.randn(m, 1030, generator=gen) * 5, torch.randn(1030)
    s, out = add_rms_norm(x, y, w, 1e-6, num_threads=threads)
    assert torch.equal(s, x + y)
    assert torch.equal(out, rms_norm_rows(x + y, w, 1e-6))
    ref_s, ref_out = add_rms_norm_reference(x, y, w, 1e-6)
    assert torch.equal(ref_s, s)
    assert (out - ref_out).abs().max().item() <= 1e-5 * ref_out.abs().max().item()
    s2, none = add_rms_norm(x, y, None, num_threads=threads)
    assert none is None and torch.equal(s2, x + y)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_heads_reads_strided_views_as_the_row_norm_of_their_copy(threads: int) -> None:
    """q and k as views of one fused projection [T, NQ + 2 NKV]: each head row's bits equal rms_norm_rows of the
    contiguous copy, and so does the model's per-head norm (engine.models.layers.RMSNorm) on the view."""
    from engine.models.layers import RMSNorm

    t, nh, nkv, d = 70, 6, 2, 72
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=gen)
    q = qkv[:, : nh * d].view(t, nh, d)
    k = qkv[:, nh * d : (nh + nkv) * d].view(t, nkv, d)
    norm = RMSNorm(d, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=gen)
        for v, heads in ((q, nh), (k, nkv)):
            want = rms_norm_rows(v.reshape(-1, d), norm.weight, 1e-6).view(t, heads, d)
            assert torch.equal(rms_norm_heads(v, norm.weight, 1e-6, num_threads=threads), want)
            assert torch.equal(norm(v), want)
        full = RMSNorm(nh * d, 1e-6)  # a whole-projection norm on the 2-D q view
        assert torch.equal(full(qkv[:, : nh * d]), rms_norm_rows(qkv[:, : nh * d].contiguous(), full.weight, 1e-6))
