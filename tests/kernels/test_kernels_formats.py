"""Packed expert formats: round trip, quantization error bounds, state dict, subsets, validation."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import random_experts

from kernels import FORMATS, FormatError, PackedExperts, pack_experts

# Worst-case |dequantized - original| per weight, as a fraction of the group's max |w| (or range):
# int8 half a step of amax/127, int4 half a step of amax/7, int4_asym half a step of range/15;
# plus fp16 rounding of scale/min. bf16 keeps 8 mantissa bits (rel 2^-9).
QUANT_BOUND = {"int8": 0.5 / 127 + 2e-3, "int8_a8": 0.5 / 127 + 2e-3, "int4": 0.5 / 7 + 2e-3, "int4_asym": 0.5 / 15 + 4e-3}


@pytest.mark.parametrize("fmt,gs", [("fp32", None), ("bf16", None), ("int8", 32), ("int8", 128),
                                    ("int4", 32), ("int4", 64), ("int4_asym", 32), ("int4_asym", 128),
                                    ("int8_a8", 32), ("int8_a8", 64)])
@pytest.mark.parametrize("h,i", [(64, 32), (200, 72)])
def test_dequantize_round_trip(fmt: str, gs: int | None, h: int, i: int) -> None:
    w_gu, w_dn = random_experts(3, h, i)
    packed = pack_experts(w_gu, w_dn, fmt, gs, progress=False)
    packed.validate()
    assert (packed.num_experts, packed.hidden, packed.intermediate) == (3, h, i)
    for e in range(3):
        d_gu, d_dn = packed.dequantize(e)
        assert d_gu.shape == (2 * i, h) and d_dn.shape == (h, i)
        for src, deq in ((w_gu[e], d_gu), (w_dn[e], d_dn)):
            if fmt == "fp32":
                assert torch.equal(src, deq)
            elif fmt == "bf16":
                assert torch.equal(src.to(torch.bfloat16).float(), deq)
            else:
                kp = -(-src.shape[1] // gs) * gs
                grp = torch.nn.functional.pad(src, (0, kp - src.shape[1])).unflatten(1, (-1, gs))
                span = grp.amax(-1) - grp.amin(-1) if fmt == "int4_asym" else grp.abs().amax(-1)
                err = torch.nn.functional.pad((deq - src).abs(), (0, kp - src.shape[1])).unflatten(1, (-1, gs))
                assert bool((err.amax(-1) <= span * QUANT_BOUND[fmt] + 1e-7).all())


def test_quantized_repack_is_stable() -> None:
    """Packing the dequantized weights again gives the same bytes (idempotent quantization)."""
    w_gu, w_dn = random_experts(2, 96, 48)
    for fmt in ("int8", "int4", "int4_asym"):
        p = pack_experts(w_gu, w_dn, fmt, progress=False)
        deq = [p.dequantize(e) for e in range(2)]
        p2 = pack_experts(torch.stack([d[0] for d in deq]), torch.stack([d[1] for d in deq]), fmt, progress=False)
        for e in range(2):
            for a, b in zip(p.dequantize(e), p2.dequantize(e), strict=True):
                assert torch.equal(a, b), fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_and_subset(fmt: str) -> None:
    w_gu, w_dn = random_experts(5, 64, 32)
    packed = pack_experts(w_gu, w_dn, fmt, progress=False)
    back = PackedExperts.from_state_dict(packed.state_dict())
    assert (back.fmt, back.group_size, back.expert_ids) == (packed.fmt, packed.group_size, packed.expert_ids)
    assert all(torch.equal(back.tensors[k], v) for k, v in packed.tensors.items())
    sub = packed.expert_subset([4, 1])
    assert sub.expert_ids == (4, 1) and sub.num_experts == 2
    assert sub.nbytes == 2 * packed.expert_nbytes()
    assert torch.equal(sub.dequantize(0)[1], packed.dequantize(4)[1])
    assert torch.equal(sub.dequantize(sub.local_index(1))[0], packed.dequantize(1)[0])


def test_bytes_per_weight() -> None:
    w_gu, w_dn = random_experts(2, 256, 128)
    params = w_gu.numel() + w_dn.numel()
    expect = {"fp32": 4, "bf16": 2, "int8": 1 + 2 / 64, "int4": 0.5 + 2 / 32, "int4_asym": 0.5 + 4 / 32,
              "int8_a8": 1 + 2 / 32}
    for fmt, bpw in expect.items():
        assert pack_experts(w_gu, w_dn, fmt, progress=False).nbytes == pytest.approx(params * bpw)


def test_errors_are_actionable() -> None:
    w_gu, w_dn = random_experts(2, 64, 32)
    with pytest.raises(FormatError, match="unknown expert weight format"):
        pack_experts(w_gu, w_dn, "int3")
    with pytest.raises(FormatError, match="group_size"):
        pack_experts(w_gu, w_dn, "int4", 33)
    with pytest.raises(FormatError, match=r"\[E, 2I, H\]"):
        pack_experts(w_gu, w_dn[:, :, :16], "int8")
    sd = pack_experts(w_gu, w_dn, "int8", progress=False).state_dict()
    sd["meta"][0] += 1
    with pytest.raises(FormatError, match="layout version"):
        PackedExperts.from_state_dict(sd)
    sd = pack_experts(w_gu, w_dn, "int8", progress=False).state_dict()
    sd["down"] = sd["down"][:, :-1]
    with pytest.raises(FormatError, match="down"):
        PackedExperts.from_state_dict(sd)


def test_registry_bits_match_packed_bytes_and_parts_drive_every_list() -> None:
    """REGISTRY's bits and group sizes are what pack_experts stores; the engine's lists derive from it."""
    from engine.experts import EXPERT_FORMATS, PlacementConfig
    from engine.models.causal_lm import QuantizedLMHead
    from kernels.formats import REGISTRY, formats_for
    from kernels.linear import LINEAR_FORMATS, PackedLinear

    e, h, i = 2, 64, 64
    w_gu, w_dn = random_experts(e, h, i)
    for name, spec in REGISTRY.items():
        packed = pack_experts(w_gu, w_dn, name, None, progress=False)
        weights = packed.tensors["gate_up"].numel() * packed.tensors["gate_up"].element_size()
        assert weights * 8 == e * 2 * i * h * spec.bits, name  # h, i multiples of 8 and of every group
        assert packed.group_size == spec.group_size, name
    assert EXPERT_FORMATS == formats_for("experts") == ("fp32", "bf16", "int8", "int4", "bf16_a16", "int8_a8")
    assert LINEAR_FORMATS == FORMATS and QuantizedLMHead.FORMATS == ("bf16", "int8", "int4", "bf16_a16", "int8_a8")
    with pytest.raises(ValueError, match="int4_asym"):
        PlacementConfig(fast_format="int4_asym")
    with pytest.raises(ValueError, match="fp32"):
        QuantizedLMHead(torch.zeros(8, 8), "fp32")
    assert PackedLinear.pack(torch.randn(8, 64), "bf16_a16").fmt == "bf16_a16"
    with pytest.raises(FormatError, match="unknown weight part"):
        formats_for("router")
