"""SiLU as the kernel computes it (kernels/csrc/activation.h), in plain torch float32, to the last bit.

silu(g) = g / (1 + exp(-g)) with exp as Cephes' expf: the argument clamped to [-87, 88], n = round(x log2 e)
(half to even), r = (x - n C1) - n C2 (ln 2 = C1 + C2 in two parts), a degree-6 polynomial in r, times 2^n built
from the exponent bits. Each step is one IEEE float32 operation, as in the kernel (no fma), so the bits agree on
every build. Accuracy: within a few float32 ulps of the float64 SiLU.
"""

from __future__ import annotations

import torch

LOG2E = 1.44269504088896341
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _f32(c: float) -> float:
    """c rounded to float32, as the kernel's float literal (so torch's scalar cast is exact)."""
    return torch.tensor(c, dtype=torch.float32).item()


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """e^x [any shape] float32, the kernel's v_exp step by step."""
    x = x.float().clamp(-87.0, 88.0)
    n = torch.round(x * _f32(LOG2E))
    r = (x - n * _f32(LN2_HI)) - n * _f32(LN2_LO)
    p = torch.full_like(r, _f32(POLY[0]))
    for c in POLY[1:]:
        p = p * r + _f32(c)
    p = (p * (r * r) + r) + 1.0
    pow2 = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^n, n in [-126, 127]
    return p * pow2


def silu_f32(g: torch.Tensor) -> torch.Tensor:
    """SiLU(g) [any shape] float32, bitwise the kernel's."""
    g = g.float()
    return g / (1.0 + exp_f32(-g))
