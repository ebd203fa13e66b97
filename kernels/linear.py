"""Quantized dense projections (attention q/k/v/o, lm_head) in the experts' tiled layout, run by the
compiled kernel's ``moegate_linear`` for small batches, with a plain-torch reference.

A ``PackedLinear`` holds W [N, K] as one down-style projection (R = 1) of kernels/formats.py:
int8 (per row and group of G scales, fp32 activations), int4 / int4_asym / int8_a8 (W4A8 / W8A8: activations
quantized per token and group to int8, exact integer dot products), bf16 or fp32. ``exact_format`` picks the
lossless one for a weight (bf16 when every value is a bf16 number, as in a bf16 checkpoint loaded in
fp32: the same products from half the bytes), which the execution path uses for its dense layers. The kernel's result for a row does
not depend on the other rows of the call or the thread count; the reference is the dequantized
matmul (int8, bf16: |kernel - reference| <= 1e-4 * max|ref| + 1e-5, only the fp32 summation order
differs) or the W4A8 / W8A8 arithmetic replayed step by step (int4, int8_a8: equal but for ~2^-29-rare double
roundings).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from kernels.formats import (
    DEFAULT_GROUP_SIZE,
    FORMAT_CODE,
    REGISTRY,
    _pack_proj,
    _untile,
    check_format,
    formats_for,
    is_quantized,
    round_activations,
)
from kernels.hugepages import to_hugepages
from kernels.w4a8 import w4a8_tiles

LINEAR_FORMATS = formats_for("linear")


def exact_format(weight: torch.Tensor) -> str:
    """The lossless packed format of ``weight``: bf16 if bf16 holds every value exactly, else fp32."""
    w = weight.detach()
    if w.dtype == torch.bfloat16:
        return "bf16"
    return "bf16" if torch.equal(w.float().to(torch.bfloat16).float(), w.float()) else "fp32"


@dataclass(frozen=True, eq=False)
class PackedLinear:
    """W [N, K] (out_features x in_features) packed for the CPU kernel."""

    fmt: str
    out_features: int
    in_features: int
    group_size: int
    tensors: dict[str, torch.Tensor] = field(repr=False)  # weight [N8, Kp(/8), 1, 8(, 4)], scales, mins

    def __post_init__(self) -> None:  # CPU weights the kernel streams: in huge pages (kernels/hugepages.py)
        to_hugepages(self.tensors)

    @classmethod
    def pack(cls, weight: torch.Tensor, fmt: str, group_size: int | None = None) -> PackedLinear:
        if fmt not in LINEAR_FORMATS:
            raise ValueError(f"dense projection format must be one of {', '.join(LINEAR_FORMATS)}, got {fmt!r}")
        gs = check_format(fmt, DEFAULT_GROUP_SIZE[fmt] if group_size is None else group_size)
        n, k = weight.shape
        parts = _pack_proj(weight.detach().float().cpu()[None], 1, fmt, gs)  # [1, N8, ...]
        tensors = {"weight": parts[""][0], "scales": parts["_scales"], "mins": parts["_mins"]}
        tensors = {name: (t[0] if name != "weight" and t.numel() else t) for name, t in tensors.items()}
        return cls(fmt, n, k, gs, tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def padded_out(self) -> int:
        return (self.out_features + 7) // 8 * 8

    def dequantize(self) -> torch.Tensor:
        """W as the kernel multiplies by: [N, K] fp32."""
        q = _untile(self.tensors["weight"], self.fmt).float()[0]  # [N8*8, Kp]
        if is_quantized(self.fmt):
            s = _untile(self.tensors["scales"], "fp32").float()[0].repeat_interleave(self.group_size, -1)
            if self.fmt in ("int8", "int8_a8"):
                q = q * s
            elif self.fmt == "int4":
                q = (q - 8) * s
            else:
                q = q * s + _untile(self.tensors["mins"], "fp32").float()[0].repeat_interleave(self.group_size, -1)
        return q[: self.out_features, : self.in_features].contiguous()

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch: x [M, K] -> [M, N] fp32."""
        x = x.float().cpu()
        if REGISTRY[self.fmt].a8:  # W4A8 / W8A8: the kernel's arithmetic step by step (kernels/w4a8.py)
            kp = -(-self.in_features // self.group_size) * self.group_size
            xp = torch.nn.functional.pad(x, (0, kp - self.in_features))
            mins = self.tensors["mins"] if self.fmt == "int4_asym" else None
            out = w4a8_tiles(xp, self.tensors["weight"], self.tensors["scales"], mins, self.fmt, self.group_size)
            return out[:, : self.out_features]
        return round_activations(x, self.fmt) @ self.dequantize().T

    def kernel_args(self, num_threads: int) -> tuple:
        """`moegate_linear`'s arguments after (x, out, M) as ctypes values: N, K, format, group size, the weight,
        scales and mins pointers, threads (kernels/bindings.py `LinearCall` keeps them between calls)."""
        weight, scales, mins = (ctypes.c_void_p(t.data_ptr() if t.numel() else None)
                                for t in (self.tensors[n] for n in ("weight", "scales", "mins")))
        sizes = (self.out_features, self.in_features, FORMAT_CODE[self.fmt], self.group_size)
        return (*map(ctypes.c_int64, sizes), weight, scales, mins, ctypes.c_int(num_threads))

    def __call__(self, x: torch.Tensor, num_threads: int | None = None, variant: str | None = None) -> torch.Tensor:
        """x [M, K] (CPU, any float dtype) -> [M, N] fp32 through the compiled kernel (the reference if
        it is unavailable)."""
        from kernels.fused_moe import kernel_library

        lib = kernel_library(variant)
        if lib is None or x.device.type != "cpu":
            return self.reference(x)
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be [M, {self.in_features}], got {tuple(x.shape)}")
        xf = x.float().contiguous()
        m = xf.shape[0]
        out = torch.empty(m, self.padded_out, dtype=torch.float32)  # [M, N8*8]
        threads = num_threads or torch.get_num_threads()
        rc = lib.moegate_linear(xf.data_ptr(), out.data_ptr(), m, *self.kernel_args(threads))
        if rc != 0:
            raise RuntimeError(f"moegate_linear failed with code {rc} for format {self.fmt}")
        return out if self.padded_out == self.out_features else out[:, : self.out_features]
