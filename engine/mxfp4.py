"""MXFP4 expert weights (GPT-OSS's released checkpoints, `quantization_config.quant_method: mxfp4`).

A projection [N, K] is stored as `*_blocks` uint8 [N, K/32, 16] (two FP4 E2M1 values per byte, the low
nibble first) and `*_scales` uint8 [N, K/32] (an E8M0 exponent per block of 32: 2^(s - 127)). The loader
dequantizes one expert at a time into the model dtype and packs it into the engine's expert formats, as
it does with any other checkpoint; `quantize_mxfp4` writes the format (for converting checkpoints).
"""

from __future__ import annotations

import torch

from engine.errors import CheckpointError

BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., N, G, 16], scales uint8 [..., N, G] -> fp32 [..., N, G * 32] (exact: every value
    is a small FP4 number times a power of two)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                              f"match (expected [..., G, {BLOCK // 2}] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    values = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)  # [..., N, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32]):
    per block the smallest power of two that brings its largest magnitude within 6, values rounded to the
    nearest FP4 number."""
    if w.shape[-1] % BLOCK:
        raise CheckpointError(f"MXFP4 needs the input dim to be a multiple of {BLOCK}, got {w.shape[-1]}")
    g = w.float().unflatten(-1, (-1, BLOCK))  # [..., N, G, 32]
    amax = g.abs().amax(-1)  # [..., N, G]
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = g / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)  # within [-6, 6]
    lut = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1)  # nearest magnitude, [..., N, G, 32]
    code = code + 8 * (scaled < 0)
    pairs = code.to(torch.uint8).unflatten(-1, (-1, 2))  # [..., N, G, 16, 2]
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)
