"""Rotary position embedding and its `rope_scaling` variants (linear, dynamic NTK, YaRN, llama3, longrope).

The inverse frequencies and the attention factor follow transformers' `modeling_rope_utils` (the
reference the tests compare with); the engine computes them itself so the forward needs no
transformers. Two variants depend on the sequence length: dynamic NTK stretches the base once a
sequence passes `max_position_embeddings`, longrope switches to its long factors past
`original_max_position_embeddings`. transformers decides both from the longest position of the
forward; here each sequence decides from its own length, which is the same for one sequence and
keeps a sequence's numbers independent of what it is batched with. A prompt prefilled in several
chunks sees the length reached by each chunk (transformers, in one forward, sees the whole prompt),
so past the switch point dynamic NTK and longrope match transformers only for prompts prefilled whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.errors import CheckpointError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """config.json's rope_scaling / rope_parameters, normalised (only the fields its type uses matter)."""

    rope_type: str
    max_position_embeddings: int
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise CheckpointError(f"rope type {self.rope_type!r} is not supported (one of {', '.join(ROPE_TYPES)})")
        if self.rope_type in ("yarn", "longrope", "llama3") and not self.original_max_position_embeddings:
            raise CheckpointError(f"rope type {self.rope_type!r} needs original_max_position_embeddings")

    @property
    def per_sequence(self) -> bool:
        """Whether the frequencies depend on the sequence's length."""
        return self.rope_type in ("dynamic", "longrope")

    def context_length(self) -> int:
        """Tokens the scaled model serves (as vLLM derives it): linear and dynamic stretch
        max_position_embeddings by the factor, YaRN the original context; llama3 and longrope configs
        already state the extended length."""
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return max(self.max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeScaling | None:
        """None for plain RoPE; raises CheckpointError for a type or field the engine does not implement."""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type == "su":  # the older name of longrope
            rope_type = "longrope"
        max_pos = hf.get("max_position_embeddings", 4096)
        original = rope.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        factor = rope.get("factor")
        if factor is None and original and rope_type in ("yarn", "longrope"):
            factor = max_pos / original  # transformers' default for these two
        opt = {k: rope[k] for k in ("attention_factor", "mscale", "mscale_all_dim", "low_freq_factor",
                                    "high_freq_factor") if rope.get(k) is not None}
        opt.update({k: float(rope[k]) for k in ("beta_fast", "beta_slow") if rope.get(k)})
        return cls(
            rope_type=rope_type, max_position_embeddings=max_pos, factor=float(factor if factor is not None else 1.0),
            original_max_position_embeddings=original, truncate=bool(hf.get("truncate", rope.get("truncate", True))),
            short_factor=tuple(rope.get("short_factor") or ()), long_factor=tuple(rope.get("long_factor") or ()),
            **opt,
        )


def _base_exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [D/2]


def inv_freq(dim: int, theta: float, scaling: RopeScaling | None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """-> (inverse frequencies [dim/2] fp32, attention factor applied to cos and sin)."""
    plain = 1.0 / (theta ** _base_exponents(dim))
    if scaling is None:
        return plain, 1.0
    s, kind = scaling, scaling.rope_type
    if kind == "linear":
        return plain / s.factor, 1.0
    if kind == "dynamic":
        if not seq_len or seq_len <= s.max_position_embeddings:
            return plain, 1.0
        grown = torch.tensor(seq_len, dtype=torch.float32)  # fp32 as transformers computes it from position ids
        base = theta * ((s.factor * grown / s.max_position_embeddings) - (s.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** _base_exponents(dim)), 1.0
    if kind == "llama3":
        return _llama3(plain, s), 1.0
    if kind == "longrope":
        return _longrope(dim, theta, s, seq_len)
    return _yarn(dim, theta, s)


def _mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude scale for a context stretched by `scale`."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def softmax_mscale(s: RopeScaling | None) -> float:
    """The factor DeepSeek's latent attention multiplies its softmax scale by under YaRN (mscale_all_dim squared;
    1 without scaling): its rope tables carry mscale/mscale_all_dim, the scores the rest."""
    if s is None or not s.mscale_all_dim:
        return 1.0
    return _mscale(s.factor, s.mscale_all_dim) ** 2


def _yarn(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    mscale = _mscale
    attention = s.attention_factor
    if attention is None:
        attention = (mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else mscale(s.factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # share of the original frequency per dimension
    freqs = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return freqs, float(attention)


def _llama3(plain: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / plain
    scaled = torch.where(wavelen > low_wavelen, plain / s.factor, plain)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope(dim: int, theta: float, s: RopeScaling, seq_len: int | None) -> tuple[torch.Tensor, float]:
    original = s.original_max_position_embeddings
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if s.factor <= 1.0 else math.sqrt(1 + math.log(s.factor) / math.log(original))
    factors = s.long_factor if seq_len and seq_len > original else s.short_factor
    if len(factors) != dim // 2:
        raise CheckpointError(f"longrope needs {dim // 2} short/long factors (head_dim / 2), got {len(factors)}")
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** _base_exponents(dim)), float(attention)


class RotaryEmbedding(nn.Module):
    """RoPE tables (cos, sin) [T, D] in the rotate-half layout Hugging Face uses, scaled as configured.

    On the CPU, where the frequencies do not depend on the sequence, rows come from a table of every position
    so far (grown by doubling), computed by the same expression: a decode step indexes two rows instead of
    running a dozen small ops. Each element is the same elementwise arithmetic either way, so the bits are
    those of the direct expression (tests/engine/test_engine_rope.py checks it)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self._freqs: dict[tuple[torch.device, bool | None], tuple[torch.Tensor, float]] = {}
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # dtype -> cos, sin [P, D]

    def _inv_freq(self, device: torch.device, seq_len: int | None) -> tuple[torch.Tensor, float]:
        s, variant = self.scaling, None  # the frequencies differ per length only past the switch point
        if s is not None and s.rope_type == "longrope":
            variant = bool(seq_len and seq_len > s.original_max_position_embeddings)
        elif s is not None and s.rope_type == "dynamic" and seq_len and seq_len > s.max_position_embeddings:
            freqs, attention = inv_freq(self.head_dim, self.theta, s, seq_len)  # one per length: not cached
            return freqs.to(device), attention
        if (device, variant) not in self._freqs:
            freqs, attention = inv_freq(self.head_dim, self.theta, s, seq_len)
            self._freqs[(device, variant)] = (freqs.to(device), attention)
        return self._freqs[(device, variant)]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                seq_lens: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; seq_lens: (new tokens, sequence length) per sequence, needed by per-sequence scaling."""
        if self.scaling is None or not self.scaling.per_sequence or seq_lens is None:
            if positions.device.type == "cpu":
                needed = max(total for _, total in seq_lens) if seq_lens else int(positions.max()) + 1
                cos, sin = self._table(needed, dtype)
                return cos.index_select(0, positions), sin.index_select(0, positions)
            return self._direct(positions, self._inv_freq(positions.device, None), dtype)
        chunks = positions.split([n for n, _ in seq_lens])
        parts = [self._direct(p, self._inv_freq(positions.device, total), dtype)
                 for p, (_, total) in zip(chunks, seq_lens, strict=True)]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    def _table(self, needed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, D] of positions 0..P-1 with P >= needed (CPU, sequence-independent frequencies)."""
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < needed:
            size = max(needed, 256, 2 * table[0].shape[0] if table is not None else 0)
            device = torch.device("cpu")
            table = self._direct(torch.arange(size), self._inv_freq(device, None), dtype)
            self._tables[dtype] = table
        return table

    @staticmethod
    def _direct(pos: torch.Tensor, freqs_attention: tuple[torch.Tensor, float],
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [t, D] of positions pos [t] computed from the frequencies."""
        freqs, attention = freqs_attention
        emb = (pos.float()[:, None] * freqs[None, :]).repeat(1, 2)  # [t, D]
        return (emb.cos() * attention).to(dtype), (emb.sin() * attention).to(dtype)
