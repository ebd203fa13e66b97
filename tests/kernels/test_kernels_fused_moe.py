"""Compiled fused MoE vs its torch reference, batch invariance, expert subsets and the fallback path.

Tolerance (same as kernels/fused_moe.py): |kernel - reference| <= 1e-4 * max|reference| + 1e-5.
The kernel multiplies by exactly the dequantized weights the reference uses; only the fp32
summation order differs.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from kernel_cases import exact_threads, random_experts, random_routing

from kernels import ExpertIdError, build, fused_moe, fused_moe_reference, kernel_available, pack_experts
from kernels.cpu_features import detect, select_variant, vnni_capable
from kernels.formats import quantize_activations
from kernels.fused_moe import fused_moe_fake_quant, kernel_library, path_limit

CONFIGS = [("fp32", None), ("bf16", None), ("int8", 32), ("int8", 128), ("int4", 32), ("int4", 64),
           ("int4_asym", 32), ("int4_asym", 128), ("int8_a8", 32), ("int8_a8", 64)]
SHAPES = [(64, 32), (96, 48), (200, 72)]
TOKENS_TOPK = [(1, 1), (2, 8), (3, 2), (8, 4), (17, 3), (64, 8)]
NUM_EXPERTS = 8

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")
# Every compiled path this machine can run: plain loops, AVX2 (maddubs), AVX-512 (W4A8 on zmm vpdpbusd).
VARIANTS = ["generic", "avx2", *(["avx512"] if vnni_capable(detect()) else [])]
FORMATS = ["fp32", "bf16", "int8", "int4", "int4_asym", "bf16_a16", "int8_a8"]


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == torch.float32
    tol = 1e-4 * ref.abs().max().item() + 1e-5
    err = (out - ref).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"


@needs_kernel
@pytest.mark.parametrize("fmt,gs", CONFIGS)
@pytest.mark.parametrize("h,i", SHAPES)
def test_kernel_matches_reference(fmt: str, gs: int | None, h: int, i: int) -> None:
    packed = pack_experts(*random_experts(NUM_EXPERTS, h, i), fmt, gs, progress=False)
    for n, (t, k) in enumerate(TOKENS_TOPK):
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(n))
        ids, w = random_routing(t, k, NUM_EXPERTS, seed=n, skip_frac=0.2 if n % 2 else 0.0)
        assert_close(fused_moe(x, ids, w, packed), fused_moe_reference(x, ids, w, packed))


@needs_kernel
@pytest.mark.parametrize("fmt,gs", CONFIGS[::2] + [("int4_asym", 32)])
def test_generic_variant_matches_reference(fmt: str, gs: int | None) -> None:
    assert kernel_available("generic")
    packed = pack_experts(*random_experts(NUM_EXPERTS, 200, 72), fmt, gs, progress=False)
    for n, (t, k) in enumerate(TOKENS_TOPK[:4]):
        x = torch.randn(t, 200, generator=torch.Generator().manual_seed(n))
        ids, w = random_routing(t, k, NUM_EXPERTS, seed=n, skip_frac=0.2)
        assert_close(fused_moe(x, ids, w, packed, variant="generic"), fused_moe_reference(x, ids, w, packed))


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_variant_matches_reference(variant: str, fmt: str) -> None:
    """Each compiled path against the torch reference: H = 200 (an odd number of 8-row output tiles, so
    the zmm path's last down unit is a single tile), I = 72, 1..64 tokens (up to 8 rows per weight block)."""
    if variant == "avx512":  # the build these tests force: zmm W4A8, and vdpbf16ps where the CPU has it
        lib = build.load("avx512")
        assert lib.moegate_is_vnni() == 1 and lib.moegate_has_bf16_dot() == int(detect().avx512_bf16)
    packed = pack_experts(*random_experts(NUM_EXPERTS, 200, 72), fmt, progress=False)
    for n, (t, k) in enumerate([*TOKENS_TOPK, (16, 8), (40, 4)]):
        x = torch.randn(t, 200, generator=torch.Generator().manual_seed(n))
        ids, w = random_routing(t, k, NUM_EXPERTS, seed=n, skip_frac=0.1 if n % 2 else 0.0)
        assert_close(fused_moe(x, ids, w, packed, variant=variant), fused_moe_reference(x, ids, w, packed))


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_variant_row_is_bitwise_batch_invariant(variant: str, fmt: str) -> None:
    """A row's bits alone equal its bits in a batch of M = 1..16 rows, at any position and under any
    permutation of the other rows (the rows share few experts, so each weight block serves up to 8 rows
    at once in the zmm path), with 1 or 2 threads."""
    h, i, e = 200, 72, 4
    packed = pack_experts(*random_experts(e, h, i), fmt, progress=False)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(16, h, generator=gen)
    ids, w = random_routing(16, 3, e, seed=11, skip_frac=0.1)
    alone = torch.cat([fused_moe(x[r:r + 1], ids[r:r + 1], w[r:r + 1], packed, variant=variant, num_threads=1)
                       for r in range(16)])
    with exact_threads(variant):
        for m in range(1, 17):
            for trial in range(2):
                rows = torch.randperm(16, generator=gen)[:m]
                out = fused_moe(x[rows], ids[rows], w[rows], packed, variant=variant, num_threads=1 + trial)
                assert torch.equal(out, alone[rows]), (m, trial)


def test_variant_selection() -> None:
    f = detect()
    simd = f.avx2 and f.fma and f.f16c and f.arch == "x86_64"
    vnni = f.avx512f and f.avx512bw and f.avx512vl and f.avx512_vnni
    assert select_variant(f) == ("generic" if not simd else "avx512" if vnni else "avx2")
    assert vnni_capable(f) == bool(simd and vnni)
    base = dict(avx2=True, fma=True, f16c=True)
    assert select_variant(type(f)("x86_64", **{**base, "avx2": False}, avx512f=True)) == "generic"
    assert not vnni_capable(type(f)("x86_64", **base, avx512f=True))  # no VNNI / BW / VL
    full = type(f)("x86_64", **base, avx512f=True, avx512bw=True, avx512vl=True, avx512_vnni=True)
    assert select_variant(full) == "avx512" and vnni_capable(full)
    assert select_variant(type(f)("x86_64", **base)) == "avx2"
    assert select_variant(type(f)("aarch64", **base)) == "generic"


def test_detect_reads_the_cpu_model_name() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
    assert detect().model == (names[0] if names else "")


@pytest.mark.skipif(not (kernel_available("avx2") and vnni_capable(detect())),
                    reason="needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize(("fmt", "gs"), [("fp32", None), ("bf16", None), ("int8", None), ("int8", 32), ("int4", None),
                                        ("int4_asym", None), ("int8_a8", None)])
