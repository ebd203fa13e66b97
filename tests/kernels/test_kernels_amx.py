"""AMX int8 tiles (kernels/csrc/amx_int8.h) for the a8 formats: tdpbssd computes the same exact integer group sums
as zmm vpdpbusd and the epilogue is the same float sequence, so under path_limit("amx") the routed experts and the
dense projections give the bits of path_limit("zmm") for every row count (16-row blocks and their tails), K tail,
N tail, group size and thread count; and stay close to the torch reference. moegate_amx_min_rows(1) sends every
expert and batch through the tiles (the default threshold would leave small ones on zmm)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_cases import exact_threads, random_experts, random_routing

from kernels import fused_moe, fused_moe_reference, kernel_available, pack_experts
from kernels.cpu_features import detect, vnni_capable
from kernels.formats import FORMAT_CODE
from kernels.fused_moe import kernel_library, path_limit
from kernels.linear import PackedLinear


def _amx_int8() -> bool:
    lib = kernel_library("avx512") if vnni_capable(detect()) and kernel_available("avx512") else None
    return lib is not None and lib.moegate_has_amx() & 1 == 1


pytestmark = pytest.mark.skipif(not _amx_int8(), reason="needs the avx512 kernel on a CPU with AMX-INT8 (and the "
                                                        "OS's tile-data permission): moegate_has_amx() & 1 is 0")
ROWS = [*range(1, 41), 128, 130]


@contextlib.contextmanager
def amx_from(rows: int):
    """AMX tiles from `rows` rows of an expert or dense batch, every a8 format (moegate_amx_min_rows)."""
    lib = kernel_library("avx512")
    codes = [FORMAT_CODE[f] for f in ("int4", "int4_asym", "int8_a8")]
    old = [lib.moegate_amx_min_rows(c, rows) for c in codes]
    try:
        yield
    finally:
        for c, r in zip(codes, old, strict=True):
            lib.moegate_amx_min_rows(c, r)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 1e-4 * ref.abs().max().item() + 1e-5
    err = (out - ref).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"


def _both_paths(fn):
    """fn() under path_limit("amx") (every batch on tiles) and path_limit("zmm")."""
    with amx_from(1), path_limit("amx"):
        amx = fn()
    with path_limit("zmm"):
        zmm = fn()
    return amx, zmm


@pytest.mark.parametrize("fmt,gs", [("int8_a8", 32), ("int8_a8", 64), ("int8_a8", 136), ("int4", 32), ("int4", 128),
                                    ("int4", 72)])
@pytest.mark.parametrize("h,i", [(200, 72), (135, 37)])
def test_int8_tiles_experts_equal_zmm(fmt: str, gs: int, h: int, i: int) -> None:
    """Every row count 1..40, 128, 130 (all rows on a few experts: 16-row blocks and every tail), rows in a random
    order, odd H / I (K and N tails; an odd count of down tiles: the single-tile unit), 1 and 2 threads."""
    e = 4
    packed = pack_experts(*random_experts(e, h, i, seed=3), fmt, gs, progress=False)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(130, h, generator=gen)
    ids, w = random_routing(130, 2, e, seed=6)
    with exact_threads("avx512"):
        for m in ROWS:
            rows = torch.randperm(130, generator=gen)[:m]
            for threads in (1, 2):
                amx, zmm = _both_paths(lambda r=rows, n=threads: fused_moe(x[r], ids[r], w[r], packed,
                                                                          variant="avx512", num_threads=n))
                assert torch.equal(amx, zmm), (fmt, gs, m, threads)
            assert_close(amx, fused_moe_reference(x[rows], ids[rows], w[rows], packed))


def test_int8_tiles_rows_batch_invariant() -> None:
    """With int8_a8's default threshold (32 rows) a row's experts switch from zmm to tiles as the batch grows: its
    bits do not change (each row alone vs inside 64- and 128-row batches, 32 and 64 rows per expert)."""
    packed = pack_experts(*random_experts(8, 256, 96, seed=1), "int8_a8", progress=False)
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    ids, w = random_routing(128, 4, 8, seed=2)
    with path_limit("amx"):
        alone = torch.cat([fused_moe(x[r:r + 1], ids[r:r + 1], w[r:r + 1], packed, variant="avx512", num_threads=1)
                           for r in range(128)])
        for m in (64, 128):
            assert torch.equal(fused_moe(x[:m], ids[:m], w[:m], packed, variant="avx512"), alone[:m]), m


@pytest.mark.parametrize("fmt,gs", [("int8_a8", 32), ("int8_a8", 64), ("int4", 32), ("int4_asym", 32),
                                    ("int4_asym", 128)])
@pytest.mark.parametrize("n,k", [(13, 200), (300, 96), (1000, 72)])
def test_int8_tiles_linear_equal_zmm(fmt: str, gs: int, n: int, k: int) -> None:
    """Dense projections (one down-style unit per item): amx == zmm bitwise for every batch size, 1 and 2 threads."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, 0] = 0.5
    packed = PackedLinear.pack(w, fmt, gs)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(1))
    with exact_threads("avx512"):
        for m in ROWS:
            for threads in (1, 2):
                amx, zmm = _both_paths(lambda m=m, t=threads: packed(x[:m], num_threads=t, variant="avx512"))
                assert torch.equal(amx, zmm), (fmt, gs, n, k, m, threads)
            assert_close(amx, packed.reference(x[:m]))
