"""Row-wise RMSNorm through the compiled kernel (each row alone: its bits never depend on the other rows
of the call), with the plain-torch reference; the final norm of the execution path."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] -> [M, H] fp32: w * (x / sqrt(mean(x^2) + eps)), as engine.models.layers.RMSNorm in fp32."""
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] (CPU) -> [M, H] fp32 through the kernel (the reference if it is unavailable)."""
    from kernels.fused_moe import kernel_library

    lib = kernel_library()
    if lib is None or x.device.type != "cpu" or not hasattr(lib, "moegate_rms_norm"):
        return rms_norm_reference(x, weight, eps)
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [M, H] and weight [H]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    xf, wf = x.float().contiguous(), weight.detach().float().contiguous()
    out = torch.empty_like(xf)
    rc = lib.moegate_rms_norm(xf.data_ptr(), wf.data_ptr(), out.data_ptr(), xf.shape[0], xf.shape[1], float(eps))
    if rc != 0:
        raise RuntimeError(f"moegate_rms_norm failed with code {rc}")
    return out
