"""Typed calls into the compiled kernel library for code outside kernels/ (kernels/build.py declares every
entry point): the logits mask of constrained decoding (`moegate_apply_bitmask`, csrc/logits_mask.h), the
one-call decoder layer (`moegate_decode_layer`, csrc/decode_layer.h) and the whole stack of them in one call
(`moegate_decode_stack`)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.build import DecodeLayerParams as DecodeLayerParams
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


def decode_layer_library():
    """The compiled kernel library for `run_decode_layer`, or None (MOEGATE_DISABLE_CPP set, or no compiler):
    the caller stays on its torch modules. Looked up at each build, so MOEGATE_DISABLE_CPP set later counts."""
    return kernel_library()


def run_decode_layer(lib, params: DecodeLayerParams, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     slots: torch.Tensor, start: torch.Tensor, length: torch.Tensor, ids: torch.Tensor,
                     num_threads: int) -> None:
    """x [T, H] fp32 contiguous, updated in place; writes the tokens' K/V at `slot_mapping` [T] and each
    token's top-k expert ids to `ids` [T, K] int64. Token i attends to slots[start[i] : start[i] + length[i]]."""
    rc = lib.moegate_decode_layer(
        ctypes.byref(params), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), slots.data_ptr(), start.data_ptr(), length.data_ptr(),
        ids.data_ptr(), ctypes.c_int(num_threads))
    if rc != 0:
        raise RuntimeError(f"moegate_decode_layer failed with code {rc}")


def run_decode_stack(lib, layers: ctypes.Array, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_caches: ctypes.Array, v_caches: ctypes.Array, slot_mapping: torch.Tensor, slots: torch.Tensor,
                     start: torch.Tensor, length: torch.Tensor, ids: torch.Tensor, counts: ctypes.Array,
                     num_threads: int, norm: tuple[torch.Tensor, float, torch.Tensor] | None = None) -> None:
    """`run_decode_layer` for every layer in order, in one call: layers (DecodeLayerParams * L), layer l's
    KV caches at k_caches[l] / v_caches[l] (c_void_p * L); counts[l] (c_void_p * L, None for none): layer
    l's routing counts [E] int64, each top-k expert id of its tokens added once. ids [>= T, K] int64: scratch.
    norm (weight [H] fp32, eps, out [T, H] fp32): the final RMSNorm of each row of x into out, as
    `kernels.norm.rms_norm_rows`; None: x is left un-normed."""
    if ids.dtype != torch.int64 or not ids.is_contiguous() or ids.shape[0] < x.shape[0]:
        raise ValueError(f"ids must be contiguous int64 with >= {x.shape[0]} rows, got {ids.dtype} {tuple(ids.shape)}")
    weight, eps, out = norm if norm is not None else (None, 0.0, None)
    if norm is not None and not (weight.dtype == out.dtype == torch.float32 and weight.is_contiguous()
                                 and out.is_contiguous() and weight.shape == x.shape[1:] and out.shape == x.shape):
        raise ValueError("norm: weight [H] and out [T, H] must be contiguous fp32")
    rc = lib.moegate_decode_stack(
        layers, len(layers), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), k_caches, v_caches,
        slot_mapping.data_ptr(), slots.data_ptr(), start.data_ptr(), length.data_ptr(), ids.data_ptr(), counts,
        None if weight is None else weight.data_ptr(), float(eps), None if out is None else out.data_ptr(),
        ctypes.c_int(num_threads))
    if rc != 0:
        raise RuntimeError(f"moegate_decode_stack failed with code {rc}")
