"""MoeForCausalLM: one decoder stack for every supported architecture, named as in Hugging Face."""

from __future__ import annotations

import torch
from torch import nn

from engine.archs import arch_spec
from engine.config import ModelConfig
from engine.expert_pipeline import Deferred
from engine.forward_batch import ForwardBatch
from engine.models.layers import GatedMLP, RMSNorm
from engine.models.moe import SparseMoeBlock
from kernels.formats import formats_for


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)
        spec = arch_spec(cfg.arch)
        if cfg.is_linear(layer_idx):  # Qwen3-Next: a recurrent state per sequence instead of KV
            self.mixer_name = "linear_attn"
            self.linear_attn = spec.linear_attention_class()(cfg, layer_idx)
        else:  # per-layer attention types (sliding / full) need the layer's index
            self.mixer_name = "self_attn"
            self.self_attn = spec.attention_class()(cfg, layer_idx) if cfg.layer_types else spec.attention_class()(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)
        self.is_moe = cfg.moe_layers[layer_idx]
        self.mlp = (
            SparseMoeBlock(cfg, is_last_moe=layer_idx == cfg.last_moe_layer)
            if self.is_moe else GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size)
        )

    @property
    def mixer(self) -> nn.Module:
        """The layer's token mixer: `self_attn`, or `linear_attn` on a linear-attention layer."""
        return getattr(self, self.mixer_name)

    def forward(
        self, x, batch: ForwardBatch, cache: tuple[torch.Tensor, ...], pending: Deferred | None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Deferred | None]:
        """x [T, H] (plus `residual`, the previous layer's, where given) -> (out [T, H], residual [T, H], this
        layer's deferred expert output still in flight): the layer's hidden state is out + residual, added by
        the next layer's first norm or the final norm (RMSNorm.add_forward: one kernel call with the norm).
        `cache`: the layer's KV cache tensors (engine.kv_cache.allocate_kv_cache) or its recurrent-state pools
        (engine.recurrent_state)."""
        residual, normed = self.input_layernorm.add_forward(x, residual)
        h, normed = self.post_attention_layernorm.add_forward(self.mixer(normed, batch, cache), residual)
        if not self.is_moe:
            return self.mlp(normed), h, pending
        out, deferred = self.mlp(normed, batch)
        if pending is not None:  # the previous MoE layer's deferred experts land here
            out = out + pending.result()
        return out, h, deferred


class MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centred_norm)


class MoeForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.exact_lm_head: torch.Tensor | None = None  # fp32 copy used in execution mode, if set
        self.fast_lm_head: QuantizedLMHead | None = None  # int8 / bf16 copy used in exploration, if set
        self.fused_layers = None  # engine.models.fused_decode.FusedStack for small exploration batches
        self.exact_layers = None  # FusedStack of the execution profile (batch-invariant), if built
        self.exact_head = None  # kernels.linear.PackedLinear: lossless lm_head of the fused execution path
        self.expert_reader = None  # (layer, expert) -> checkpoint weights, set by the streaming loader
        self.mtp = None  # engine.mtp.MtpLayer: the checkpoint's multi-token-prediction layer, loaded for MTP drafts

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """Runs the stack over the batch's new tokens, writing their KV (and recurrent states: one entry of
        `kv_caches` per layer, ModelRunner.layer_caches); returns hidden [T, H]."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, H]
        if self.batch_invariant(batch.exact) and x.device.type == "cpu":
            return self._run_fused(self.exact_layers, batch, x, kv_caches, final_norm=True)  # each row alone
        if self._fused(batch, x):
            return self._run_fused(self.fused_layers, batch, x, kv_caches, self.model.norm._row_kernel(x))
        pending = residual = None
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual, pending = layer(x, batch, cache, pending, residual)
        assert pending is None, "the last MoE layer must not defer"
        return self.model.norm.add_forward(x, residual)[1]

    def _run_fused(self, stack, batch: ForwardBatch, x: torch.Tensor, kv_caches, final_norm: bool) -> torch.Tensor:
        """Every layer in one kernel call -> hidden [T, H] after the final norm: in the same call where
        `final_norm` (the norm's row kernel, kernels.norm.rms_norm_rows, to the bit), else by the module."""
        from engine.models.fused_decode import FusedContext

        cos, sin = self.model.layers[0].self_attn._rope(batch, torch.float32)
        norm = self.model.norm
        out = stack(x.contiguous(), FusedContext(batch, cos, sin), kv_caches,
                    (norm.weight, norm.eps) if final_norm else None)
        return out if final_norm else norm(out)

    def batch_invariant(self, exact: bool) -> bool:
        """Whether `exact` forwards run the fused execution path, whose rows do not depend on their batch."""
        return exact and self.exact_layers is not None

    def _fused(self, batch: ForwardBatch, x: torch.Tensor) -> bool:
        """Exploration forwards of any size without deferral run the fused stack on the CPU: the layers' own
        kernels on the same inputs (a 128-token prefill's hidden states equal the modules' to the bit), without
        the modules' Python and tensor bookkeeping between the calls."""
        return (self.fused_layers is not None and not batch.exact and batch.defer == 0 and x.device.type == "cpu"
                and x.dtype == torch.float32)

    def logits_on_torch(self, exact: bool = False) -> bool:
        """Whether compute_logits runs torch ops (worth torch's threads) rather than the compiled kernel's pool."""
        if exact:
            return self.exact_head is None
        return self.fast_lm_head is None or self.fast_lm_head.packed is None

    def compute_logits(self, hidden: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """hidden [S, H] -> fp32 logits [S, V]: execution may use a higher-precision lm_head, exploration
        a cheaper one (decode streams the whole [V, H] matrix once per step)."""
        if exact:
            if self.exact_head is not None and hidden.device.type == "cpu":
                return self.exact_head(hidden, num_threads=self.exact_layers.num_threads)
            if self.exact_lm_head is not None:
                return torch.nn.functional.linear(hidden.float(), self.exact_lm_head)
        elif self.fast_lm_head is not None:
            return self.fast_lm_head(hidden)
        return self.lm_head(hidden).float()


class QuantizedLMHead:
    """lm_head for exploration: bf16, int8, int4, int8_a8 or bf16_a16. On the CPU each runs the compiled kernel
    (kernels.linear.PackedLinear: bf16 weights with fp32 activations, int8 per row and group of 64 with fp32
    activations, int4 W4A8 and int8_a8 W8A8 groups of 32, bf16_a16 bf16 weights and bf16 activations); elsewhere
    bf16 runs as a matmul and int8 as a weight-only matmul with one scale per row."""

    FORMATS = formats_for("lm_head")

    def __init__(self, weight: torch.Tensor, fmt: str) -> None:
        if fmt not in self.FORMATS:
            raise ValueError(f"lm_head format must be one of {', '.join(self.FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.packed = None
        if weight.device.type == "cpu":  # bf16 too: torch's bf16 GEMV ran at ~0.6x the kernel's bf16 units here
            from kernels.linear import PackedLinear

            self.packed = PackedLinear.pack(weight, fmt)
            self.num_threads = torch.get_num_threads()  # the kernel's own pool: torch's may be at 1 in decode
            return
        if fmt in ("int4", "int8_a8", "bf16_a16"):
            raise ValueError(f"an {fmt} lm_head runs on the CPU kernel only; use bf16 or int8 on CUDA")
        w = weight.detach().float()  # [V, H]
        if fmt == "bf16":
            self.weight = w.bfloat16()
        else:
            self.scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [V]
            self.weight = torch.round(w / self.scales[:, None]).clamp(-127, 127).to(torch.int8)
            self.scales = self.scales.bfloat16()

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> fp32 logits [S, V]."""
        if self.packed is not None:
            return self.packed(hidden, num_threads=self.num_threads)
        x = hidden.bfloat16()
        if self.fmt == "bf16":
            return torch.nn.functional.linear(x, self.weight).float()
        return (torch.nn.functional.linear(x, self.weight.to(x.dtype)) * self.scales).float()
