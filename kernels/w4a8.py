"""Plain-torch reference of the int4 (W4A8) and int8_a8 (W8A8) kernel arithmetic, step by step, to the last bit.

n = rows (token, slot pairs of one expert), N = output rows, Kp = padded K, G = groups along K.
Per row and group: q = round_half_even(x / sx) with sx = amax / 127 (int8 activations), the integer
sum u . q (exact), then fp32 fused multiply-adds in group order: int4 (u = q_w + 8)
acc = fma(s * sx, sum(u q) - 8 sum(q), acc) (the difference is an integer, exact in fp32); int4_asym
acc = fma(s * sx, sum(u q), acc); acc = fma(m * sx, sum(q), acc) with m the group min; int8_a8 (signed
weights w) acc = fma(s * sx, sum(w q), acc).
An fp32 fma is emulated in float64 (the product is exact there; one rounding to float64, one to
float32 — a double rounding that differs from a true fma with probability ~2^-29 per operation).
The activation is the kernel's (SiLU in float32, kernels/silu.py; the clamped SwiGLU's sigmoid in float64, rounded
once); biases are single fp32 adds.
"""

from __future__ import annotations

import torch

from kernels.formats import PackedExperts, _untile


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add a * b + c with a single rounding (float64 emulation)."""
    return (a.double() * b.double() + c.double()).float()


def quantize_parts(x: torch.Tensor, gs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, Kp] fp32 -> (q [n, G, gs] integer-valued float64, sx [n, G] fp32, sum(q) [n, G] fp32)."""
    g = x.float().unflatten(-1, (-1, gs))  # [n, G, gs]
    sx = g.abs().amax(-1) / 127.0  # [n, G]
    s = sx.unsqueeze(-1)
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
    return q.double(), sx, q.sum(-1)


def w4a8_project(x: torch.Tensor, packed: PackedExperts, name: str, e: int) -> torch.Tensor:
    """x [n, Kp] fp32 -> [n, R * N8 * 8] fp32: projection ``name`` of local expert e, as the kernel."""
    t = packed.tensors
    mins = t[name + "_mins"][e] if packed.fmt == "int4_asym" else None
    return w4a8_tiles(x, t[name][e], t[name + "_scales"][e], mins, packed.fmt, packed.group_size)


def w4a8_tiles(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, fmt: str,
               gs: int) -> torch.Tensor:
    """x [n, Kp] fp32 times one tiled int4 / int8_a8 projection (tiles [N8, Kp/8 (Kp/4), R, 8, 4], scales / mins
    [N8, Kp/G, R, 8]) -> [n, R * N8 * 8] fp32, the kernel's arithmetic step by step."""
    u = _untile(tiles, fmt).double()  # [R, N8*8, Kp]
    s = _untile(scales, "fp32").float()  # [R, N8*8, G]
    b = _untile(mins, "fp32").float() if fmt == "int4_asym" else None
    u, s = u.flatten(0, 1), s.flatten(0, 1)  # [N', Kp], [N', G]
    q, sx, qs = quantize_parts(x, gs)  # [n, G, gs], [n, G], [n, G]
    isum = torch.einsum("tgk,ngk->tgn", q, u.unflatten(-1, (-1, gs))).float()  # [n, G, N'] exact
    acc = torch.zeros(x.shape[0], u.shape[0])  # [n, N']
    if b is None:  # int4: one fma per group on sum(u q) - 8 sum(q) (integers, exact in fp32); int8_a8: sum(w q)
        off = 8.0 if fmt == "int4" else 0.0
        for g in range(s.shape[1]):
            acc = fma32(s[None, :, g] * sx[:, g, None], isum[:, g] - off * qs[:, g, None], acc)
        return acc
    b = b.flatten(0, 1)
    for g in range(s.shape[1]):
        acc = fma32(s[None, :, g] * sx[:, g, None], isum[:, g], acc)
        acc = fma32(b[None, :, g] * sx[:, g, None], qs[:, g, None].expand_as(acc), acc)
    return acc


def w4a8_moe(x: torch.Tensor, local: torch.Tensor, w: torch.Tensor, packed: PackedExperts) -> torch.Tensor:
    """x [T, H] fp32, local expert indices [T, k] (-1 skip), w [T, k] -> [T, H] fp32, bitwise as the kernel."""
    t, k = local.shape
    h, inter = packed.hidden, packed.intermediate
    i8, h8 = -(-inter // 8) * 8, -(-h // 8) * 8
    xp = torch.nn.functional.pad(x.float(), (0, packed.padded_hidden - h))  # [T, Hp]
    hbuf = max(packed.padded_intermediate, i8)
    y = torch.zeros(t, k, h8)  # [T, k, H8*8]
    for e in torch.unique(local[local >= 0]).tolist():
        tok, slot = (local == e).nonzero(as_tuple=True)
        gu = w4a8_project(xp[tok], packed, "gate_up", e)  # [n, 2 * I8*8]
        if packed.has_bias:
            gu = gu + packed.tensors["gate_up_bias"][e].reshape(-1)  # [2 * I8*8], zero-padded
        act = packed.act(gu[:, :i8], gu[:, i8:])  # [n, I8*8]
        act = torch.nn.functional.pad(act, (0, hbuf - i8))[:, : packed.padded_intermediate]  # [n, Ip]
        y[tok, slot] = w4a8_project(act, packed, "down", e)
        if packed.has_bias:
            y[tok, slot] += packed.tensors["down_bias"][e]  # [H8*8]
    out = torch.zeros(t, h8)
    for s in range(k):
        valid = local[:, s] >= 0
        out[valid] = fma32(w[valid, s, None].float(), y[valid, s], out[valid])
    return out[:, :h]
