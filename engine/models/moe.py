"""Sparse MoE block: router, routed experts (pluggable compute) and the optional shared expert.

Shapes: T = tokens, H = hidden, E = experts, I = expert intermediate, K = experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.expert_pipeline import Deferred, ExpertPipeline
from engine.forward_batch import ForwardBatch
from engine.models.layers import GatedMLP
from kernels.formats import Activation
from kernels.router import KINDS as ROUTER_KINDS
from kernels.router import route


class Router(nn.Module):
    """Top-k routing. "softmax": top-k of the softmax (optionally renormalised). DeepSeek's grouped routers
    score in fp32 as transformers does, keep the best `topk_group` of `n_group` expert groups and scale the
    chosen weights by `routed_scaling_factor`: "sigmoid_grouped" (V3: sigmoid scores, a score-correction
    bias that only steers the choice, groups ranked by their top-2 sum) and "softmax_grouped" (V2: groups
    ranked by their best expert). "topk_softmax" (GPT-OSS): logits with a bias, softmax over the top-k logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.router == "sigmoid_grouped":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        if cfg.router == "topk_softmax":
            self.bias = nn.Parameter(torch.zeros(cfg.num_experts))
        self.kind = cfg.router
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (router logits [T, E], top-k weights [T, K], top-k ids [T, K]), weights descending.
        Softmax and GPT-OSS routing run in kernels.router (the compiled kernel for fp32 on CPU, else its
        torch reference); the grouped routers here in torch."""
        if self.kind in ROUTER_KINDS:
            bias = self.bias if self.kind == "topk_softmax" else None
            return route(x, self.weight, bias, self.top_k, self.kind, self.norm_topk_prob)
        return self._grouped(x)

    def _grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # [T, E] fp32
        t, e = logits.shape
        if self.kind == "sigmoid_grouped":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            group_scores = choice.view(t, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            masked = float("-inf")
        else:
            scores = choice = torch.softmax(logits, dim=-1)
            group_scores = scores.view(t, self.n_group, -1).amax(dim=-1)  # [T, G]
            masked = 0.0
        if self.topk_group < self.n_group:
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, torch.topk(group_scores, self.topk_group, dim=-1)[1], True)  # [T, G]
            choice = choice.masked_fill(~keep.repeat_interleave(e // self.n_group, dim=1), masked)
        ids = torch.topk(choice, self.top_k, dim=-1)[1]  # [T, K]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights, order = (weights * self.scaling).sort(dim=-1, descending=True)
        return logits.to(x.dtype), weights.to(x.dtype), ids.gather(1, order)


class Experts(nn.Module):
    """Routed experts in the fused layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I],
    with GPT-OSS's biases gate_up_proj_bias [E, 2I] and down_proj_bias [E, H] when `cfg.expert_bias`.

    `packed` (engine.experts.LayerExperts) replaces the raw weights when the engine packs the experts.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts, self.intermediate = e, i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        if cfg.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
            self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.act = Activation(cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit) \
            if cfg.expert_act != "silu" else Activation()
        self.packed = None

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        exact: bool = False, num_threads: int | None = None,
    ) -> torch.Tensor:
        """x [T, H], topk_ids [T, K] (-1 = skip), topk_weights [T, K] -> [T, H], computed now on this thread."""
        return ExpertPipeline(x.device).run(self, x, topk_ids, topk_weights, exact, num_threads)

    def reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Plain torch: tokens grouped by expert, each expert's weights read once."""
        out = torch.zeros_like(x)  # [T, H]
        for e in torch.unique(topk_ids).tolist():
            if e < 0:
                continue
            tok, slot = torch.where(topk_ids == e)  # [n], [n]
            bias = hasattr(self, "gate_up_proj_bias")
            gate, up = F.linear(x[tok], self.gate_up_proj[e], self.gate_up_proj_bias[e] if bias else None).chunk(2, -1)
            h = F.silu(gate) * up if self.act.kind == "silu" else self.act(gate.float(), up.float()).to(x.dtype)  # [n, I]
            y = F.linear(h, self.down_proj[e], self.down_proj_bias[e] if bias else None)  # [n, H]
            out.index_add_(0, tok, (y * topk_weights[tok, slot, None]).to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, is_last_moe: bool) -> None:
        super().__init__()
        self.is_last_moe = is_last_moe
        self.top_k = cfg.top_k
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = self.shared_experts = None
        if cfg.shared_expert_intermediate_size and cfg.shared_expert_gate:  # Qwen2-MoE: one gated shared expert
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        elif cfg.shared_expert_intermediate_size:  # DeepSeek: n_shared_experts fused into one ungated MLP
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, Deferred | None]:
        """x [T, H] -> (output [T, H], deferred output [T, H] still being computed, or None).

        Routed experts go through `batch.expert_pipeline` (host shards computed by the CPU kernel on
        the routed rows only). Expert deferral: the `batch.defer` lowest-weighted of each token's top-k
        experts are submitted to the pipeline's expert thread; the caller adds their output at the next
        MoE layer. The last MoE layer never defers.
        """
        _, weights, ids = self.gate(x)  # [T, K] sorted by weight, descending
        if self.experts.packed is not None:
            self.experts.packed.record(ids)
        pipeline = batch.expert_pipeline or ExpertPipeline(x.device)
        d = 0 if self.is_last_moe or pipeline.executor is None else min(batch.defer, self.top_k - 1)
        deferred = None
        if d:
            later = ids.clone()
            later[:, : self.top_k - d] = -1
            ids = ids.clone()
            ids[:, self.top_k - d :] = -1
            deferred = pipeline.submit(self.experts, x, later, weights, batch.exact, 1)
        shared = None
        if self.shared_expert is not None:  # queued on the fast device before the host experts run
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            shared = self.shared_experts(x)
        out = pipeline.run(self.experts, x, ids, weights, batch.exact)
        if shared is not None:
            out = out + shared
        return out, deferred
