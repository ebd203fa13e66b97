"""Quantized routed-expert weight formats, packed in the tiled layout the CPU kernel streams.

Shapes: E = experts, H = hidden, I = expert intermediate, G = group size along K (the input dim).
Formats (docs/kernels.md): ``fp32``, ``bf16``, ``bf16_a16`` (bf16 weights, bf16-rounded activations), ``int8``
(q in [-127, 127], w = q * s), ``int4`` (u in [0, 15], w = (u - 8) * s), ``int4_asym`` (w = u * s + m), ``int8_a8``
(int8's weights, int8 activations: W8A8, llama.cpp Q8_0's arithmetic). Scales and
mins are fp16, one per (output row, group of G along K). Quantization rounds against the stored fp16
scale, so ``dequantize`` is exactly what the kernel multiplies by.

Tiled layout (LAYOUT_VERSION): a projection [N, K] is padded to N8 * 8 rows and Kp columns (Kp = K
rounded up to G for quantized formats) and stored as [N8, Kp, R, 8] — for each tile of 8 output rows
and each k, R * 8 contiguous values. gate_up uses R = 2 (8 gate rows, then the matching 8 up rows),
down uses R = 1. int4 packs blocks of 8 k as one dword per row: [N8, Kp / 8, R, 8, 4] uint8, byte c
holding k0 + c (low nibble) and k0 + 4 + c (high nibble), the operand order of AVX2 maddubs. int8_a8
packs blocks of 4 k as one dword per row: [N8, Kp / 4, R, 8, 4] int8, byte c holding k0 + c (one
vpdpbusd multiplies 16 rows x 4 k).
Scales (and mins) are [N8, Kp / G, R, 8].

Activations (``Activation``): SiLU(gate) * up, or GPT-OSS's clamped SwiGLU (gate clamped above at
``limit``, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)). Optional per-expert biases
(``gate_up_bias`` [E, 2, I8*8]: gate then up, ``down_bias`` [E, H8*8], fp32, zero-padded) are added to
the projections' outputs, before the activation and before the router weight.

The ``a8`` formats (int4, int4_asym, int8_a8) quantize each projection's input per token and group of G to int8
(``quantize_activations``; the weights' groups, so a group's dot is one exact integer sum times s * s_x);
their torch reference (kernels/w4a8.py) replays the kernel's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from kernels.hugepages import to_hugepages
from kernels.silu import silu_f32

LAYOUT_VERSION = 2
PARTS = ("experts", "linear", "lm_head")  # what a format may store: routed experts, dense projections, lm_head


@dataclass(frozen=True)
class WeightFormat:
    """One packed weight format: `bits` per weight, `group_size` inputs per fp16 scale by default (0: no
    scales), its `family` (formats with the same packed weights), and the parts the engine offers it for
    (the kernel itself packs every format as experts or as a dense projection)."""

    bits: int
    group_size: int = 0
    family: str = ""
    parts: tuple[str, ...] = PARTS
    a8: bool = False  # activations quantized per token and group to int8 (W4A8 / W8A8)

    @property
    def quantized(self) -> bool:
        return self.group_size > 0


# The one registry of weight formats. Order is the kernel's format code (kernels/csrc): append only.
REGISTRY: dict[str, WeightFormat] = {
    "fp32": WeightFormat(32, parts=("experts", "linear")),
    "bf16": WeightFormat(16, family="bf16"),
    "int8": WeightFormat(8, 64),
    "int4": WeightFormat(4, 32, a8=True),
    "int4_asym": WeightFormat(4, 32, parts=("linear",), a8=True),
    "bf16_a16": WeightFormat(16, family="bf16"),  # bf16 weights, bf16-rounded activations (llama.cpp BF16's arithmetic)
    "int8_a8": WeightFormat(8, 32, a8=True),  # W8A8, groups of 32 as llama.cpp's Q8_0 blocks
}
FORMATS = tuple(REGISTRY)  # every format the kernel packs
FORMAT_CODE = {name: code for code, name in enumerate(FORMATS)}
DEFAULT_GROUP_SIZE = {name: f.group_size for name, f in REGISTRY.items()}


def formats_for(part: str) -> tuple[str, ...]:
    """The formats that may store `part` ("experts", "linear" or "lm_head"), in registry order."""
    if part not in PARTS:
        raise FormatError(f"unknown weight part {part!r}; choose one of {', '.join(PARTS)}")
    return tuple(name for name, f in REGISTRY.items() if part in f.parts)
_TENSOR_NAMES = ("gate_up", "gate_up_scales", "gate_up_mins", "down", "down_scales", "down_mins")
_BIAS_NAMES = ("gate_up_bias", "down_bias")
ACTIVATIONS = ("silu", "swiglu_clamped")


class FormatError(ValueError):
    """A weight format, group size or packed-tensor set that cannot be used."""


@dataclass(frozen=True)
class Activation:
    """The experts' gated activation: "silu" (SiLU(gate) * up) or "swiglu_clamped" (GPT-OSS: gate clamped
    above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate))."""

    kind: str = "silu"
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise FormatError(f"unknown expert activation {self.kind!r}; choose one of {', '.join(ACTIVATIONS)}")
        if self.kind == "swiglu_clamped" and not self.limit > 0:
            raise FormatError(f"swiglu_clamped needs a positive limit, got {self.limit}")

    @property
    def code(self) -> int:
        return ACTIVATIONS.index(self.kind)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [n, I] fp32 -> [n, I] fp32, as the kernel: SiLU in float32 (kernels/silu.py), the clamped
        SwiGLU's sigmoid in float64 rounded once."""
        if self.kind == "silu":
            return silu_f32(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        g = gate.double()
        return (up + 1.0) * (g / (1.0 + torch.exp(-self.alpha * g))).float()


SILU = Activation()


BF16_FORMATS = tuple(n for n, f in REGISTRY.items() if f.family == "bf16")  # the same packed weights


def round_activations(x: torch.Tensor, fmt: str, group_size: int = 0) -> torch.Tensor:
    """The activations x [T, K] a format's kernel multiplies by: bf16-rounded for bf16_a16, int8-quantized
    per token and group of `group_size` for the a8 formats (``quantize_activations``), else x (fp32)."""
    if REGISTRY[fmt].a8:
        return quantize_activations(x, group_size)
    return x.float().to(torch.bfloat16).float() if fmt == "bf16_a16" else x.float()


def is_quantized(fmt: str) -> bool:
    return REGISTRY[fmt].quantized


def check_format(fmt: str, group_size: int) -> int:
    """Validate (fmt, group_size); return the effective group size (0 for unquantized formats)."""
    if fmt not in FORMATS:
        raise FormatError(f"unknown expert weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not is_quantized(fmt):
        return 0
    step = 8 if REGISTRY[fmt].a8 else 2  # int4: blocks of 8 k; int8_a8: the activations' 8-wide quantizer
    if group_size <= 0 or group_size % step or group_size > 4096:
        raise FormatError(f"group_size must be a multiple of {step} in {step}..4096 for {fmt}, got {group_size}")
    return group_size


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _quantize(w: torch.Tensor, fmt: str, gs: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """w [..., N, Kp] fp32 -> (q [..., N, Kp] int16, scales fp16 [..., N, Kp/G] | None, mins | None)."""
    if fmt == "fp32":
        return w, None, None
    if fmt in BF16_FORMATS:
        return w.to(torch.bfloat16), None, None
    g = w.unflatten(-1, (-1, gs))  # [..., N, Kp/G, G]
    if fmt in ("int8", "int8_a8", "int4"):
        qmax = 7.0 if fmt == "int4" else 127.0
        scale = (g.abs().amax(-1) / qmax).to(torch.float16)  # [..., N, Kp/G]
        s = scale.float().unsqueeze(-1)
        q = torch.where(s > 0, g / torch.where(s > 0, s, 1.0), 0.0).round()
        q = q.clamp(-qmax - (fmt == "int4"), qmax)
        if fmt == "int4":
            q = q + 8
        return q.to(torch.int16).flatten(-2), scale, None
    lo, hi = g.amin(-1), g.amax(-1)
    mins = lo.to(torch.float16)
    scale = ((hi - mins.float()) / 15.0).to(torch.float16)
    s, m = scale.float().unsqueeze(-1), mins.float().unsqueeze(-1)
    q = torch.where(s > 0, (g - m) / torch.where(s > 0, s, 1.0), 0.0).round().clamp(0, 15)
    return q.to(torch.int16).flatten(-2), scale, mins


def quantize_activations(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Fake-quantize x [T, K] per token and group of G to int8 (symmetric, half-to-even) -> fp32 [T, K].

    Bit-for-bit the kernel's W4A8 input: s = amax / 127, q = round(x / s), returned as q * s.
    """
    t, k = x.shape
    kp = _round_up(k, group_size)
    g = _pad(x.float(), t, kp).unflatten(-1, (-1, group_size))  # [T, Kp/G, G]
    s = g.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
    return (q * s).flatten(-2)[:, :k]


def _tile(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """q [E, R, N8*8, Kp] -> [E, N8, Kp, R, 8] (int4: [E, N8, Kp/8, R, 8, 4] uint8; int8_a8: [E, N8, Kp/4, R,
    8, 4] int8)."""
    e, r, n, kp = q.shape
    if fmt == "int8_a8":
        t = q.to(torch.int8).reshape(e, r, n // 8, 8, kp // 4, 4).permute(0, 2, 4, 1, 3, 5)  # [E, N8, Kp/4, R, 8, 4]
        return t.contiguous()
    t = q.reshape(e, r, n // 8, 8, kp).permute(0, 2, 4, 1, 3)  # [E, N8, Kp, R, 8]
    if fmt == "int8":
        return t.to(torch.int8).contiguous()
    if fmt in ("int4", "int4_asym"):
        t = q.to(torch.uint8).reshape(e, r, n // 8, 8, kp // 8, 2, 4).permute(0, 2, 4, 1, 3, 5, 6)
        return (t[..., 0, :] | (t[..., 1, :] << 4)).contiguous()  # [E, N8, Kp/8, R, 8, 4]
    return t.contiguous()


def _untile(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Inverse of _tile for one expert: [N8, Kp(/8, /4), R, 8(, 4)] -> [R, N8*8, Kp] int/float."""
    if fmt == "int8_a8":
        t = t.permute(0, 1, 4, 2, 3).flatten(1, 2)  # [N8, Kp/4, 4, R, 8] -> [N8, Kp, R, 8]
    if fmt in ("int4", "int4_asym"):
        lo, hi = (t & 15).to(torch.int16), (t >> 4).to(torch.int16)  # [N8, Kp/8, R, 8, 4]
        t = torch.stack((lo, hi), dim=-2).permute(0, 1, 4, 5, 2, 3)  # [N8, Kp/8, 2, 4, R, 8]
        t = t.flatten(1, 3)  # [N8, Kp, R, 8]
    n8, kp, r, _ = t.shape
    return t.permute(2, 0, 3, 1).reshape(r, n8 * 8, kp)


def _tile_groups(s: torch.Tensor) -> torch.Tensor:
    """scales [E, R, N8*8, Kp/G] -> [E, N8, Kp/G, R, 8]."""
    e, r, n, ng = s.shape
    return s.reshape(e, r, n // 8, 8, ng).permute(0, 2, 4, 1, 3).contiguous()


def _pad(w: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Zero-pad the last two dims of w to (n, k)."""
    return torch.nn.functional.pad(w, (0, k - w.shape[-1], 0, n - w.shape[-2]))


@dataclass(frozen=True, eq=False)
class PackedExperts:
    """Routed experts of one MoE layer in a kernel layout; ``expert_ids`` are the global ids held."""

    fmt: str
    hidden: int
    intermediate: int
    group_size: int
    expert_ids: tuple[int, ...]
    tensors: dict[str, torch.Tensor] = field(repr=False)  # the packed projections, plus biases if any
    act: Activation = SILU

    def __post_init__(self) -> None:  # CPU weights the kernel streams: in huge pages (kernels/hugepages.py)
        to_hugepages(self.tensors)

    @property
    def num_experts(self) -> int:
        return len(self.expert_ids)

    @property
    def padded_hidden(self) -> int:
        return _round_up(self.hidden, self.group_size) if self.group_size else self.hidden

    @property
    def padded_intermediate(self) -> int:
        return _round_up(self.intermediate, self.group_size) if self.group_size else self.intermediate

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def expert_nbytes(self) -> int:
        """Bytes one expert's weights, scales and mins occupy (what one expert costs to stream)."""
        return self.nbytes // max(self.num_experts, 1)

    def local_index(self, global_id: int) -> int:
        return self.expert_ids.index(global_id)

    def expert_subset(self, global_ids: list[int] | tuple[int, ...]) -> PackedExperts:
        """A PackedExperts holding only ``global_ids`` (copies), e.g. to move hot experts elsewhere."""
        local = torch.tensor([self.local_index(g) for g in global_ids], dtype=torch.long)
        tensors = {k: (v.index_select(0, local) if v.numel() else v) for k, v in self.tensors.items()}
        return PackedExperts(self.fmt, self.hidden, self.intermediate, self.group_size, tuple(global_ids), tensors,
                             self.act)

    @property
    def has_bias(self) -> bool:
        return "gate_up_bias" in self.tensors

    def biases(self, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Local expert index -> (gate_up bias [2I] gate then up, down bias [H]) fp32, or None."""
        if not self.has_bias:
            return None
        gu = self.tensors["gate_up_bias"][expert][:, : self.intermediate].reshape(-1)  # [2I]
        return gu, self.tensors["down_bias"][expert][: self.hidden]

    def to(self, device: torch.device | str) -> PackedExperts:
        tensors = {k: v.to(device) for k, v in self.tensors.items()}
        return PackedExperts(self.fmt, self.hidden, self.intermediate, self.group_size, self.expert_ids, tensors,
                             self.act)

    def dequantize(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert index -> (w_gate_up [2I, H], w_down [H, I]) fp32, exactly as the kernel sees them."""
        gu = self._dequant_proj("gate_up", expert)[:, : self.intermediate, : self.hidden]  # [2, I, H]
        dn = self._dequant_proj("down", expert)[0, : self.hidden, : self.intermediate]  # [H, I]
        return gu.reshape(2 * self.intermediate, self.hidden).contiguous(), dn.contiguous()

    def _dequant_proj(self, name: str, e: int) -> torch.Tensor:
        q = _untile(self.tensors[name][e], self.fmt).float()  # [R, N8*8, Kp]
        if not is_quantized(self.fmt):
            return q
        gs = self.group_size
        s = _untile(self.tensors[name + "_scales"][e], "fp32").float().repeat_interleave(gs, -1)
        if self.fmt in ("int8", "int8_a8"):
            return q * s
        if self.fmt == "int4":
            return (q - 8) * s
        m = _untile(self.tensors[name + "_mins"][e], "fp32").float().repeat_interleave(gs, -1)
        return q * s + m

    def state_dict(self) -> dict[str, torch.Tensor]:
        meta = [LAYOUT_VERSION, FORMAT_CODE[self.fmt], self.hidden, self.intermediate, self.group_size]
        out = {k: v.contiguous() for k, v in self.tensors.items()}
        out["meta"] = torch.tensor(meta, dtype=torch.int64)
        out["expert_ids"] = torch.tensor(self.expert_ids, dtype=torch.int64)
        if self.act != SILU:
            out["act"] = torch.tensor([self.act.code, self.act.alpha, self.act.limit], dtype=torch.float64)
        return out

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor]) -> PackedExperts:
        missing = [k for k in ("meta", "expert_ids", *_TENSOR_NAMES) if k not in sd]
        if missing:
            raise FormatError(f"packed expert state is missing {missing}; repack the experts")
        version, code, hidden, inter, gs = (int(v) for v in sd["meta"].tolist())
        if version != LAYOUT_VERSION:
            raise FormatError(f"packed layout version {version} != {LAYOUT_VERSION}; repack the experts")
        tensors = {k: sd[k] for k in (*_TENSOR_NAMES, *_BIAS_NAMES) if k in sd}
        ids = tuple(int(i) for i in sd["expert_ids"].tolist())
        act = SILU
        if "act" in sd:
            kind, alpha, limit = sd["act"].tolist()
            act = Activation(ACTIVATIONS[int(kind)], alpha, limit)
        packed = cls(FORMATS[code], hidden, inter, gs, ids, tensors, act)
        packed.validate()
        return packed

    def validate(self) -> None:
        """Check tensor shapes and dtypes against the metadata; raise FormatError if they disagree."""
        e, r_i, r_h = self.num_experts, _round_up(self.intermediate, 8), _round_up(self.hidden, 8)
        for name, n, kp in (("gate_up", r_i, self.padded_hidden), ("down", r_h, self.padded_intermediate)):
            r = 2 if name == "gate_up" else 1
            expect = ((e, n // 8, kp // 8, r, 8, 4) if self.fmt.startswith("int4") else
                      (e, n // 8, kp // 4, r, 8, 4) if self.fmt == "int8_a8" else (e, n // 8, kp, r, 8))
            t = self.tensors[name]
            if tuple(t.shape) != expect or t.dtype != _WEIGHT_DTYPE[self.fmt]:
                raise FormatError(f"{name}: got {tuple(t.shape)} {t.dtype}, expected {expect} "
                                  f"{_WEIGHT_DTYPE[self.fmt]} for {self.fmt}; repack the experts")
            for suffix, used in (("_scales", is_quantized(self.fmt)), ("_mins", self.fmt == "int4_asym")):
                st = self.tensors[name + suffix]
                want = (e, n // 8, kp // self.group_size, r, 8) if used else (0,)
                if tuple(st.shape) != want:
                    raise FormatError(f"{name}{suffix}: got {tuple(st.shape)}, expected {want}; repack")
        if self.has_bias != ("down_bias" in self.tensors):
            raise FormatError("packed experts hold one of gate_up_bias / down_bias without the other; repack")
        if self.has_bias:
            for name, want in (("gate_up_bias", (e, 2, r_i)), ("down_bias", (e, r_h))):
                t = self.tensors[name]
                if tuple(t.shape) != want or t.dtype != torch.float32:
                    raise FormatError(f"{name}: got {tuple(t.shape)} {t.dtype}, expected {want} float32; repack")


_WEIGHT_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8,
                 "int4": torch.uint8, "int4_asym": torch.uint8, "bf16_a16": torch.bfloat16,
                 "int8_a8": torch.int8}


def _pack_proj(w: torch.Tensor, r: int, fmt: str, gs: int) -> dict[str, torch.Tensor]:
    """w [E, R*N, K] -> tiled weights (+ scales, mins) for R row sets of N rows each."""
    e, rn, k = w.shape
    n = rn // r
    kp = _round_up(k, gs) if gs else k
    w = _pad(w.float().reshape(e, r, n, k), _round_up(n, 8), kp)  # [E, R, N8*8, Kp]
    q, scales, mins = _quantize(w, fmt, gs)
    empty = torch.empty(0, dtype=torch.float16)
    return {"": _tile(q, fmt),
            "_scales": _tile_groups(scales) if scales is not None else empty,
            "_mins": _tile_groups(mins) if mins is not None else empty}


def _pack_biases(b_gate_up: torch.Tensor, b_down: torch.Tensor, e: int, i: int, h: int) -> dict[str, torch.Tensor]:
    """b_gate_up [E, 2I] (gate then up), b_down [E, H] -> zero-padded fp32 [E, 2, I8*8] and [E, H8*8]."""
    if tuple(b_gate_up.shape) != (e, 2 * i) or tuple(b_down.shape) != (e, h):
        raise FormatError(f"expected biases [E, 2I] = {(e, 2 * i)} and [E, H] = {(e, h)}; got "
                          f"{tuple(b_gate_up.shape)} and {tuple(b_down.shape)}")
    gu = torch.nn.functional.pad(b_gate_up.float().reshape(e, 2, i), (0, _round_up(i, 8) - i))
    return {"gate_up_bias": gu.contiguous(),
            "down_bias": torch.nn.functional.pad(b_down.float(), (0, _round_up(h, 8) - h)).contiguous()}


def pack_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, fmt: str, group_size: int | None = None,
                 progress: bool = True, expert_ids: tuple[int, ...] | None = None,
                 chunk: int = 8, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                 act: Activation = SILU) -> PackedExperts:
    """Pack w_gate_up [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and w_down [E, H, I] into ``fmt``;
    ``biases`` (gate_up [E, 2I], down [E, H]) and ``act`` go with them."""
    gs = check_format(fmt, DEFAULT_GROUP_SIZE.get(fmt, 0) if group_size is None else group_size)
    e, two_i, h = w_gate_up.shape
    if two_i % 2 or w_down.shape != (e, h, two_i // 2):
        raise FormatError(f"expected w_gate_up [E, 2I, H] and w_down [E, H, I]; got {tuple(w_gate_up.shape)} "
                          f"and {tuple(w_down.shape)}")
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in _TENSOR_NAMES}
    bar = tqdm(total=e, desc=f"pack experts {fmt}", unit="expert", disable=not progress, leave=False)
    for s in range(0, e, chunk):
        for proj, w, r in (("gate_up", w_gate_up[s:s + chunk], 2), ("down", w_down[s:s + chunk], 1)):
            for suffix, t in _pack_proj(w, r, fmt, gs).items():
                parts[proj + suffix].append(t)
        bar.update(min(chunk, e - s))
    bar.close()
    tensors = {k: (torch.cat(v) if v[0].numel() else v[0]) for k, v in parts.items()}
    if biases is not None:
        tensors.update(_pack_biases(*biases, e, two_i // 2, h))
    ids = tuple(range(e)) if expert_ids is None else tuple(expert_ids)
    if len(ids) != e:
        raise FormatError(f"expert_ids has {len(ids)} ids for {e} experts")
    return PackedExperts(fmt, h, two_i // 2, gs, ids, tensors, act)
