"""Quantized dense projections (kernels.linear.PackedLinear): kernel vs torch reference per format,
odd shapes and batch sizes 1..64, every compiled variant, per-row batch invariance, and the lossless
format the execution path packs the model's own dense weights in."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import exact_threads

from kernels import kernel_available
from kernels.cpu_features import detect, vnni_capable
from kernels.linear import PackedLinear, exact_format

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")
FORMATS = [("fp32", None), ("bf16", None), ("int8", 64), ("int8", 32), ("int4", 32), ("int4", 64), ("int4_asym", 32),
           ("int8_a8", 32), ("int8_a8", 64)]
SHAPES = [(8, 64), (13, 200), (300, 96), (1000, 72)]  # (N, K): odd N, K not a multiple of the group
VARIANTS = ["generic", "avx2", *(["avx512"] if vnni_capable(detect()) else [])]


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, 0] = 0.5  # an outlier: exercises the group scales
    return w


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == torch.float32
    tol = 1e-4 * ref.abs().max().item() + 1e-5
    assert (out - ref).abs().max().item() <= tol


@needs_kernel
@pytest.mark.parametrize("fmt,gs", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_matches_reference(fmt: str, gs: int | None, n: int, k: int) -> None:
    packed = PackedLinear.pack(_weight(n, k), fmt, gs)
    for m in (1, 2, 3, 4, 5, 8, 17, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        ref = packed.reference(x)
        out = packed(x)
        assert_close(out, ref)
        if fmt.startswith("int4") or fmt == "int8_a8":  # W4A8 / W8A8 step by step: equal but for rare double roundings
            assert (out != ref).sum().item() <= max(1, ref.numel() // 1000)


@needs_kernel
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "int4_asym"])
def test_linear_reference_is_the_dequantized_weight(fmt: str) -> None:
    """dequantize() is what the kernel multiplies by: close to W (quantization error) and, for the
    fp32-activation formats, the reference is exactly x @ dequantize().T."""
    w = _weight(40, 96)
    packed = PackedLinear.pack(w, fmt)
    deq = packed.dequantize()
    assert deq.shape == w.shape
    step = {"bf16": 2**-8, "int8": 1 / 127, "int4": 1 / 7, "int4_asym": 2 / 15}[fmt]  # asym: range <= 2 max|w|
    assert (deq - w).abs().max() <= step * w.abs().max() * 0.51 + 1e-6
    x = torch.randn(3, 96)
    if not fmt.startswith("int4"):
        assert torch.equal(packed.reference(x), x @ deq.T)
    exact = x @ w.T
    assert (packed.reference(x) - exact).norm() < 0.15 * exact.norm()  # int4: ~5% relative noise


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "int4_asym", "bf16_a16", "int8_a8"])
def test_linear_variants(variant: str, fmt: str) -> None:
    packed = PackedLinear.pack(_weight(77, 200), fmt)
    x = torch.randn(19, 200)
    assert_close(packed(x, variant=variant), packed.reference(x))
    if variant == "avx512" and (fmt != "bf16_a16" or not detect().avx512_bf16):  # vdpbf16ps rounds its own way
        assert torch.equal(packed(x, variant="avx512"), packed(x, variant="avx2"))


@pytest.mark.skipif(not (kernel_available("avx2") and vnni_capable(detect())), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "int4_asym", "int8_a8"])
def test_avx512_fp_units_equal_avx2_for_odd_shapes(fmt: str) -> None:
    """The zmm fp32 FMA units (fp_zmm.h) with an odd K (the even chain takes the last k; int8: an odd group
    count, the last group alone in the few-row units), an odd tile count (a single last unit) and 1..130 rows
    (passes of 1-15 rows; 66 and 130: a last 64-row block of 2 rows) give the avx2 build's bits; so do the
    vpdpbusd units (W4A8, W8A8: a unit's two tiles side by side at every row count, the last single tile alone)."""
    packed = PackedLinear.pack(_weight(69, 301), fmt)
    x = torch.randn(130, 301)
    for m in (1, 2, 3, 8, 9, 16, 17, 19, 31, 64, 66, 79, 130):
        assert torch.equal(packed(x[:m], variant="avx512"), packed(x[:m], variant="avx2"))


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "int4_asym", "bf16_a16", "int8_a8"])
def test_linear_row_is_batch_invariant(variant: str, fmt: str) -> None:
    """A row's output bits do not depend on the other rows of the call (M = 1..16 in any order, and 64),
    or on the thread count, on every compiled path. N = 150: an odd number of 8-row tiles."""
    packed = PackedLinear.pack(_weight(150, 128), fmt)
    x = torch.randn(64, 128)
    alone = torch.cat([packed(x[i : i + 1], num_threads=1, variant=variant) for i in range(64)])
    gen = torch.Generator().manual_seed(3)
    with exact_threads(variant):
        for m in range(1, 17):
            rows = torch.randperm(64, generator=gen)[:m]
            assert torch.equal(packed(x[rows], num_threads=1 + m % 2, variant=variant), alone[rows]), m
        for m, threads in ((64, 2), (33, 1)):
            assert torch.equal(packed(x[:m], num_threads=threads, variant=variant), alone[:m])


