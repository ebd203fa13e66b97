"""Packed weights are copied into 2 MiB-aligned anonymous memory advised for transparent huge pages."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from kernels import pack_experts
from kernels.hugepages import HUGE_PAGE, hugepage_copy
from kernels.linear import PackedLinear

needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")


@needs_madvise
def test_copy_is_equal_aligned_and_outlives_the_source() -> None:
    src = torch.randn(3, HUGE_PAGE // 4 + 5)  # > 2 MiB, odd size
    out = hugepage_copy(src)
    assert out.data_ptr() % HUGE_PAGE == 0 and out.dtype == src.dtype and out.shape == src.shape
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert hugepage_copy(out) is out  # already in such a mapping: re-wrapping packed weights copies nothing
    expected = src.clone()
    del src
    gc.collect()
    assert torch.equal(out, expected)  # the mapping lives as long as the tensor


def test_small_tensors_and_opt_out_are_unchanged(monkeypatch) -> None:
    small = torch.randn(1000)
    assert hugepage_copy(small) is small
    monkeypatch.setenv("MOEGATE_HUGEPAGES", "0")
    big = torch.randn(HUGE_PAGE)
    assert hugepage_copy(big) is big


@needs_madvise
def test_packed_weights_live_in_huge_page_memory() -> None:
    packed = pack_experts(torch.randn(16, 1024, 512) * 0.02, torch.randn(16, 512, 512) * 0.02, "int8", progress=False)
    assert packed.tensors["gate_up"].data_ptr() % HUGE_PAGE == 0
    lin = PackedLinear.pack(torch.randn(4096, 1024), "int8")
    assert lin.tensors["weight"].data_ptr() % HUGE_PAGE == 0
    x = torch.randn(2, 1024)
    torch.testing.assert_close(lin(x), lin.reference(x), rtol=1e-5, atol=1e-4)
