"""GPT-OSS attention: grouped-query attention with a learned sink logit per head (YaRN RoPE: engine/rope.py).

The sink joins each query's softmax as one more logit with no value (it only takes probability mass away
from the keys); sliding / full layers come from `ModelConfig.layer_types` (engine/models/attention.py). The
rest of GPT-OSS (router with a bias and a softmax over the top-k logits, biased experts with the clamped
SwiGLU) is engine/models/moe.py and the kernel's activation variant (kernels/formats.py `Activation`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.attention import Attention


class SinkAttention(Attention):
    """GQA with per-head sinks (`self_attn.sinks` [NH]), biased q/k/v/o and default or YaRN RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))  # RoPE (default or YaRN): engine/rope.py

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