@needs_kernel
def test_exact_format_is_lossless() -> None:
    """A bf16 checkpoint's weights (loaded in fp32) pack as bf16 with the same products as fp32, half the
    bytes; weights bf16 cannot hold pack as fp32. Either way dequantize() is W itself."""
    w32 = _weight(40, 96)
    w16 = w32.to(torch.bfloat16).float()
    assert exact_format(w32) == "fp32" and exact_format(w16) == "bf16"
    assert exact_format(w32.to(torch.bfloat16)) == "bf16"
    x = torch.randn(5, 96)
    for w in (w32, w16):
        packed = PackedLinear.pack(w, exact_format(w))
        assert torch.equal(packed.dequantize(), w)
        assert_close(packed(x), x @ w.T)
    as_fp32, as_bf16 = PackedLinear.pack(w16, "fp32"), PackedLinear.pack(w16, "bf16")
    assert torch.equal(as_fp32(x), as_bf16(x)) and as_bf16.nbytes * 2 == as_fp32.nbytes


def test_linear_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="format"):
        PackedLinear.pack(_weight(8, 16), "fp8")
    packed = PackedLinear.pack(_weight(8, 64), "int8")
    if kernel_available():
        with pytest.raises(ValueError, match=r"\[M, 64\]"):
            packed(torch.randn(2, 63))


@needs_kernel
@pytest.mark.parametrize("fmt,gs", [("int8", 64), ("int4", 32), ("bf16", None)])
def test_prepared_call_equals_the_packed_linear(fmt: str, gs: int | None) -> None:
    """kernels.bindings.LinearCall (a decode step's lm_head over kept buffers): PackedLinear's bits for the first
    rows of its input, into its kept output or one given."""
    from kernels.bindings import LinearCall
    from kernels.fused_moe import kernel_library

    packed = PackedLinear.pack(_weight(13, 200), fmt, gs)  # N = 13: padded to 16 columns
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(5))
    out = torch.full((4, packed.padded_out), float("nan"))
    call = LinearCall(kernel_library(), packed, x, out, num_threads=2)
    for rows in (1, 3, 4):
        call(rows)
        assert torch.equal(out[:rows, :13], packed(x[:rows], num_threads=2))
    fresh = torch.empty(2, packed.padded_out)
    call(2, fresh)
    assert torch.equal(fresh[:, :13], packed(x[:2], num_threads=2))
    with pytest.raises(ValueError):
        call(5)
    with pytest.raises(ValueError):
        LinearCall(kernel_library(), packed, x, torch.empty(4, 13), num_threads=2)  # out not padded to 8


def _argmax_rows(m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 64] > 0 and fp32 W [N, 64] whose outputs hold exact ties at the max (zero rows over negative ones),
    -inf (a -inf weight), NaN (a NaN weight) and rows of them only, per row of x at seeded places."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(m, 64, generator=g) + 0.1
    w = -torch.rand(n, 64, generator=g)
    kind = seed % 4
    if kind == 0:  # ties: several all-zero rows are the max, the first wins
        w[torch.randperm(n, generator=g)[:5]] = 0.0
    elif kind == 1:  # -inf everywhere but in a few (tied) places
        w[:, 3] = float("-inf")
        w[torch.randperm(n, generator=g)[:3]] = 0.0
    elif kind == 2:  # NaNs: the first one wins over a larger finite logit and the later NaNs
        w[torch.randperm(n, generator=g)[:4], 7] = float("nan")
        w[torch.randint(n, (1,), generator=g)] = 1.0
    else:  # every logit -inf: index 0
        w[:, 0] = float("-inf")
    return x, w


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt,n", [("fp32", 4099), ("fp32", 13), ("bf16", 2051), ("int8", 1001)])
def test_prepared_call_first_max_is_numpys_argmax(variant: str, fmt: str, n: int) -> None:
    """LinearCall's first_max (each thread's pick over the columns it wrote, chunks combined in column order) is
    np.argmax of the row it wrote, for M = 1..16, one and two threads, ties, -inf, NaN, rows of -inf."""
    import numpy as np

    from kernels.bindings import LinearCall
    from kernels.fused_moe import kernel_library

    lib = kernel_library(variant)
    for seed in range(8):
        x, w = _argmax_rows(16, n, seed)
        packed = PackedLinear.pack(w, fmt, 64 if fmt == "int8" else None)
        out = torch.empty(16, packed.padded_out)
        first = torch.full((16,), -7, dtype=torch.int64)
        for threads in (1, 2):
            call = LinearCall(lib, packed, x, out, num_threads=threads)
            for m in range(1, 17):
                with exact_threads(variant):
                    call(m, first_max=first)
                want = np.argmax(out[:m, :n].numpy(), axis=1)
                assert first[:m].tolist() == want.tolist(), (seed, threads, m)
                if seed % 4 == 3:
                    assert want.tolist() == [0] * m  # the all -inf rows were -inf indeed
    with pytest.raises(ValueError):
        call(2, first_max=torch.empty(1, dtype=torch.int64))
