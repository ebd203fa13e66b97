"""Dense building blocks shared by every architecture: RMSNorm, rotary embedding (engine.rope), gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.rope import RotaryEmbedding
from kernels.rope import apply_rotary

__all__ = ["GatedMLP", "RMSNorm", "RotaryEmbedding", "apply_rotary"]


class RMSNorm(nn.Module):
    """`zero_centred` (Qwen3-Next): the weight is stored as an offset from 1 and scales in fp32."""

    def __init__(self, dim: int, eps: float, zero_centred: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._row_kernel(x):  # one kernel call per norm: no torch operation (nor its thread barrier)
            from kernels.norm import rms_norm_heads, rms_norm_rows

            # q / k as views of a fused projection: their head rows read in place
            if not x.is_contiguous() and x.dim() in (2, 3) and x.stride(-1) == 1:
                return rms_norm_heads(x if x.dim() == 3 else x[:, None], self.weight, self.eps).view(x.shape)
            return rms_norm_rows(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it) (x and its norm without a residual): the decoder layer's residual adds,
        in one kernel call with the norm where `forward` takes the row kernel (the sum is torch's to the bit)."""
        if residual is None:
            return x, self(x)
        if self._row_kernel(x) and x.dim() == 2 and residual.dtype == torch.float32:
            from kernels.norm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        s = x + residual
        return s, self(s)

    def _row_kernel(self, x: torch.Tensor) -> bool:
        """fp32 inference on CPU runs kernels.norm (each row alone, within fp32 rounding of the torch
        expression below); autograd, other dtypes and devices, and zero-centred weights stay in torch."""
        if self.zero_centred or x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return False
        # (without a compiled kernel rms_norm_rows is rms_norm_reference: this expression's fp32 bits)
        return not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))


class GatedMLP(nn.Module):
    """SiLU(gate_proj x) * up_proj x -> down_proj: dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
