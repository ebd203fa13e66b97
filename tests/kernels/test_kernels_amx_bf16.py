"""bf16_a16 on AMX tdpbf16ps (kernels/csrc/amx_bf16.h): routed experts and dense projections under
path_limit("amx") against the torch reference, and each row's bits the same alone as in any batch (M = 1..40,
128, 130, permuted; passes of 64 rows and experts past the kernel's 256-row blocks), on 1 and 2 threads, with odd
K (not a multiple of the 32-k chunk) and odd N (a last single 8-row tile); the same checks under the narrower
limits ("bf16": vdpbf16ps, "zmm": fp32 FMA), whose paths stay as they were."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import exact_threads, random_experts, random_routing

from kernels import pack_experts
from kernels.fused_moe import fused_moe, fused_moe_reference, kernel_library, kernel_variant, path_limit
from kernels.linear import PackedLinear

_lib = kernel_library()
pytestmark = pytest.mark.skipif(
    _lib is None or kernel_variant() != "avx512" or not _lib.moegate_has_amx() & 2,
    reason="needs the avx512 kernel on a CPU with AMX-BF16 and the OS's tile-data permission")

BATCHES = [*range(1, 41), 128, 130]
PATHS = {"amx": 2, "bf16": 1, "zmm": 0}  # path limit -> moegate_bf16_a16_path() (AMX-BF16 CPUs have AVX-512 BF16)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item() + 1e-5


def test_amx_is_the_bf16_a16_path_under_each_limit() -> None:
    """AMX where allowed; the narrower limits give vdpbf16ps and fp32 FMA back (their bits differ from AMX's)."""
    packed = PackedLinear.pack(torch.randn(64, 256) * 0.05, "bf16_a16")
    x = torch.randn(5, 256)
    outs = {}
    for name, code in PATHS.items():
        with path_limit(name):
            assert _lib.moegate_bf16_a16_path() == code, name
            outs[name] = packed(x)
            assert_close(outs[name], packed.reference(x))
    assert not torch.equal(outs["amx"], outs["bf16"])  # tdpbf16ps rounds its sums its own way


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n,k", [(150, 301), (8, 31), (69, 64), (16, 1)])
def test_linear_rows_are_batch_invariant(path: str, n: int, k: int) -> None:
    """N = 150 and 69: an odd tile count (a last single tile); K = 301, 31, 1: chunks of 32 k zero-padded."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05
    packed = PackedLinear.pack(w, "bf16_a16")
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(k))
    gen = torch.Generator().manual_seed(1)
    with path_limit(path), exact_threads():
        assert _lib.moegate_bf16_a16_path() == PATHS[path]
        alone = torch.cat([packed(x[i : i + 1], num_threads=1) for i in range(130)])
        assert_close(alone, packed.reference(x))
        for m in BATCHES:
            rows = torch.randperm(130, generator=gen)[:m]
            for threads in (1, 2):
                assert torch.equal(packed(x[rows], num_threads=threads), alone[rows]), (m, threads)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("e,h,i,topk,t", [(8, 200, 77, 4, 130), (2, 301, 40, 2, 300)])
def test_expert_rows_are_batch_invariant(path: str, e: int, h: int, i: int, topk: int, t: int) -> None:
    """(8, 200, 77): odd I (the down projection's K) and a last single down tile (H8 = 25); (2, 301, 40) top-2 of
    2: every expert holds all 300 rows (passes of 64 rows, the kernel's blocks of 256 rows), odd H."""
    experts = pack_experts(*random_experts(e, h, i, seed=e), "bf16_a16", progress=False)
    ids, wts = random_routing(t, topk, e, seed=t)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(h))
    gen = torch.Generator().manual_seed(2)
    with path_limit(path), exact_threads():
        assert _lib.moegate_bf16_a16_path() == PATHS[path]
        alone = torch.cat([fused_moe(x[j : j + 1], ids[j : j + 1], wts[j : j + 1], experts, num_threads=1)
                           for j in range(t)])
        assert_close(alone, fused_moe_reference(x, ids, wts, experts))
        for m in [*BATCHES, t]:
            rows = torch.randperm(t, generator=gen)[:m]
            for threads in (1, 2):
                out = fused_moe(x[rows], ids[rows], wts[rows], experts, num_threads=threads)
                assert torch.equal(out, alone[rows]), (m, threads)


def test_experts_with_skipped_slots_and_biases_on_amx() -> None:
    """Slots routed nowhere (-1) and per-expert biases with the clamped SwiGLU: the reference's numbers, and a row's
    bits alone equal its bits in the batch."""
    from kernels.formats import Activation

    e, h, i, t = 6, 96, 64, 40
    w_gu, w_dn = random_experts(e, h, i, seed=5)
    g = torch.Generator().manual_seed(5)
    biases = (torch.randn(e, 2 * i, generator=g) * 0.1, torch.randn(e, h, generator=g) * 0.1)
    experts = pack_experts(w_gu, w_dn, "bf16_a16", progress=False, biases=biases,
                           act=Activation("swiglu_clamped", alpha=1.702, limit=7.0))
    ids, wts = random_routing(t, 3, e, seed=6, skip_frac=0.3)
    x = torch.randn(t, h, generator=g)
    with path_limit("amx"):
        out = fused_moe(x, ids, wts, experts)
        assert_close(out, fused_moe_reference(x, ids, wts, experts))
        alone = torch.cat([fused_moe(x[j : j + 1], ids[j : j + 1], wts[j : j + 1], experts) for j in range(t)])
    assert torch.equal(out, alone)