def test_avx512_variant_equals_avx2_bitwise(fmt: str, gs: int | None) -> None:
    """vpdpbusd replaces maddubs + madd + add in the int4 dot products (the same exact integer sums), and
    the zmm fp32 FMA units (fp_zmm.h: 16 rows x up to 15 tokens; few int8 rows with groups side by side,
    int8 group 32: odd group counts 7 and 3) keep each row's fma sequence, so the avx512 build gives the
    avx2 build's bits for every format, batch size and top-k."""
    packed = pack_experts(*random_experts(NUM_EXPERTS, 200, 72), fmt, group_size=gs, progress=False)
    for n, (t, k) in enumerate(TOKENS_TOPK):
        x = torch.randn(t, 200, generator=torch.Generator().manual_seed(n))
        ids, w = random_routing(t, k, NUM_EXPERTS, seed=n, skip_frac=0.2)
        a = fused_moe(x, ids, w, packed, variant="avx512")
        assert torch.equal(a, fused_moe(x, ids, w, packed, variant="avx2"))
        assert_close(a, fused_moe_reference(x, ids, w, packed))


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_row_order_is_fixed_whatever_its_token_count(variant: str, fmt: str) -> None:
    """Every row routed to the same experts: each expert's GEMM sees M = 1..16 rows (one register block
    or several, any row position), yet a row's bits equal its bits alone; slot order fixed per row."""
    h, i, e = 136, 40, 4
    packed = pack_experts(*random_experts(e, h, i, seed=5), fmt, progress=False)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(16, h, generator=gen)
    ids = torch.tensor([[2, 0, 3]]).repeat(16, 1)  # [16, 3]: experts 2, 0, 3 get every row
    w = torch.softmax(torch.randn(16, 3, generator=gen), dim=-1)
    alone = torch.cat([fused_moe(x[r:r + 1], ids[r:r + 1], w[r:r + 1], packed, variant=variant, num_threads=1)
                       for r in range(16)])
    assert_close(alone, fused_moe_reference(x, ids, w, packed))
    with exact_threads(variant):
        for m in range(1, 17):
            rows = torch.randperm(16, generator=gen)[:m]
            out = fused_moe(x[rows], ids[rows], w[rows], packed, variant=variant, num_threads=1 + m % 2)
            assert torch.equal(out, alone[rows]), m


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["int4", "int4_asym", "int8_a8"])
def test_prefill_sized_batches_rows_equal_rows_alone(variant: str, fmt: str) -> None:
    """128 rows, a prefill's worth: every row on the same experts (each expert's GEMM 16 full chunks of 8 rows)
    and top-4 of 16 experts (~32 rows each, ragged chunk tails); each row's bits equal its bits alone."""
    h, i, e = 136, 40, 16
    packed = pack_experts(*random_experts(e, h, i, seed=9), fmt, progress=False)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(128, h, generator=gen)
    routed, _ = random_routing(128, 4, e, seed=13)
    for ids in (torch.tensor([[5, 1, 12, 7]]).repeat(128, 1), routed):
        w = torch.softmax(torch.randn(128, 4, generator=gen), dim=-1)
        alone = torch.cat([fused_moe(x[r:r + 1], ids[r:r + 1], w[r:r + 1], packed, variant=variant, num_threads=1)
                           for r in range(128)])
        with exact_threads(variant):
            assert torch.equal(fused_moe(x, ids, w, packed, variant=variant, num_threads=2), alone)
        assert_close(alone, fused_moe_reference(x, ids, w, packed))


