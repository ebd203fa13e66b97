"""Block-wise FP8 checkpoints (DeepSeek-V3's format), dequantized tensor by tensor as they are read.

A quantized linear weight `X.weight` [O, I] is float8_e4m3fn beside `X.weight_scale_inv`
[ceil(O/bo), ceil(I/bi)] fp32, with config.json's `quantization_config` = {quant_method: fp8,
fmt: e4m3, weight_block_size: [bo, bi], activation_scheme: dynamic}; the real weight is the fp8 value
times its block's scale. Reading goes through `BlockFp8Checkpoint`, so routed experts reach the
expert stream (and its packed formats) and dense weights reach their dtype already dequantized, one
tensor at a time. `modeltools/fp8_write.py` writes such a checkpoint from an unquantized one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import CheckpointError, TensorShapeError, UnsupportedCheckpointError

SCALE_SUFFIX = "_scale_inv"
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class BlockFp8:
    """The block shape of a block-FP8 checkpoint (rows, columns of a weight per scale)."""

    block: tuple[int, int] = (128, 128)

    @classmethod
    def from_quantization_config(cls, qc: dict[str, Any]) -> BlockFp8:
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise UnsupportedCheckpointError(f"fp8 checkpoint with fmt={fmt!r}: only e4m3 (float8_e4m3fn) loads")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedCheckpointError(
                f"fp8 checkpoint with activation_scheme={qc.get('activation_scheme')!r}: only 'dynamic' loads")
        block = qc.get("weight_block_size")
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise UnsupportedCheckpointError(
                f"fp8 checkpoint without a block-wise weight_block_size [rows, cols] (got {block!r}): "
                "per-tensor and per-channel fp8 do not load")
        return cls((block[0], block[1]))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor's shape for a weight of `shape` ([..., O, I]: leading dims are experts)."""
        *lead, rows, cols = shape
        return (*lead, math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """weight [..., O, I] fp8, scale_inv [..., ceil(O/bo), ceil(I/bi)] -> fp32 [..., O, I]."""
        rows, cols = weight.shape[-2:]
        scale = scale_inv.float().repeat_interleave(self.block[0], -2)[..., :rows, :]
        scale = scale.repeat_interleave(self.block[1], -1)[..., :cols]  # [..., O, I]
        return weight.float() * scale

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """weight [O, I] -> (fp8 [O, I], scale_inv fp32 [ceil(O/bo), ceil(I/bi)]), amax per block -> 448."""
        rows, cols = weight.shape
        bo, bi = self.block
        pr, pc = math.ceil(rows / bo) * bo, math.ceil(cols / bi) * bi
        padded = torch.zeros(pr, pc, dtype=torch.float32)
        padded[:rows, :cols] = weight.float()
        blocks = padded.view(pr // bo, bo, pc // bi, bi)
        amax = blocks.abs().amax(dim=(1, 3))  # [O/bo, I/bi]
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        q = (blocks / scale[:, None, :, None]).view(pr, pc)[:rows, :cols].to(torch.float8_e4m3fn)
        return q, scale


class BlockFp8Checkpoint:
    """A checkpoint view whose quantized weights read back dequantized (fp32); their scales are consumed."""

    def __init__(self, inner: Any, fmt: BlockFp8) -> None:
        self.inner, self.fmt = inner, fmt
        self.files, self.handles = inner.files, inner.handles
        # weight name -> its scale's name; an orphan scale stays in `where`, where the loader reports it
        self.scales = {n[: -len(SCALE_SUFFIX)]: n for n in inner.where
                       if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in inner.where}
        consumed = set(self.scales.values())
        self.where = {n: w for n, w in inner.where.items() if n not in consumed}
        for name, scale in self.scales.items():
            if _dtype(inner, name) != "F8_E4M3":
                raise CheckpointError(f"{name} has a {SCALE_SUFFIX} but is stored as {_dtype(inner, name)}, not F8_E4M3")
            want = self.fmt.scale_shape(inner.shape(name))
            if inner.shape(scale) != want:
                raise TensorShapeError(scale, want, inner.shape(scale))
        unscaled = [n for n in self.where if n not in self.scales and _dtype(inner, n).startswith("F8")]
        if unscaled:
            raise CheckpointError(f"fp8 tensor(s) without a {SCALE_SUFFIX}: {', '.join(sorted(unscaled)[:5])}")

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def get(self, name: str, expert: int | None = None) -> torch.Tensor:
        t = self.inner.get(name, expert)
        if name not in self.scales:
            return t
        return self.fmt.dequantize(t, self.inner.get(self.scales[name], expert))


def _dtype(ckpt: Any, name: str) -> str:
    handle, _ = ckpt.where[name]
    return handle.get_slice(name).get_dtype()
