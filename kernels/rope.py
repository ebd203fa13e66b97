"""Rotate-half rotary embedding through the compiled kernel (tokens split over threads, each element's
arithmetic fixed), with the plain-torch reference it equals to the bit; the engine's `apply_rotary`."""

from __future__ import annotations

import torch

# Below this many elements one thread is faster than waking the pool.
_PARALLEL_ELEMENTS = 1 << 16


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] -> x * cos + rotate_half(x) * sin (any device, dtype, autograd)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _kernel_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        return False
    return (x.dim() == 3 and x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.shape[-1] % 2 == 0 and x.stride(-1) == 1 and cos.shape == sin.shape == (x.shape[0], x.shape[-1]))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] -> [T, heads, D]: fp32 inference on CPU runs the kernel (one call, no
    torch thread barrier per op; the same bits as `rotary_reference`), anything else the reference."""
    from kernels.fused_moe import kernel_library

    lib = kernel_library() if _kernel_takes(x, cos, sin) else None
    if lib is None or not hasattr(lib, "moegate_rope"):
        return rotary_reference(x, cos, sin)
    t, heads, d = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(t, heads, d)  # [T, heads, D]
    threads = torch.get_num_threads() if x.numel() >= _PARALLEL_ELEMENTS else 1
    rc = lib.moegate_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, heads, d, x.stride(0),
                          x.stride(1), threads)
    if rc != 0:
        raise RuntimeError(f"moegate_rope failed with code {rc}")
    return out