@pytest.mark.skipif(not (kernel_available("avx2") and vnni_capable(detect())),
                    reason="needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "bf16_a16"])
def test_interleaved_fp_chunks_equal_avx2_and_rows_alone(fmt: str) -> None:
    """Experts with more than two rows run fp_zmm.h's interleaved chunks (FpActs), fewer the per-row
    pointer units: with every row on the same experts and odd K (fp32 / bf16: an odd k tail), each
    batch of M = 1..25 rows (every tail of 1-7 rows alone, folded into the pass of a full chunk, or after
    full passes) equals each row's bits alone, on every path this CPU has (forced narrower with
    path_limit), and the avx2 build bitwise where the path is fp32 FMA (bf16_a16 on vdpbf16ps rounds
    inside the instruction: its own bits, close to the reference)."""
    h, i, e = 135, 37, 4
    packed = pack_experts(*random_experts(e, h, i, seed=7), fmt, progress=False)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(25, h, generator=gen)
    ids = torch.tensor([[1, 3]]).repeat(25, 1)  # [25, 2]
    w = torch.softmax(torch.randn(25, 2, generator=gen), dim=-1)
    lib = kernel_library("avx512")
    for limit in ("amx", "bf16", "zmm"):
        with path_limit(limit):
            dot16 = fmt == "bf16_a16" and lib.moegate_has_bf16_dot() == 1
            alone = torch.cat([fused_moe(x[r:r + 1], ids[r:r + 1], w[r:r + 1], packed, variant="avx512",
                                         num_threads=1) for r in range(25)])
            for m in range(1, 26):
                rows = torch.randperm(25, generator=gen)[:m]
                out = fused_moe(x[rows], ids[rows], w[rows], packed, variant="avx512", num_threads=1)
                assert torch.equal(out, alone[rows]), (limit, m)
                if not dot16:
                    avx2 = fused_moe(x[rows], ids[rows], w[rows], packed, variant="avx2", num_threads=1)
                    assert torch.equal(out, avx2), (limit, m)
            assert_close(alone, fused_moe_reference(x, ids, w, packed))


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "int4_asym", "int8_a8"])
def test_row_is_bitwise_batch_invariant(fmt: str) -> None:
    """A row's output is the same bits alone, inside any batch of 1..64 rows, for 1 or 2 threads."""
    h, i = 96, 48
    packed = pack_experts(*random_experts(NUM_EXPERTS, h, i), fmt, progress=False)
    x = torch.randn(64, h, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids, w = random_routing(64, 4, NUM_EXPERTS, seed=1, skip_frac=0.1)
    full = fused_moe(x, ids, w, packed)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    with exact_threads():
        for size in (1, 2, 3, 5, 8, 17, 33, 64):
            rows = perm[:size]
            for threads in (1, 2):
                part = fused_moe(x[rows], ids[rows], w[rows], packed, num_threads=threads)
                assert torch.equal(part, full[rows]), (size, threads)


@needs_kernel
def test_bf16_input_and_expert_subset() -> None:
    w_gu, w_dn = random_experts(NUM_EXPERTS, 64, 32)
    packed = pack_experts(w_gu, w_dn, "int4", progress=False)
    x = torch.randn(5, 64).to(torch.bfloat16)
    ids, w = random_routing(5, 4, NUM_EXPERTS, seed=3)
    assert_close(fused_moe(x, ids, w, packed), fused_moe_reference(x.float(), ids, w, packed))
    # Split experts into two subsets: each computes its own slots; the sum matches the whole.
    hot = packed.expert_subset([6, 1, 3])
    cold = packed.expert_subset([e for e in range(NUM_EXPERTS) if e not in (6, 1, 3)])
    both = fused_moe(x, ids, w, hot, skip_missing=True) + fused_moe(x, ids, w, cold, skip_missing=True)
    assert_close(both, fused_moe_reference(x, ids, w, packed))
    assert_close(fused_moe(x, ids, w, hot, skip_missing=True),
                 fused_moe_reference(x, ids, w, hot, skip_missing=True))
    with pytest.raises(ExpertIdError, match="skip_missing"):
        fused_moe(x, ids, w, hot)
    bad = ids.clone()
    bad[0, 0] = NUM_EXPERTS
    with pytest.raises(ExpertIdError):
        fused_moe(x, bad, w, packed)


@needs_kernel
def test_all_slots_skipped_gives_zero() -> None:
    packed = pack_experts(*random_experts(NUM_EXPERTS, 64, 32), "int8", progress=False)
    out = fused_moe(torch.randn(3, 64), torch.full((3, 2), -1), torch.ones(3, 2), packed)
    assert torch.equal(out, torch.zeros(3, 64))
    empty = fused_moe(torch.randn(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.ones(0, 2), packed)
    assert empty.shape == (0, 64)


def test_disabled_cpp_uses_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = pack_experts(*random_experts(NUM_EXPERTS, 64, 32), "int4", progress=False)
    x = torch.randn(4, 64)
    ids, w = random_routing(4, 2, NUM_EXPERTS)
    ref = fused_moe_reference(x, ids, w, packed)

    def no_load(variant: str) -> None:
        raise AssertionError("the compiled kernel must not be loaded when disabled")

    monkeypatch.setattr(build, "load", no_load)
    assert torch.equal(fused_moe(x, ids, w, packed, use_cpp=False), ref)
    monkeypatch.setenv("MOEGATE_DISABLE_CPP", "1")
    assert torch.equal(fused_moe(x, ids, w, packed), ref)


def test_failed_build_falls_back_with_one_warning(monkeypatch, tmp_path, caplog) -> None:
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCE", bad)
    monkeypatch.setenv("MOEGATE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_loaded", {})
    packed = pack_experts(*random_experts(NUM_EXPERTS, 64, 32), "int8", progress=False)
    x = torch.randn(2, 64)
    ids, w = random_routing(2, 2, NUM_EXPERTS)
    with caplog.at_level(logging.WARNING, logger="kernels.build"):
        out1 = fused_moe(x, ids, w, packed)
        out2 = fused_moe(x, ids, w, packed)
    assert torch.equal(out1, fused_moe_reference(x, ids, w, packed)) and torch.equal(out1, out2)
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "torch reference" in warnings[0].getMessage()


@pytest.mark.skipif(not kernel_available("avx2"), reason="no C++ compiler")
def test_failed_avx512_build_falls_back_to_avx2(monkeypatch, caplog) -> None:
    real_build = build.build

    def no_avx512(variant: str):
        if variant == "avx512":
            raise build.KernelBuildError("compiler without AVX-512 VNNI")
        return real_build(variant)

    monkeypatch.setattr(build, "build", no_avx512)
    monkeypatch.setattr(build, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="kernels.build"):
        lib = build.load("avx512")
    assert lib is not None and lib.moegate_is_vnni() == 0 and lib.moegate_is_avx2() == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "using the avx2 build" in warnings[0]


def test_rejects_bad_arguments() -> None:
    packed = pack_experts(*random_experts(2, 64, 32), "bf16", progress=False)
    ids, w = random_routing(2, 1, 2)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(torch.randn(2, 64), ids, w, packed, act="gelu")
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        fused_moe(torch.randn(2, 32), ids, w, packed)


def test_activation_quantization_is_exact_int8_grid() -> None:
    x = torch.tensor([[1.0, -0.5, 0.25, 127.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 8])
    xq = quantize_activations(x, 8)
    assert torch.equal(xq[1], torch.zeros(8))  # all-zero group: scale 0, no division
    s = 127.0 / 127.0
    assert torch.equal(xq[0], torch.round(x[0] / s) * s)  # 0.25 -> 0, -0.5 -> -0 (half to even)
    y = torch.randn(3, 200)
    q = quantize_activations(y, 32)
    assert q.shape == y.shape
    groups = torch.nn.functional.pad(y, (0, 24)).unflatten(1, (-1, 32))
    step = (groups.abs().amax(-1, keepdim=True) / 127).expand(-1, -1, 32).flatten(1)[:, :200]
    assert bool(((q - y).abs() <= step / 2 * (1 + 1e-6)).all())


@needs_kernel
@pytest.mark.parametrize("fmt", ["int4", "int4_asym"])
def test_int4_is_w4a8_and_bit_exact(fmt: str) -> None:
    """int4 kernels (AVX2 and generic) reproduce the step-by-step torch reference to the bit (a
    float64-emulated fma may double-round, ~2^-29 per operation: allow 0.1% of elements), and the
    reference has W4A8 semantics: close to dequantize-and-matmul on int8-quantized inputs, not on
    fp32 inputs."""
    packed = pack_experts(*random_experts(NUM_EXPERTS, 200, 72), fmt, progress=False)
    x = torch.randn(17, 200, generator=torch.Generator().manual_seed(5))
    ids, w = random_routing(17, 4, NUM_EXPERTS, seed=5, skip_frac=0.1)
    ref = fused_moe_reference(x, ids, w, packed)
    variants = [v for v in ("avx512", "avx2") if v == "avx2" or vnni_capable(detect())]
    for variant in [*variants, "generic"] if kernel_available("avx2") else ["generic"]:
        out = fused_moe(x, ids, w, packed, variant=variant)
        assert_close(out, ref)
        assert (out != ref).sum().item() <= ref.numel() // 1000, variant
    scale = ref.abs().max()
    assert (ref - fused_moe_fake_quant(x, ids, w, packed)).abs().max() < 1e-2 * scale
    fp32_input = torch.zeros_like(ref)
    for t in range(17):
        for s in range(4):
            if ids[t, s] < 0:
                continue
            w_gu, w_dn = packed.dequantize(int(ids[t, s]))
            gu = w_gu @ x[t]
            fp32_input[t] += w[t, s] * (w_dn @ (torch.nn.functional.silu(gu[:72]) * gu[72:]))
    assert (ref - fp32_input).abs().max() > 1e-4 * scale + 1e-5
    assert (ref - fp32_input).abs().max() < 0.05 * scale


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
def test_scratch_reused_across_calls_of_other_shapes(variant: str) -> None:
    """The kernel's per-thread scratch is not zeroed between calls: a padded int4 problem (H = 200 and
    I = 72 padded to groups of 32) after larger fp32 and int8 calls of other shapes must still match its
    reference, and give the bits it gives first."""
    padded = pack_experts(*random_experts(NUM_EXPERTS, 200, 72), "int4", progress=False)
    x = torch.randn(17, 200, generator=torch.Generator().manual_seed(3))
    ids, w = random_routing(17, 4, NUM_EXPERTS, seed=3)
    first = fused_moe(x, ids, w, padded, variant=variant)
    for fmt, h, i in (("fp32", 256, 128), ("int8", 96, 160)):
        other = pack_experts(*random_experts(NUM_EXPERTS, h, i), fmt, progress=False)
        xo = torch.randn(64, h, generator=torch.Generator().manual_seed(4)) * 1e3
        fused_moe(xo, *random_routing(64, 8, NUM_EXPERTS, seed=4), other, variant=variant)
        again = fused_moe(x, ids, w, padded, variant=variant)
        assert torch.equal(again, first), fmt
    assert_close(first, fused_moe_reference(x, ids, w, padded))


@needs_kernel
@pytest.mark.parametrize("gs", [32, 64])
def test_int8_a8_is_w8a8_and_bit_exact(gs: int) -> None:
    """int8_a8 on every compiled path (zmm vpdpbusd with the +128 weight offset, avx2 maddubs on |w| and
    sign(q, w), plain loops) gives the step-by-step reference's bits (up to ~2^-29-rare double roundings
    of its float64-emulated fma); the weights are int8's, only the activations differ: the reference is
    close to int8 (W8A16) on the same groups, and not equal to it."""
    experts = random_experts(NUM_EXPERTS, 200, 72)
    packed = pack_experts(*experts, "int8_a8", gs, progress=False)
    w8a16 = pack_experts(*experts, "int8", gs, progress=False)
    for e in range(NUM_EXPERTS):  # the same weights as int8 at the same group size
        assert all(torch.equal(a, b) for a, b in zip(packed.dequantize(e), w8a16.dequantize(e), strict=True))
    x = torch.randn(17, 200, generator=torch.Generator().manual_seed(5))
    ids, w = random_routing(17, 4, NUM_EXPERTS, seed=5, skip_frac=0.1)
    ref = fused_moe_reference(x, ids, w, packed)
    for variant in VARIANTS:
        out = fused_moe(x, ids, w, packed, variant=variant)
        assert (out != ref).sum().item() <= ref.numel() // 1000, variant
    scale = ref.abs().max()
    assert (ref - fused_moe_fake_quant(x, ids, w, packed)).abs().max() < 1e-2 * scale
    fp32_act = fused_moe_reference(x, ids, w, w8a16)
    assert 1e-4 * scale < (ref - fp32_act).abs().max() < 0.03 * scale


@needs_kernel
def test_thread_pool_survives_fork_and_many_calls() -> None:
    """Helpers are per process: a forked child computes the same bytes (no deadlock on the pool)."""
    packed = pack_experts(*random_experts(NUM_EXPERTS, 96, 48), "int8", progress=False)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(7))
    ids, w = random_routing(9, 3, NUM_EXPERTS, seed=7)
    want = fused_moe(x, ids, w, packed, num_threads=2)
    with exact_threads():
        for threads in (1, 2, 3, 2, 1, 4):
            assert torch.equal(fused_moe(x, ids, w, packed, num_threads=threads), want)
    pid = os.fork()
    if pid == 0:  # child: exit code says whether the result matched
        ok = all(torch.equal(fused_moe(x, ids, w, packed, num_threads=2), want) for _ in range(3))
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("forked child hung in fused_moe")
    assert os.waitstatus_to_exitcode(done[1]) == 0


@needs_kernel
def test_pool_spin_and_rest_change_no_bytes() -> None:
    """The helpers' spin (moegate_pool_spin) and sending them to sleep between calls (moegate_pool_rest, as the
    fused decode step does after its lm_head) change when a helper picks up work, never the bytes."""
    lib = kernel_library()
    packed = pack_experts(*random_experts(NUM_EXPERTS, 96, 48), "int8", progress=False)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(8))
    ids, w = random_routing(9, 3, NUM_EXPERTS, seed=8)
    want = fused_moe(x, ids, w, packed, num_threads=2)
    old = lib.moegate_pool_spin(-1)  # < 0: read only
    try:
        with exact_threads():
            for spin in (0, 1, 50, old):
                assert lib.moegate_pool_spin(spin) >= 0
                assert lib.moegate_pool_spin(-1) == spin
                for _ in range(5):
                    assert torch.equal(fused_moe(x, ids, w, packed, num_threads=2), want)
                    lib.moegate_pool_rest()
                    time.sleep(0.001)  # a helper asleep on the condition variable when the next job comes
                    assert torch.equal(fused_moe(x, ids, w, packed, num_threads=2), want)
    finally:
        lib.moegate_pool_spin(old)


def test_stale_builds_are_pruned_and_used_ones_kept(tmp_path) -> None:
    import os
    import time

    from kernels.build import prune

    old = tmp_path / "moe_cpu-avx2-0000000000000000.so"
    fresh = tmp_path / "moe_cpu-avx2-1111111111111111.so"
    other = tmp_path / "moe_cpu-generic-2222222222222222.so"
    for f in (old, fresh, other):
        f.write_bytes(b"\0")
    week_ago = time.time() - 8 * 24 * 3600
    os.utime(old, (week_ago, week_ago))
    os.utime(other, (week_ago, week_ago))
    assert prune(tmp_path, "avx2") == [old]
    assert fresh.exists() and other.exists()  # another variant is pruned when that variant is built

