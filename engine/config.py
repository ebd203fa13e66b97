"""ModelConfig: the Hugging Face config.json of a MoE checkpoint, normalised once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.archs import LinearAttentionDims, arch_spec
from engine.errors import CheckpointError
from engine.fp8 import BlockFp8
from engine.gguf import find_gguf
from engine.gguf import hf_config as gguf_hf_config
from engine.quantization import quantization_from_hf
from engine.rope import RopeScaling

ROUTERS = ("softmax", "sigmoid_grouped", "softmax_grouped", "topk_softmax")
EXPERT_ACTS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the context served (stretched by rope scaling where it extends it)
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: str  # "none" | "per_head" (Qwen3: RMSNorm over head_dim) | "full" (OLMoE: over all heads)
    clip_qkv: float | None
    sliding_window: int | None
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    dense_intermediate_size: int  # MLP width of non-MoE layers
    moe_layers: tuple[bool, ...]
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on `mlp.shared_expert`; else `mlp.shared_experts`
    # attention: "gqa" (q/k/v/o projections, K and V cached per KV head) or "mla" (multi-head latent attention:
    # the cache holds the normalised latent kv_lora_rank plus the roped key qk_rope_head_dim per token)
    attention: str = "gqa"
    q_lora_rank: int | None = None  # MLA: None -> a direct q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    partial_rotary_factor: float = 1.0  # GLM-4.5: RoPE on the first head_dim * factor dims of each head only
    rope_layout: str = "rotate_half"  # "rotate_half" | "interleaved_cat" (DeepSeek-V3) | "complex_pairs" (V2)
    # router: "softmax" (top-k of softmax) | "sigmoid_grouped" (DeepSeek-V3: sigmoid, score-correction bias,
    # best groups by top-2 sum) | "softmax_grouped" (DeepSeek-V2: softmax, best groups by max)
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    quantization: BlockFp8 | None = None  # the checkpoint's weight format, dequantized on load; None: unquantized
    # GPT-OSS: per-layer attention types ("sliding_attention" layers use sliding_window, "full_attention" none;
    # empty: every layer uses sliding_window), a learned sink logit per head, a bias on o_proj too
    layer_types: tuple[str, ...] = ()
    attention_sinks: bool = False
    o_proj_bias: bool = False
    # routed experts: "silu" (SiLU(gate) * up) or "swiglu_clamped" (GPT-OSS, kernels.formats.Activation),
    # with per-expert biases on gate_up and down when expert_bias
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    # Qwen3-Next: "linear_attention" layers in layer_types run gated DeltaNet (engine/models/qwen3_next.py) with a
    # recurrent state per sequence (engine/recurrent_state.py) instead of KV; the full-attention layers gate
    # their output (q_proj yields a sigmoid gate beside q); RMSNorm weights are offsets from 1
    linear_attention: LinearAttentionDims | None = None
    attention_output_gate: bool = False
    zero_centred_norm: bool = False
    model_type: str = ""  # config.json's own model_type where it names an alias of `arch` (kimi_k2); "" = arch

    def __post_init__(self) -> None:
        arch_spec(self.arch)  # UnsupportedArchitectureError for an unknown family
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise CheckpointError(f"num_experts_per_tok={self.top_k} must be in 1..{self.num_experts}")
        if len(self.moe_layers) != self.num_layers:
            raise CheckpointError("moe_layers must have one entry per layer")
        if self.hidden_act != "silu":
            raise CheckpointError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.attention not in ("gqa", "mla") or self.router not in ROUTERS:
            raise CheckpointError(f"attention {self.attention!r} / router {self.router!r} is not supported")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise CheckpointError(f"partial_rotary_factor={self.partial_rotary_factor} of head_dim={self.head_dim} "
                                  "must give an even rotary width")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise CheckpointError(f"n_group={self.n_group} must divide n_routed_experts={self.num_experts} "
                                  f"and topk_group={self.topk_group} be in 1..n_group")
        if self.router == "sigmoid_grouped" and self.num_experts // self.n_group < 2:
            raise CheckpointError("sigmoid grouped routing scores each group by its top-2 experts: "
                                  "n_routed_experts / n_group must be at least 2")
        if self.top_k > self.topk_group * self.num_experts // self.n_group:
            raise CheckpointError(f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group groups")
        kinds = {"sliding_attention", "full_attention"} | ({"linear_attention"} if self.linear_attention else set())
        if self.layer_types and (len(self.layer_types) != self.num_layers or set(self.layer_types) - kinds):
            raise CheckpointError(f"layer_types must give one of {sorted(kinds)} for each of "
                                  f"the {self.num_layers} layers, got {list(self.layer_types)}")
        if not self.kv_layers:
            raise CheckpointError("layer_types has no attention layer: a model needs at least one full-attention layer")
        if self.expert_act not in EXPERT_ACTS or (self.expert_act == "swiglu_clamped" and not self.swiglu_limit > 0):
            raise CheckpointError(f"expert activation {self.expert_act!r} (limit {self.swiglu_limit}) is not "
                                  f"supported: one of {', '.join(EXPERT_ACTS)} with a positive swiglu_limit")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of a layer's attention (None: full attention)."""
        if self.layer_types and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def is_linear(self, layer: int) -> bool:
        """Whether a layer runs linear attention (a recurrent state per sequence, no KV cache)."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache (every layer but linear-attention ones), in order."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_linear(i))

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(cache tensors per layer, heads, width) of one token: K and V per KV head, or MLA's one latent."""
        if self.attention == "mla":
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    @property
    def last_moe_layer(self) -> int:
        return max(i for i, m in enumerate(self.moe_layers) if m)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """From config.json, or from the metadata of a GGUF file (`model_dir` may name the .gguf)."""
        hf = read_hf_config(model_dir)
        if find_gguf(model_dir) is not None:
            return cls.from_hf(hf)
        return cls.from_hf(hf, eos_token_ids=_eos_ids(hf, Path(model_dir) / "generation_config.json"))

    @classmethod
    def from_hf(cls, hf: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Fields every family shares are read here; the family's own come from its registry entry."""
        model_type = hf.get("model_type", "")
        spec = arch_spec(model_type)

        def need(*names: str) -> Any:
            for name in names:
                if hf.get(name) is not None:
                    return hf[name]
            raise CheckpointError(f"config.json of a {model_type} model lacks {' / '.join(names)}")

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_scaling = RopeScaling.from_hf(hf)
        common = dict(
            arch=spec.model_type,
            model_type=model_type if model_type != spec.model_type else "",
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=rope_scaling.context_length() if rope_scaling
            else hf.get("max_position_embeddings", 4096),
            hidden_act=hf.get("hidden_act", "silu"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm="none",
            clip_qkv=None,
            sliding_window=None,
            top_k=need("num_experts_per_tok"),
            shared_expert_intermediate_size=0,
            eos_token_ids=eos_token_ids or _as_ids(hf.get("eos_token_id")),
            rope_scaling=rope_scaling,
            quantization=quantization_from_hf(hf),
        )
        return cls(**{**common, **spec.fields(hf, need)})


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json, or a GGUF file's metadata as one (`model_dir` may name the .gguf): what
    `ModelConfig.from_hf` reads."""
    gguf_file = find_gguf(model_dir)
    if gguf_file is not None:
        return gguf_hf_config(gguf_file)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: the model needs a checkpoint directory with a config.json "
                              "(or a .gguf file)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _eos_ids(hf: dict[str, Any], generation_config: Path) -> tuple[int, ...]:
    ids = list(_as_ids(hf.get("eos_token_id")))
    if generation_config.is_file():
        try:
            gen = json.loads(generation_config.read_text())
        except json.JSONDecodeError:
            gen = {}
        ids += [i for i in _as_ids(gen.get("eos_token_id")) if i not in ids]
    return tuple(ids)
