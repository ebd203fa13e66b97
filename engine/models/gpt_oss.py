"""GPT-OSS attention: grouped-query attention with a learned sink logit per head and YaRN RoPE.

The sink joins each query's softmax as one more logit with no value (it only takes probability mass away
from the keys); sliding / full layers come from `ModelConfig.layer_types` (engine/models/attention.py). The
rest of GPT-OSS (router with a bias and a softmax over the top-k logits, biased experts with the clamped
SwiGLU) is engine/models/moe.py and the kernel's activation variant (kernels/formats.py `Activation`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.forward_batch import ForwardBatch
from engine.models.attention import Attention


def yarn_inv_freq(head_dim: int, theta: float, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): per-frequency blend of interpolated (divided by
    `factor`) and original inverse frequencies over a linear ramp between the beta_fast / beta_slow
    correction dims, and the attention factor that scales cos and sin. -> (inv_freq [D/2] fp32, factor)."""
    factor, orig = params.get("factor"), params.get("original_max_position_embeddings")
    if factor is None or orig is None:
        raise CheckpointError("yarn rope_parameters need factor and original_max_position_embeddings")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all
                            else get_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)  # [D/2]
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class SinkAttention(Attention):
    """GQA with per-head sinks (`self_attn.sinks` [NH]), biased q/k/v/o and default or YaRN RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        scaling = dict(cfg.rope_scaling)
        if scaling and scaling["rope_type"] != "yarn":
            raise CheckpointError(f"rope type {scaling['rope_type']!r} is not supported for {cfg.arch}")
        # computed on the CPU here (not a buffer: the model is built on the meta device), moved per forward
        self.rope_inv_freq, self.attention_factor = (
            yarn_inv_freq(cfg.head_dim, cfg.rope_theta, scaling) if scaling
            else (1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device="cpu")
                                           / cfg.head_dim), 1.0))

    def _rope(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("gpt_oss", self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling, dtype)
        if key not in batch.rope:
            freqs = batch.positions.float()[:, None] * self.rope_inv_freq.to(batch.positions.device)[None, :]  # [T, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
            batch.rope[key] = ((emb.cos() * self.attention_factor).to(dtype),
                               (emb.sin() * self.attention_factor).to(dtype))
        return batch.rope[key]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [NH, q, D], k/v [KV, ctx, D] -> [NH, q, D]: softmax over the keys and the head's sink, in fp32."""
        nh, q_len, d = q.shape
        nkv, ctx, _ = k.shape
        g = nh // nkv
        scores = torch.bmm(q.reshape(nkv, g * q_len, d), k.transpose(1, 2)) * self.scale  # [KV, G*q, ctx]
        scores = scores.view(nkv, g, q_len, ctx)
        mask = self._mask(q_len, ctx, q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        sinks = self.sinks.to(scores.dtype).view(nkv, g, 1, 1).expand(nkv, g, q_len, 1)  # head h = kv * G + g
        logits = torch.cat((scores, sinks), dim=-1).float()  # [KV, G, q, ctx + 1]
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)[..., :ctx].to(q.dtype).reshape(nkv, g * q_len, ctx)
        return torch.bmm(probs, v).view(nh, q_len, d)
