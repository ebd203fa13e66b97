"""ctypes binding of `moegate_decode_layer` (csrc/decode_layer.h): one whole decoder layer in one call."""

from __future__ import annotations

import ctypes

import torch

from kernels.fused_moe import kernel_library

_P = ctypes.c_void_p


class DecodeLayerParams(ctypes.Structure):
    """Mirror of struct DecodeLayerParams in kernels/csrc/decode_layer.h."""

    _fields_ = [(n, ctypes.c_int64) for n in ("H", "NH", "KV", "D", "E", "topk", "I", "norm_topk", "qk_norm",
                                              "window")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double),
        ("ln1", _P), ("ln2", _P), ("qn", _P), ("kn", _P),
        ("dense_fmt", ctypes.c_int64), ("dense_gs", ctypes.c_int64),
        ("qkv_w", _P), ("qkv_s", _P), ("qkv_m", _P), ("o_w", _P), ("o_s", _P), ("o_m", _P),
        ("router", _P), ("exp_fmt", ctypes.c_int64), ("exp_gs", ctypes.c_int64),
        ("gu_w", _P), ("gu_s", _P), ("gu_m", _P), ("dn_w", _P), ("dn_s", _P), ("dn_m", _P),
    ]


def decode_layer_library():
    """The compiled kernel library with `moegate_decode_layer` declared, or None (MOEGATE_DISABLE_CPP set,
    or no compiler): the caller stays on its torch modules."""
    lib = kernel_library()
    if lib is not None:
        lib.moegate_decode_layer.restype = ctypes.c_int
        lib.moegate_decode_layer.argtypes = [ctypes.POINTER(DecodeLayerParams), _P, ctypes.c_int64, _P, _P, _P,
                                             _P, _P, _P, _P, _P, _P, ctypes.c_int]
    return lib


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
