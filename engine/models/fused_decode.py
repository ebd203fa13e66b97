"""Each decoder layer in one compiled call on CPU: the exploration fast path for small batches and the
batch-invariant execution path.

`FusedDecodeLayer` binds one DecoderLayer's weights (RMSNorm weights, the packed fused q/k/v and o
projections, the fp32 router, the layer's single CPU expert shard of one profile) to
`moegate_decode_layer` (kernels/csrc/decode_layer.h). Every step of that call computes a token's row
in an order fixed by the row alone: per-row norms, dense projections on fixed K tiles, attention per
token over its own context, experts summed in slot order. So a token's bytes do not depend on the
other tokens of the forward, nor on how a prompt is cut into chunks.

Two profiles: exploration (`fast`) binds the quantized copies from `Attention.set_fast_dense` and the
fast expert shards, for batches up to SMALL_BATCH_TOKENS without deferral; execution (`exact`) binds
lossless copies of the model's own projections (`Attention.set_exact_dense`, kernels.linear.exact_format)
and the exact expert shards, for every execution batch, with the final norm and lm_head on the same
kind of kernels (`build_exact_path`). The torch modules stay the reference and the path for everything
else: architectures the fused layer does not cover (non-GQA attention, grouped routing, partial rotary, attention biases, clip_qkv, whole-projection q/k
norms, shared experts, dense MLP layers, experts on other devices, non-fp32 dense weights).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from kernels.bindings import (
    DecodeLayerParams,
    cache_slots,
    decode_layer_library,
    run_decode_layer,
    run_decode_stack,
)
from kernels.formats import FORMAT_CODE

log = logging.getLogger(__name__)


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None and t.numel() else None


def unsupported_reason(cfg: ModelConfig, layer, exact: bool = False) -> str | None:
    """Why `layer` cannot run fused in the profile (None: it can; execution packs its projections itself)."""
    if cfg.linear_attention is not None or cfg.attention_output_gate:
        return "linear attention / gated attention output (Qwen3-Next)"
    if cfg.attention != "gqa" or cfg.router != "softmax":
        return f"{cfg.attention} attention / {cfg.router} routing (the kernel runs GQA with softmax top-k)"
    if cfg.rotary_dim != cfg.head_dim:
        return "partial rotary embedding"
    if cfg.attention_bias or cfg.clip_qkv is not None or cfg.qk_norm == "full":
        return "attention biases / clip_qkv / whole-projection q/k norms"
    if cfg.attention_sinks or cfg.expert_bias or cfg.expert_act != "silu" or cfg.rope_scaling:
        return "attention sinks / biased or non-SiLU experts / scaled RoPE"
    if not layer.is_moe or cfg.shared_expert_intermediate_size:
        return "dense MLP layer or shared expert"
    attn, packed = layer.self_attn, layer.mlp.experts.packed
    if attn.fast_qkv is None and not exact:
        return "no quantized attention projections (fast_dense)"
    shards = None if packed is None else packed.exact if exact else packed.fast
    if shards is None or len(shards) != 1 or shards[0].device.type != "cpu":
        return "routed experts not in one CPU shard"
    if layer.input_layernorm.weight.dtype != torch.float32 or layer.mlp.gate.weight.dtype != torch.float32:
        return "dense weights not fp32"
    if cfg.head_dim > 1024 or cfg.head_dim % 2:
        return "head_dim"
    return None


class FusedDecodeLayer:
    def __init__(self, cfg: ModelConfig, layer, lib, exact: bool = False) -> None:
        attn, moe = layer.self_attn, layer.mlp
        experts = (moe.experts.packed.exact if exact else moe.experts.packed.fast)[0].packed
        proj_qkv, proj_o = (attn.exact_qkv, attn.exact_o) if exact else (attn.fast_qkv, attn.fast_o)
        if experts.expert_ids != tuple(range(cfg.num_experts)):
            raise ValueError("the fused layer needs every expert in its CPU shard")
        self.lib, self.top_k = lib, cfg.top_k
        self._keep = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, moe.gate.weight]
        ex, qkv, o = experts.tensors, proj_qkv.tensors, proj_o.tensors
        qn = attn.q_norm.weight if cfg.qk_norm == "per_head" else None
        kn = attn.k_norm.weight if cfg.qk_norm == "per_head" else None
        self.params = DecodeLayerParams(
            H=cfg.hidden_size, NH=cfg.num_heads, KV=cfg.num_kv_heads, D=cfg.head_dim, E=cfg.num_experts,
            topk=cfg.top_k, I=experts.intermediate, norm_topk=int(cfg.norm_topk_prob),
            qk_norm=int(cfg.qk_norm == "per_head"), window=cfg.sliding_window or 0,
            eps=cfg.rms_norm_eps, scale=attn.scale,
            ln1=_ptr(layer.input_layernorm.weight), ln2=_ptr(layer.post_attention_layernorm.weight),
            qn=_ptr(qn), kn=_ptr(kn),
            dense_fmt=FORMAT_CODE[proj_qkv.fmt], dense_gs=proj_qkv.group_size,
            qkv_w=_ptr(qkv["weight"]), qkv_s=_ptr(qkv["scales"]), qkv_m=_ptr(qkv["mins"]),
            o_w=_ptr(o["weight"]), o_s=_ptr(o["scales"]), o_m=_ptr(o["mins"]),
            router=_ptr(moe.gate.weight), exp_fmt=FORMAT_CODE[experts.fmt], exp_gs=experts.group_size,
            gu_w=_ptr(ex["gate_up"]), gu_s=_ptr(ex["gate_up_scales"]), gu_m=_ptr(ex["gate_up_mins"]),
            dn_w=_ptr(ex["down"]), dn_s=_ptr(ex["down_scales"]), dn_m=_ptr(ex["down_mins"]),
        )
        if proj_o.fmt != proj_qkv.fmt or proj_o.group_size != proj_qkv.group_size:
            raise ValueError(f"q/k/v and o projections must share a format, got {proj_qkv.fmt} and {proj_o.fmt}")
        self._keep += [qn, kn, experts, proj_qkv, proj_o]  # the pointers above stay valid
        self.packed = moe.experts.packed
        self.num_threads = self.packed.num_threads or torch.get_num_threads()

    def __call__(self, x: torch.Tensor, ctx: FusedContext, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """x [T, H] fp32 contiguous, updated in place; writes the tokens' K/V. One layer alone: the reference
        of `FusedStack`, which runs them all in one call."""
        ids = torch.empty(x.shape[0], self.top_k, dtype=torch.int64)
        run_decode_layer(self.lib, self.params, x, ctx.cos, ctx.sin, k_cache, v_cache, ctx.slot_mapping, ctx.slots,
                         ctx.start, ctx.length, ids, self.num_threads)
        self.packed.record(ids)


class FusedStack:
    """A profile's fused layers run as one kernel call per forward (`moegate_decode_stack`): the layers'
    parameters, routing-count and KV-cache pointers gathered once, not marshalled per layer and step."""

    def __init__(self, layers: list[FusedDecodeLayer]) -> None:
        self.layers, self.lib, self.num_threads = layers, layers[0].lib, layers[0].num_threads
        if any(f.num_threads != self.num_threads for f in layers):
            raise ValueError("the fused layers of one stack must share the kernel pool's thread count")
        self.params = (DecodeLayerParams * len(layers))(*(f.params for f in layers))
        for f in layers:
            c = f.packed.counts
            if c.dtype != torch.int64 or not c.is_contiguous() or c.numel() != f.params.E or c.device.type != "cpu":
                raise ValueError(f"routing counts must be [E={f.params.E}] int64 on the CPU, got {c.dtype} {tuple(c.shape)}")
        self.counts = (ctypes.c_void_p * len(layers))(*(f.packed.counts.data_ptr() for f in layers))
        self._ids = torch.empty(0, layers[0].top_k, dtype=torch.int64)  # [T, K] scratch, grown on demand
        self._caches: tuple[list, ctypes.Array, ctypes.Array, int] | None = None

    def __len__(self) -> int:
        return len(self.layers)

    def __call__(self, x: torch.Tensor, ctx: FusedContext, kv_caches: list,
                 norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """x [T, H] fp32 contiguous, updated in place; writes every layer's K/V and routing counts. -> with
        `norm` (the final RMSNorm's fp32 weight [H], eps) each row of x normed in the same call, else x."""
        if self._caches is None or self._caches[0] is not kv_caches:  # the runner's list: the same every step
            n = len(self.layers)
            self._caches = (kv_caches, (ctypes.c_void_p * n)(*(c[0].data_ptr() for c in kv_caches)),
                            (ctypes.c_void_p * n)(*(c[1].data_ptr() for c in kv_caches)),
                            cache_slots(self.params, kv_caches))
        if self._ids.shape[0] < x.shape[0]:
            self._ids = torch.empty(x.shape[0], self._ids.shape[1], dtype=torch.int64)
        _, k, v, n = self._caches
        out = torch.empty_like(x) if norm is not None else x  # [T, H]
        run_decode_stack(self.lib, self.params, x, ctx.cos, ctx.sin, k, v, ctx.slot_mapping, ctx.slots, ctx.start,
                         ctx.length, self._ids, self.counts, self.num_threads,
                         None if norm is None else (norm[0].detach(), norm[1], out), slots_per_cache=n)
        return out


class FusedContext:
    """Per-forward inputs shared by every layer: rotary tables and each token's context slots."""

    def __init__(self, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos.float().contiguous(), sin.float().contiguous()  # [T, D]
        self.slot_mapping = batch.slot_mapping.contiguous()
        self.slots, self.start, self.length = batch.token_contexts()  # token t sees slots[start[t]:][:length[t]]


def build_fused_layers(cfg: ModelConfig, layers, exact: bool = False) -> FusedStack | None:
    """Fused layers for the whole stack in one profile, or None (with the reason logged) if any layer
    cannot run fused. The execution profile packs lossless copies of the attention projections first."""
    lib = decode_layer_library()
    if lib is None:
        return None
    for i, layer in enumerate(layers):
        reason = unsupported_reason(cfg, layer, exact)
        if reason is not None:
            log.info("fused %s path off: layer %d: %s", "execution" if exact else "exploration decode", i, reason)
            return None
    if exact:
        for layer in layers:
            layer.self_attn.set_exact_dense()
    return FusedStack([FusedDecodeLayer(cfg, layer, lib, exact) for layer in layers])


def build_exact_path(model) -> bool:
    """Batch-invariant execution for `model` on the CPU: fused exact layers, the final norm per row and a
    lossless packed lm_head (the fp32 execution copy if the engine made one). False (logged) where the
    architecture or placement does not allow it; execution chunks then run one per forward on torch."""
    from kernels.linear import PackedLinear, exact_format

    cfg = model.config
    if model.model.norm.weight.dtype != torch.float32:
        log.info("fused execution path off: dense weights not fp32")
        return False
    layers = build_fused_layers(cfg, model.model.layers, exact=True)
    if layers is None:
        return False
    head = model.exact_lm_head if model.exact_lm_head is not None else model.lm_head.weight
    model.exact_head = PackedLinear.pack(head, exact_format(head))
    model.exact_lm_head = None  # packed above: the torch copy would only hold memory
    model.exact_layers = layers
    return True
