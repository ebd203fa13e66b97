"""Biased experts and GPT-OSS's clamped SwiGLU: the compiled kernel (every variant this machine runs) vs the
torch reference for every format, and the reference vs transformers' GptOssExperts on the same weights.

Tolerance as kernels/fused_moe.py: |kernel - reference| <= 1e-4 * max|reference| + 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import random_experts, random_routing

from kernels import FormatError, PackedExperts, fused_moe, fused_moe_reference, kernel_available, pack_experts
from kernels.cpu_features import detect, vnni_capable
from kernels.formats import Activation
from kernels.silu import silu_f32

VARIANTS = ["generic", "avx2", *(["avx512"] if vnni_capable(detect()) else [])]
FORMATS = [("fp32", None), ("bf16", None), ("int8", 32), ("int4", 32), ("int4_asym", 32), ("bf16_a16", None)]
# a limit small enough that both clamps bite on these weights (gate/up values reach ~+-1.5)
CLAMPED = Activation("swiglu_clamped", alpha=1.702, limit=0.6)
E, H, I = 6, 72, 40  # noqa: E741

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")


def _biases(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, generator=g) * 0.5, torch.randn(E, H, generator=g) * 0.5


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 1e-4 * ref.abs().max().item() + 1e-5
    assert (out - ref).abs().max().item() <= tol


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt,gs", FORMATS)
@pytest.mark.parametrize("act,biased", [(CLAMPED, True), (CLAMPED, False), (Activation(), True)])
def test_kernel_matches_reference(variant: str, fmt: str, gs: int | None, act: Activation, biased: bool) -> None:
    w_gu, w_dn = random_experts(E, H, I)
    packed = pack_experts(w_gu, w_dn, fmt, gs, progress=False, biases=_biases() if biased else None, act=act)
    for n, (t, k) in enumerate([(1, 2), (5, 3), (19, 4)]):
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(n)) * 2
        ids, w = random_routing(t, k, E, seed=n, skip_frac=0.2 if n == 1 else 0.0)
        _close(fused_moe(x, ids, w, packed, variant=variant), fused_moe_reference(x, ids, w, packed))


def test_reference_matches_transformers_gpt_oss_experts() -> None:
    """fp32 packing: the reference equals GptOssExperts (interleaved [E, H, 2I] layout) on the same weights."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, swiglu_limit=CLAMPED.limit)
    hf = GptOssExperts(cfg)
    w_gu, w_dn = random_experts(E, H, I)
    b_gu, b_dn = _biases()
    with torch.no_grad():  # ours: gate rows then up rows; theirs: columns interleaved gate, up, gate, ...
        hf.gate_up_proj.copy_(torch.stack((w_gu[:, :I], w_gu[:, I:]), dim=2).reshape(E, 2 * I, H).transpose(1, 2))
        hf.gate_up_proj_bias.copy_(torch.stack((b_gu[:, :I], b_gu[:, I:]), dim=2).reshape(E, 2 * I))
        hf.down_proj.copy_(w_dn.transpose(1, 2))
        hf.down_proj_bias.copy_(b_dn)
    packed = pack_experts(w_gu, w_dn, "fp32", progress=False, biases=(b_gu, b_dn), act=CLAMPED)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3)) * 2
    ids, w = random_routing(9, 3, E, seed=3)
    with torch.no_grad():
        want = hf(x, ids, w)
    _close(fused_moe_reference(x, ids, w, packed), want)
    assert not torch.allclose(fused_moe_reference(x, ids, w, pack_experts(w_gu, w_dn, "fp32", progress=False)), want)


def test_bias_and_activation_survive_state_dict_and_subsets() -> None:
    w_gu, w_dn = random_experts(E, H, I)
    packed = pack_experts(w_gu, w_dn, "int8", progress=False, biases=_biases(), act=CLAMPED)
    again = PackedExperts.from_state_dict(packed.state_dict())
    assert again.act == CLAMPED and again.has_bias
    sub = packed.expert_subset([4, 1])
    x = torch.randn(3, H)
    ids, w = torch.tensor([[4, 1], [1, -1], [4, 4]]), torch.rand(3, 2)
    _close(fused_moe_reference(x, ids, w, sub, skip_missing=True), fused_moe_reference(x, ids, w, again))


def test_bad_activation_and_biases_are_typed_errors() -> None:
    w_gu, w_dn = random_experts(E, H, I)
    with pytest.raises(FormatError, match="unknown expert activation"):
        Activation("gelu")
    with pytest.raises(FormatError, match="positive limit"):
        Activation("swiglu_clamped", 1.702, 0.0)
    with pytest.raises(FormatError, match="biases"):
        pack_experts(w_gu, w_dn, "fp32", progress=False, biases=(torch.zeros(E, I), torch.zeros(E, H)))
    packed = pack_experts(w_gu, w_dn, "fp32", progress=False, act=CLAMPED)
    with pytest.raises(ValueError, match="packed with 'swiglu_clamped'"):
        fused_moe(torch.zeros(1, H), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), packed, "silu")


def test_float_silu_is_within_a_few_ulps_of_float64() -> None:
    """The kernel's float SiLU (kernels/silu.py replays it) against SiLU in float64: within 4e-7 relative
    wherever the result is a normal float, and finite at the clamp's edges and beyond."""
    g = torch.cat([torch.linspace(-100, 100, 200_001), torch.randn(100_000) * 8,
                   torch.tensor([-1e4, -88.5, -87.0, -1e-30, 0.0, 1e-30, 87.0, 88.5, 1e4])])
    out, ref = silu_f32(g), g.double() / (1 + torch.exp(-g.double()))
    assert bool(torch.isfinite(out).all())
    normal = ref.abs() > 1e-30
    assert ((out.double() - ref).abs()[normal] / ref.abs()[normal]).max().item() < 4e-7
    assert (out.double() - ref).abs().max().item() < 1e-30 + 4e-7 * 1e4
