"""Row-wise RMSNorm through the compiled kernel (each row alone: its bits never depend on the other rows
of the call), with the plain-torch reference; the final norm of the execution path, the residual add fused
with the norm of its sum, and the per-head q/k norm over strided head rows."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] -> [M, H] fp32: w * (x / sqrt(mean(x^2) + eps)), as engine.models.layers.RMSNorm in fp32."""
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _lib():
    from kernels.fused_moe import kernel_library

    return kernel_library()


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] (CPU) -> [M, H] fp32 through the kernel (the reference if it is unavailable)."""
    lib = _lib()
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


def add_rms_norm_reference(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, y [M, H] -> (x + y, its `rms_norm_reference`, or None without a weight)."""
    s = x + y
    return s, None if weight is None else rms_norm_reference(s, weight, eps)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None, eps: float = 0.0,
                 num_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x, y [M, H] fp32 (CPU) -> (x + y, rms_norm_rows of it; None without a weight) in one kernel call: the sum
    is torch's to the bit and the norm `rms_norm_rows`'s. Other dtypes, devices or shapes take the reference."""
    lib = _lib()
    if (lib is None or not hasattr(lib, "moegate_add_rms_norm") or x.device.type != "cpu" or x.dim() != 2
            or x.shape != y.shape or x.dtype != torch.float32 or y.dtype != torch.float32
            or (weight is not None and weight.shape != (x.shape[1],))):
        return add_rms_norm_reference(x, y, weight, eps)
    x, y = x.contiguous(), y.contiguous()
    s = torch.empty_like(x)  # [M, H]
    out = None if weight is None else torch.empty_like(x)
    w = None if weight is None else weight.detach().float().contiguous()
    rc = lib.moegate_add_rms_norm(x.data_ptr(), y.data_ptr(), s.data_ptr(), None if w is None else w.data_ptr(),
                                  None if out is None else out.data_ptr(), x.shape[0], x.shape[1], float(eps),
                                  num_threads or torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"moegate_add_rms_norm failed with code {rc}")
    return s, out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, num_threads: int | None = None) -> torch.Tensor:
    """x [T, heads, D] fp32 on the CPU, any strides with unit stride along D (a view of a fused projection's
    output) -> [T, heads, D] contiguous: `rms_norm_rows` of every head row, read in place (no copy first)."""
    lib = _lib()
    t, heads, d = x.shape
    if lib is None or not hasattr(lib, "moegate_rms_norm_heads") or x.stride(-1) != 1:
        return rms_norm_rows(x.reshape(-1, d), weight, eps).view(t, heads, d)
    if weight.shape != (d,) or x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 [T, heads, D] on the CPU and weight [D]; got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device} and {tuple(weight.shape)}")
    w = weight.detach().float().contiguous()
    out = torch.empty(t, heads, d)  # [T, heads, D]
    rc = lib.moegate_rms_norm_heads(x.data_ptr(), x.stride(0), x.stride(1), w.data_ptr(), out.data_ptr(), t, heads, d,
                                    float(eps), num_threads or torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"moegate_rms_norm_heads failed with code {rc}")
    return out
