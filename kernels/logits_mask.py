"""Token bitmasks applied to logits by the compiled kernel (`moegate_apply_bitmask`, csrc/logits_mask.h)."""

from __future__ import annotations

import functools

import torch

from kernels.fused_moe import kernel_library


@functools.cache
def _library():
    """The compiled kernel library, looked up once (None: MOEGATE_DISABLE_CPP set, or no compiler)."""
    return kernel_library()


def apply_bitmask_kernel(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Set the logits whose bit is clear to -inf in place (bit j of word w allows id 32*w + j) with the compiled
    kernel. logits [B, V] fp32, bitmask [B, ceil(V/32)] int32, both on the CPU with contiguous rows. False, and
    nothing done, where the kernel does not take these tensors or is not available: the caller falls back."""
    if not (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1
            and bitmask.device.type == "cpu" and bitmask.dtype == torch.int32 and bitmask.stride(-1) == 1):
        return False
    lib = _library()
    if lib is None:
        return False
    batch, vocab = logits.shape
    lib.moegate_apply_bitmask(logits.data_ptr(), bitmask.data_ptr(), batch, vocab, logits.stride(0),
                              bitmask.stride(0))
    return True
