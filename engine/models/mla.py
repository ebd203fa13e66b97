"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of compressed latents.

Per token the cache holds the normalised KV latent (kv_lora_rank) and the roped shared key
(qk_rope_head_dim): one [slots, 1, R + P] tensor per layer instead of K and V per head. Long query
chunks expand each sequence's latents through kv_b_proj into per-head K and V, as transformers does;
short ones (decode) absorb kv_b_proj into the query and the output instead and attend over the
latents directly, which costs q * (2R + P) per context token and head instead of R * (N + V).

Shapes: T = tokens, NH = heads, R = kv_lora_rank, P = qk_rope_head_dim, N = qk_nope_head_dim,
V = v_head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.models.layers import RMSNorm, RotaryEmbedding, apply_rotary

_LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """x [T, heads, P]; cos/sin [T, P] (cat(freqs, freqs)). DeepSeek rotates adjacent pairs (x0, x1), ...:
    V3 writes the rotated evens then odds ("interleaved_cat"), V2 keeps the pairs in place ("complex_pairs")."""
    if layout == "rotate_half":
        return apply_rotary(x, cos, sin)
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, P/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    even, odd = x1 * c - x2 * s, x2 * c + x1 * s
    if layout == "interleaved_cat":
        return torch.cat((even, odd), dim=-1)
    return torch.stack((even, odd), dim=-1).flatten(-2)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, nh, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
        self.qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, h, bias=bias)
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta)
        self.scale = self.qk_dim**-0.5
        self.fast_in = None  # PackedLinear of [q_a_proj or q_proj; kv_a_proj_with_mqa] rows, exploration only
        self.fast_o = None

    def set_fast_dense(self, fmt: str) -> None:
        """Quantized copies of the projections from the hidden state and of o_proj for exploration batches."""
        from kernels.linear import PackedLinear

        if self.cfg.attention_bias:
            raise ValueError("fast dense projections do not support attention biases; use fast_dense=None")
        q_in = self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj
        self.fast_in = PackedLinear.pack(torch.cat([q_in.weight, self.kv_a_proj_with_mqa.weight]).detach(), fmt)
        self.fast_o = PackedLinear.pack(self.o_proj.weight.detach(), fmt)

    def _rope(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.cfg.qk_rope_head_dim, self.cfg.rope_theta, dtype)
        if key not in batch.rope:
            batch.rope[key] = self.rotary(batch.positions, dtype)
        return batch.rope[key]

    def _project(self, x: torch.Tensor, fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (q [T, NH*(N+P)], compressed kv [T, R+P])."""
        cfg = self.cfg
        if fast:
            both = self.fast_in(x).to(x.dtype)
            split = cfg.num_heads * self.qk_dim if cfg.q_lora_rank is None else cfg.q_lora_rank
            q, ckv = both[:, :split], both[:, split:]
        else:
            q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_a_proj(x)
            ckv = self.kv_a_proj_with_mqa(x)
        if cfg.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q, ckv

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [T, H]; cache (latents [slots, 1, R+P],) written in place -> [T, H]."""
        cfg = self.cfg
        (latents,) = cache
        T, R = x.shape[0], cfg.kv_lora_rank
        fast = self.fast_in is not None and not batch.exact and x.device.type == "cpu"
        q, ckv = self._project(x, fast)
        q = q.view(T, cfg.num_heads, self.qk_dim)
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        cos, sin = self._rope(batch, q.dtype)
        q = torch.cat((q_nope, rotate(q_rot, cos, sin, cfg.rope_layout)), dim=-1)  # [T, NH, N+P]
        kv_latent = self.kv_a_layernorm(ckv[:, :R])  # [T, R]
        k_rot = rotate(ckv[:, None, R:], cos, sin, cfg.rope_layout)  # [T, 1, P]
        latents.index_copy_(0, batch.slot_mapping, torch.cat((kv_latent[:, None], k_rot), -1).to(latents.dtype))

        out = q.new_empty(T, cfg.num_heads, cfg.v_head_dim)
        for start, q_len, slots in zip(batch.query_starts, batch.query_lens, batch.context_slots, strict=True):
            lat = latents.index_select(0, slots)[:, 0].to(q.dtype)  # [ctx, R+P]
            qs = q[start : start + q_len].transpose(0, 1)  # [NH, q, N+P]
            absorb = q_len * (2 * R + cfg.qk_rope_head_dim) < R * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            out[start : start + q_len] = (self._attend_absorbed(qs, lat) if absorb
                                          else self._attend(qs, *self._expand(lat))).transpose(0, 1)
        if fast:
            return self.fast_o(out.reshape(T, -1)).to(x.dtype)
        return self.o_proj(out.reshape(T, -1))

    def _expand(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """lat [ctx, R+P] -> per-head keys [NH, ctx, N+P] and values [NH, ctx, V]."""
        cfg = self.cfg
        ctx = lat.shape[0]
        kv = self.kv_b_proj(lat[:, : cfg.kv_lora_rank]).view(ctx, cfg.num_heads, -1)  # [ctx, NH, N+V]
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_rot = lat[:, None, cfg.kv_lora_rank :].expand(ctx, cfg.num_heads, cfg.qk_rope_head_dim)
        return torch.cat((k_nope, k_rot), dim=-1).transpose(0, 1), v.transpose(0, 1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [NH, q, N+P], k [NH, ctx, N+P], v [NH, ctx, V] -> [NH, q, V]; causal, softmax in fp32."""
        return torch.bmm(self._probs(torch.bmm(q, k.transpose(1, 2))), v)

    def _attend_absorbed(self, q: torch.Tensor, lat: torch.Tensor) -> torch.Tensor:
        """q [NH, q, N+P], lat [ctx, R+P] -> [NH, q, V]: the same attention with kv_b_proj folded into the
        query (its K rows) and the output (its V rows), so no per-head K or V is built."""
        cfg = self.cfg
        n, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        w = self.kv_b_proj.weight.view(cfg.num_heads, n + cfg.v_head_dim, r).to(q.dtype)  # [NH, N+V, R]
        q_lat = torch.bmm(q[..., :n], w[:, :n])  # [NH, q, R]
        scores = torch.matmul(q_lat, lat[:, :r].T) + torch.matmul(q[..., n:], lat[:, r:].T)  # [NH, q, ctx]
        out_lat = torch.matmul(self._probs(scores), lat[:, :r])  # [NH, q, R]
        return torch.bmm(out_lat, w[:, n:].transpose(1, 2))  # [NH, q, V]

    def _probs(self, scores: torch.Tensor) -> torch.Tensor:
        """Unscaled scores [NH, q, ctx] of the chunk's last q positions -> causal softmax (fp32) in their dtype."""
        q_len, ctx = scores.shape[1:]
        scores = scores * self.scale
        if q_len > 1:
            q_pos = torch.arange(ctx - q_len, ctx, device=scores.device)[:, None]
            scores = scores.masked_fill(torch.arange(ctx, device=scores.device)[None, :] > q_pos, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
