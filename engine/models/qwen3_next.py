"""Qwen3-Next: gated full attention and gated DeltaNet linear attention (`layer_types`), as transformers computes them.

Full-attention layers are grouped-query attention over the paged KV cache whose q_proj also yields a sigmoid
output gate per head. Linear-attention layers keep no KV: each sequence carries a causal-conv state (the last
conv_kernel - 1 inputs) and a delta-rule state [NV, DK, DV] in the engine's recurrent-state pool
(engine/recurrent_state.py), in the slot the scheduler gave it (`ForwardBatch.state_slots`); a chunk starting at
token 0 starts from zeros. Prefill chunks run the chunked delta rule, single-token decodes the recurrent one
(the torch references transformers falls back to). Shapes: T tokens, q tokens of one sequence, C conv channels,
NK/NV key/value heads of DK/DV dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.models.attention import Attention


class GatedAttention(Attention):
    """GQA whose q_proj gives [q; gate] per head (zero-centred per-head q/k norms, partial rotary)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(cfg, layer_idx)
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [T, H]; cache (k_cache, v_cache) written in place -> [T, H]."""
        cfg = self.cfg
        T, nh, d = x.shape[0], cfg.num_heads, cfg.head_dim
        fast = self.fast_qkv is not None and not batch.exact and x.device.type == "cpu"
        qg, k, v = self._project_qkv(x, fast)  # [T, NH*2D], [T, KV*D] x2
        q, gate = qg.view(T, nh, 2 * d).chunk(2, dim=-1)  # [T, NH, D] each
        q, k = self.q_norm(q), self.k_norm(k.view(T, cfg.num_kv_heads, d))
        out = self._attend_paged(*self._rotate(q, k, batch), v.view(T, cfg.num_kv_heads, d), batch, cache)
        return self._project_out((out * torch.sigmoid(gate)).reshape(T, nh * d), fast)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x times SiLU(gate), the norm over the last dim (one value head)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(dtype)) * F.silu(gate.float())).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill chunk. q/k [NV, q, DK] (l2-normed, q scaled), v [NV, q, DV], g/beta [NV, q], all fp32;
    state [NV, DK, DV] -> (out [NV, q, DV], the state after the last token). The delta rule over blocks of
    `chunk` tokens (a triangular solve inside each, a scan across them), as transformers' torch fallback."""
    n = q.shape[1]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    h = q.shape[0]
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(h, -1, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))  # [NV, N, c, *]
    cum = g.reshape(h, -1, chunk).cumsum(-1)  # [NV, N, c] log decay from each block's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [NV, N, c, c]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    block_decay = cum[..., -1].exp()[..., None, None]  # [NV, N, 1, 1]
    out = torch.zeros_like(new_v)
    for i in range(q.shape[1]):
        v_i = new_v[:, i] - k_cum[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_i
        state = state * block_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i
    return out.reshape(h, -1, out.shape[-1])[:, :n], state


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: the arguments and result of `chunk_gated_delta_rule`, with any leading batch dims
    (decode: [B, NV, 1, D] for B sequences at once)."""
    out = torch.empty_like(v)
    for t in range(q.shape[-2]):
        state = state * g[..., t].exp()[..., None, None]
        delta = (v[..., t, :] - (state * k[..., t, :, None]).sum(-2)) * beta[..., t, None]  # [..., NV, DV]
        state = state + k[..., t, :, None] * delta[..., None, :]
        out[..., t, :] = (state * q[..., t, :, None]).sum(-2)
    return out, state


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention, HF names (`linear_attn.in_proj_qkvz`, `conv1d`, `A_log`, ...)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        la = cfg.linear_attention
        self.dims = la
        self.nk, self.nv, self.dk, self.dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.nk * self.dk + 2 * self.nv * self.dv, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.nv, bias=False)
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, bias=False, groups=la.conv_dim,
                                padding=la.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.nv * self.dv, cfg.hidden_size, bias=False)
        # exploration on the CPU: quantized copies of [in_proj_qkvz; in_proj_ba] and out_proj (named as attention's,
        # so the placement table counts them)
        self.fast_qkv = self.fast_o = None

    def set_fast_dense(self, fmt: str) -> None:
        from kernels.linear import PackedLinear

        self.fast_qkv = PackedLinear.pack(torch.cat([self.in_proj_qkvz.weight, self.in_proj_ba.weight]).detach(), fmt)
        self.fast_o = PackedLinear.pack(self.out_proj.weight.detach(), fmt)

    def _project(self, x: torch.Tensor, fast: bool) -> tuple[torch.Tensor, ...]:
        """x [T, H] -> conv input [T, C] (q, k, v flattened), z [T, NV, DV], b and a [T, NV]."""
        T, r = x.shape[0], self.nv // self.nk
        if fast:
            qkvz, ba = self.fast_qkv(x).to(x.dtype).split([self.in_proj_qkvz.out_features, 2 * self.nv], dim=-1)
        else:
            qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        qkvz = qkvz.view(T, self.nk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)  # per key head group
        b, a = ba.reshape(T, self.nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)  # [T, C]
        return mixed, z.reshape(T, self.nv, self.dv), b.reshape(T, self.nv), a.reshape(T, self.nv)

    def _conv(self, x: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, q, C], conv_state [B, C, K-1] (the inputs before x) -> (SiLU(conv) [B, q, C], the state after x)."""
        w = self.conv1d.weight  # [C, 1, K]
        full = torch.cat((conv_state.to(w.dtype), x.transpose(1, 2).to(w.dtype)), dim=-1)  # [B, C, K-1+q]
        out = F.conv1d(full, w, groups=w.shape[0])  # [B, C, q]
        return F.silu(out).transpose(1, 2).to(x.dtype), full[..., full.shape[-1] - conv_state.shape[-1]:]

    def _mix(self, mixed, g, beta, conv0, state0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """B sequences of q tokens each (decodes together, or one prefill chunk): mixed [B, q, C], g / beta
        [B, NV, q], states conv0 [B, C, K-1] and state0 [B, NV, DK, DV] -> (out [B, q, NV, DV] fp32, both states
        after the last token)."""
        B, n, _ = mixed.shape
        kd, r = self.nk * self.dk, self.nv // self.nk
        conv_out, conv1 = self._conv(mixed, conv0)
        q, k, v = conv_out.float().split([kd, kd, self.nv * self.dv], dim=-1)
        q = l2norm(q.view(B, n, self.nk, self.dk)).repeat_interleave(r, dim=2).transpose(1, 2)  # [B, NV, q, DK]
        k = l2norm(k.view(B, n, self.nk, self.dk)).repeat_interleave(r, dim=2).transpose(1, 2)
        v = v.view(B, n, self.nv, self.dv).transpose(1, 2)  # [B, NV, q, DV]
        q = q * self.dk**-0.5
        if n == 1:
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state0)
        else:
            o, state = chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], state0[0])
            o, state = o[None], state[None]
        return o.transpose(1, 2), conv1, state

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [T, H]; cache (conv_states [S, C, K-1], delta_states [S, NV, DK, DV]) updated in place at each
        sequence's slot -> [T, H]. Decodes run together, each prefill chunk alone."""
        conv_states, delta_states = cache
        fast = self.fast_qkv is not None and not batch.exact and x.device.type == "cpu"
        mixed, z, b, a = self._project(x, fast)
        beta = b.sigmoid().float()  # [T, NV]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, NV] log decay
        out = torch.empty(x.shape[0], self.nv, self.dv, dtype=x.dtype, device=x.device)  # [T, NV, DV]
        seqs = list(zip(batch.query_starts, batch.query_lens, batch.context_lens, batch.state_slots, strict=True))
        decodes = [s for s in seqs if s[1] == 1 and s[2] > 1]
        groups = ([decodes] if decodes else []) + [[s] for s in seqs if not (s[1] == 1 and s[2] > 1)]
        for group in groups:
            n = group[0][1]
            rows = torch.cat([torch.arange(start, start + n) for start, *_ in group]).to(x.device)
            slots = torch.tensor([slot for *_, slot in group], device=x.device)
            fresh = group[0][2] == n  # a chunk from token 0 (prefill groups hold one sequence): no state carried in
            conv0, state0 = (torch.zeros_like(t[slots]) if fresh else t[slots] for t in (conv_states, delta_states))
            o, conv1, state = self._mix(mixed[rows].view(len(group), n, -1), g[rows].view(len(group), n, -1).transpose(1, 2),
                                        beta[rows].view(len(group), n, -1).transpose(1, 2), conv0, state0.float())
            conv_states.index_copy_(0, slots, conv1.to(conv_states.dtype))
            delta_states.index_copy_(0, slots, state.to(delta_states.dtype))
            out[rows] = o.reshape(-1, self.nv, self.dv).to(x.dtype)
        o = self.norm(out.view(-1, self.dv), z.reshape(-1, self.dv)).view(x.shape[0], self.nv * self.dv)
        return self.fast_o(o).to(x.dtype) if fast else self.out_proj(o)
