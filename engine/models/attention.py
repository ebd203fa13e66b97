"""Grouped-query attention over a paged KV cache, with the per-architecture q/k norms.

Exploration batches on the CPU may run the q/k/v (fused) and o projections through quantized copies
(`fast_qkv`, `fast_o`: kernels.linear.PackedLinear, set by the engine from its `fast_dense` format; biases
are added at full precision after them); execution batches always use the model's own weights: on the torch
path as they are, on the fused execution path (engine/models/fused_decode.py) as lossless packed copies
(`exact_qkv`, `exact_o`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.models.layers import RMSNorm, RotaryEmbedding, apply_rotary
from kernels.attention import kernel_takes, paged_attention


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k/v [T, KV, D] into the caches' rows `slots` [T]: on the CPU in fp32 as numpy copies on this thread
    (torch's index_copy_ wakes its OpenMP threads for a copy), else index_copy_."""
    if k_cache.device.type == "cpu" and k_cache.dtype == v_cache.dtype == k.dtype == v.dtype == torch.float32 \
            and not (k.requires_grad or v.requires_grad):
        rows = slots.numpy()
        k_cache.numpy()[rows] = k.numpy()
        v_cache.numpy()[rows] = v.numpy()
        return
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.sliding_window = cfg.window_of(layer_idx)
        nh, nkv, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, nh * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, nkv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, nkv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * d, h, bias=cfg.o_proj_bias)
        if cfg.qk_norm == "per_head":
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.zero_centred_norm)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.zero_centred_norm)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(nh * d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(nkv * d, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.scale = d**-0.5
        self.fast_qkv = None  # PackedLinear of [q; k; v] rows, exploration only
        self.fast_o = None
        self.exact_qkv = None  # the same, lossless (kernels.linear.exact_format): the fused execution path
        self.exact_o = None
        self.fast_qkv_bias = self.fast_o_bias = None

    def set_fast_dense(self, fmt: str) -> None:
        """Quantized copies of the projections for exploration batches (the originals stay for execution)."""
        from kernels.linear import PackedLinear

        qkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()  # [NH*D + 2*KV*D, H]
        self.fast_qkv = PackedLinear.pack(qkv, fmt)
        self.fast_o = PackedLinear.pack(self.o_proj.weight.detach(), fmt)
        # biases (Qwen2-MoE's q/k/v, GPT-OSS's q/k/v/o) stay at full precision, added after the kernel
        self.fast_qkv_bias = (torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]).detach()
                              if self.q_proj.bias is not None else None)
        self.fast_o_bias = self.o_proj.bias.detach() if self.o_proj.bias is not None else None

    def set_exact_dense(self) -> None:
        """Lossless packed copies of the projections for the fused execution path (one format for both)."""
        from kernels.linear import PackedLinear, exact_format

        qkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()  # [NH*D + 2*KV*D, H]
        fmt = "bf16" if exact_format(qkv) == exact_format(self.o_proj.weight) == "bf16" else "fp32"
        self.exact_qkv = PackedLinear.pack(qkv, fmt)
        self.exact_o = PackedLinear.pack(self.o_proj.weight.detach(), fmt)

    def _project_qkv(self, x: torch.Tensor, fast: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not fast:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        nq, nkv = self.q_proj.out_features, self.cfg.num_kv_heads * self.cfg.head_dim  # q rows (and gates)
        qkv = self.fast_qkv(x).to(x.dtype)  # [T, NQ + 2 NKV]
        if self.fast_qkv_bias is not None:
            qkv = qkv + self.fast_qkv_bias
        return qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]

    def _rope(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.cfg.rotary_dim, self.cfg.rope_theta, dtype)  # the same tables for every layer of a forward
        if key not in batch.rope:
            batch.rope[key] = self.rotary(batch.positions, dtype,
                                          list(zip(batch.query_lens, batch.context_lens, strict=True)))
        return batch.rope[key]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [T, H]; cache (k_cache, v_cache), each [slots, KV, D], written in place -> [T, H]."""
        cfg = self.cfg
        T = x.shape[0]
        fast = self.fast_qkv is not None and not batch.exact and x.device.type == "cpu"
        q, k, v = self._project_qkv(x, fast)  # [T, NH*D], [T, KV*D] x2
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(T, cfg.num_heads, cfg.head_dim)
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        out = self._attend_paged(*self._rotate(q, k, batch), v, batch, cache)  # [T, NH, D]
        return self._project_out(out.reshape(T, -1), fast)

    def _project_out(self, out: torch.Tensor, fast: bool) -> torch.Tensor:
        """o_proj of out [T, NH*D] (its quantized copy in `fast` exploration batches) -> [T, H]."""
        if fast:
            o = self.fast_o(out).to(out.dtype)
            return o if self.fast_o_bias is None else o + self.fast_o_bias
        return self.o_proj(out)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q [T, NH, D] and k [T, KV, D] (on the first rotary_dim dims of each head where partial)."""
        cfg = self.cfg
        cos, sin = self._rope(batch, q.dtype)
        if cfg.rotary_dim == cfg.head_dim:
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        r = cfg.rotary_dim  # partial rotary (GLM-4.5, Qwen3-Next): the first r dims of each head turn, the rest pass
        return (torch.cat((apply_rotary(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                torch.cat((apply_rotary(k[..., :r], cos, sin), k[..., r:]), dim=-1))

    def _attend_paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                      cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Writes k/v [T, KV, D] to the cache, attends each sequence's q over its context -> [T, NH, D]: fp32 on
        CPU in the compiled kernel (kernels.attention: per (token, head), batch-invariant), else `_attend`."""
        k_cache, v_cache = cache
        write_kv(k_cache, v_cache, batch.slot_mapping, k, v)
        if self._attend.__func__ is Attention._attend and kernel_takes(q, k_cache, v_cache):  # not sinks
            slots, start, length = batch.token_contexts()
            return paged_attention(q, k_cache, v_cache, slots, start, length, self.scale, self.sliding_window)
        out = torch.empty_like(q)  # [T, NH, D]
        for start, q_len, _ctx, slots in zip(
            batch.query_starts, batch.query_lens, batch.context_lens, batch.context_slots, strict=True
        ):
            qs = q[start : start + q_len].transpose(0, 1)  # [NH, q, D]
            ks = k_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)  # [KV, ctx, D]
            vs = v_cache.index_select(0, slots).transpose(0, 1).to(q.dtype)
            out[start : start + q_len] = self._attend(qs, ks, vs).transpose(0, 1)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [NH, q, D], k/v [KV, ctx, D] -> [NH, q, D]. Grouped heads share one batched matmul per KV head
        (several times faster on CPU than SDPA's GQA path); softmax in fp32 as transformers' eager."""
        nh, q_len, d = q.shape
        nkv, ctx, _ = k.shape
        g = nh // nkv
        scores = torch.bmm(q.reshape(nkv, g * q_len, d), k.transpose(1, 2)) * self.scale  # [KV, G*q, ctx]
        mask = self._mask(q_len, ctx, q.device)
        if mask is not None:
            scores = scores.view(nkv, g, q_len, ctx).masked_fill(~mask, float("-inf")).view(nkv, g * q_len, ctx)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs, v).view(nh, q_len, d)

    def _mask(self, q_len: int, ctx: int, device: torch.device) -> torch.Tensor | None:
        """Boolean [q, ctx] mask (True = attend), or None where every key is visible."""
        window = self.sliding_window
        if q_len == 1 and (window is None or ctx <= window):
            return None
        q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
        k_pos = torch.arange(ctx, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= q_pos - k_pos < window
        return mask
