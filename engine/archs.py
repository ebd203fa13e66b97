"""The architecture registry: config.json `model_type` -> how that family reads, loads and is built.

Adding an architecture costs one entry here (its config fields, its attention module, the transformers
classes that build random checkpoints of it) plus a model file under `engine/models/` when it needs a
module the stack does not have yet. Torch-free: `moegate plan` reads it without loading a model.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import CheckpointError

Need = Callable[..., Any]  # need("a", "b") -> the first of these config.json keys that is set, else CheckpointError


@dataclass(frozen=True)
class ArchSpec:
    """One architecture family.

    `fields(hf, need)` returns the family's own ModelConfig fields (experts, MLP widths, which layers are
    MoE, attention and router variants); the fields every family shares are read by ModelConfig.from_hf.
    """

    model_type: str
    fields: Callable[[dict[str, Any], Need], dict[str, Any]]
    hf_classes: tuple[str, str]  # transformers (config class, causal LM class)
    attention: str = "engine.models.attention:Attention"  # module:class of the layer's self_attn
    # transformers config kwargs of a random checkpoint from the generic sizes (hidden_size, num_hidden_layers,
    # num_attention_heads, num_key_value_heads, num_experts_per_tok, num_experts, moe_intermediate_size, head_dim)
    random_config: Callable[[dict[str, Any]], dict[str, Any]] = lambda kw: kw
    fp32_params: tuple[str, ...] = ()  # parameter name suffixes loaded in fp32 whatever the model dtype
    # checkpoint name fragment -> the model's (e.g. GPT-OSS's `mlp.router.` is the stack's `mlp.gate.`)
    renames: tuple[tuple[str, str], ...] = ()
    # on-disk fused experts: "rows" (gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I]) or
    # "gpt_oss" (gate_up_proj [E, H, 2I] with gate/up columns interleaved, down_proj [E, I, H], biases alike)
    fused_experts: str = "rows"
    gguf_arch: str = ""  # llama.cpp's general.architecture for this family (engine/gguf_config.py), "" if unread
    linear_attention: str = ""  # module:class of a "linear_attention" layer's `linear_attn` (Qwen3-Next), if any

    def attention_class(self) -> type:
        return _import(self.attention)

    def linear_attention_class(self) -> type:
        return _import(self.linear_attention)


def _import(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class LinearAttentionDims:
    """Qwen3-Next's gated DeltaNet layers: key/value heads and widths, and the causal conv's kernel."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if min(self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim,
               self.conv_kernel) < 1 or self.num_value_heads % self.num_key_heads:
            raise CheckpointError(f"linear attention dims must be positive with linear_num_value_heads a multiple "
                                  f"of linear_num_key_heads: {self}")

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q and k of every key head, v of every value head."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @property
    def state_elements(self) -> int:
        """One sequence's recurrent state in one layer: the conv's last K-1 inputs and the delta-rule state."""
        return self.conv_dim * (self.conv_kernel - 1) + self.num_value_heads * self.key_head_dim * self.value_head_dim


def _sparse_layers(hf: dict[str, Any], layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-style MoE layer selection: mlp_only_layers and decoder_sparse_step."""
    mlp_only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1) or 1
    return tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(layers))


def _no_qwen_sliding(hf: dict[str, Any]) -> None:
    if hf.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window=true is not supported for qwen models")


def _qwen3_moe(hf: dict[str, Any], need: Need) -> dict[str, Any]:
    _no_qwen_sliding(hf)
    experts, moe_inter = need("num_experts", "num_local_experts"), need("moe_intermediate_size")
    return dict(num_experts=experts, moe_intermediate_size=moe_inter,
                dense_intermediate_size=hf.get("intermediate_size", moe_inter),
                moe_layers=_sparse_layers(hf, need("num_hidden_layers"), experts), qk_norm="per_head",
                attention_bias=bool(hf.get("attention_bias", False)),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _qwen2_moe(hf: dict[str, Any], need: Need) -> dict[str, Any]:
    _no_qwen_sliding(hf)
    experts, moe_inter = need("num_experts", "num_local_experts"), need("moe_intermediate_size")
    return dict(num_experts=experts, moe_intermediate_size=moe_inter,
                dense_intermediate_size=hf.get("intermediate_size", moe_inter),
                moe_layers=_sparse_layers(hf, need("num_hidden_layers"), experts),
                attention_bias=bool(hf.get("qkv_bias", True)), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
                shared_expert_gate=True)


def _mixtral(hf: dict[str, Any], need: Need) -> dict[str, Any]:
    experts, inter = need("num_experts", "num_local_experts"), need("intermediate_size")
    return dict(num_experts=experts, moe_intermediate_size=inter, dense_intermediate_size=inter,
                moe_layers=_sparse_layers(hf, need("num_hidden_layers"), experts),
                attention_bias=bool(hf.get("attention_bias", False)), norm_topk_prob=True,
                sliding_window=hf.get("sliding_window"))


def _olmoe(hf: dict[str, Any], need: Need) -> dict[str, Any]:
    experts, inter = need("num_experts", "num_local_experts"), need("intermediate_size")
    return dict(num_experts=experts, moe_intermediate_size=inter, dense_intermediate_size=inter,
                moe_layers=_sparse_layers(hf, need("num_hidden_layers"), experts), qk_norm="full",
                attention_bias=bool(hf.get("attention_bias", False)), clip_qkv=hf.get("clip_qkv"),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _deepseek(hf: dict[str, Any], need: Need, router: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: multi-head latent attention, shared experts, the first k layers dense."""
    experts, moe_inter = need("n_routed_experts", "num_experts", "num_local_experts"), need("moe_intermediate_size")
    first_dense = hf.get("first_k_dense_replace") or 0
    if router == "softmax_grouped" and hf.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
        raise CheckpointError(f"topk_method {hf.get('topk_method')!r} is not supported "
                              "(deepseek_v2: 'greedy' or 'group_limited_greedy')")
    grouped = router == "sigmoid_grouped" or hf.get("topk_method") == "group_limited_greedy"
    n_group = (hf.get("n_group") or 1) if grouped else 1
    return dict(
        attention="mla", num_experts=experts, moe_intermediate_size=moe_inter,
        dense_intermediate_size=need("intermediate_size"),
        moe_layers=tuple(i >= first_dense for i in range(need("num_hidden_layers"))),
        attention_bias=bool(hf.get("attention_bias", False)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) and router == "sigmoid_grouped",
        shared_expert_intermediate_size=moe_inter * (hf.get("n_shared_experts") or 0),
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"), head_dim=need("qk_rope_head_dim"),  # the rotary width, as transformers
        rope_layout="interleaved_cat" if router == "sigmoid_grouped" and hf.get("rope_interleave", True)
        else "rotate_half" if router == "sigmoid_grouped" else "complex_pairs",
        router=router, n_group=n_group, topk_group=(hf.get("topk_group") or n_group) if grouped else 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


def _glm4_moe(hf: dict[str, Any], need: Need) -> dict[str, Any]:
    """GLM-4.5: grouped-query attention (q/k/v biases, optional per-head q/k norms, partial rotary) with
    DeepSeek-V3's sigmoid grouped routing, ungated shared experts and dense first layers."""
    experts, moe_inter = need("n_routed_experts", "num_experts", "num_local_experts"), need("moe_intermediate_size")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    n_group = hf.get("n_group") or 1
    return dict(
        num_experts=experts, moe_intermediate_size=moe_inter, dense_intermediate_size=need("intermediate_size"),
        moe_layers=tuple(i >= (hf.get("first_k_dense_replace") or 0) for i in range(need("num_hidden_layers"))),
        attention_bias=bool(hf.get("attention_bias", False)), qk_norm="per_head" if hf.get("use_qk_norm") else "none",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=moe_inter * (hf.get("n_shared_experts") or 0),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        router="sigmoid_grouped", n_group=n_group, topk_group=hf.get("topk_group") or n_group,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


def _glm4_moe_random(kw: dict[str, Any]) -> dict[str, Any]:
    num_experts = kw.pop("num_experts")
    groups = 2 if num_experts % 2 == 0 and num_experts // 2 >= 2 else 1
    return dict(n_routed_experts=num_experts, n_shared_experts=1, first_k_dense_replace=1,
                intermediate_size=2 * kw["moe_intermediate_size"], n_group=groups, topk_group=groups,
                attention_bias=True, use_qk_norm=True, **kw,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def _gpt_oss(hf: dict[str, Any], need: Need) -> dict[str, Any]:
    """GPT-OSS: alternating sliding / full attention with sinks, biased clamped-SwiGLU experts, a router with
    a bias and a softmax over its top-k logits."""
    experts, inter, layers = need("num_local_experts", "num_experts"), need("intermediate_size"), need("num_hidden_layers")
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return dict(num_experts=experts, moe_intermediate_size=inter, dense_intermediate_size=inter,
                moe_layers=(True,) * layers, attention_bias=bool(hf.get("attention_bias", True)),
                o_proj_bias=bool(hf.get("attention_bias", True)), norm_topk_prob=False,
                sliding_window=hf.get("sliding_window"), layer_types=tuple(layer_types), attention_sinks=True,
                router="topk_softmax", expert_act="swiglu_clamped", expert_bias=True,
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


def _qwen3_next(hf: dict[str, Any], need: Need) -> dict[str, Any]:
    """Qwen3-Next: gated DeltaNet linear-attention layers beside gated full attention (per-head zero-centred q/k
    norms, partial rotary), softmax top-k experts with a sigmoid-gated shared expert."""
    out = _qwen2_moe(hf, need)
    layers = need("num_hidden_layers")
    interval = hf.get("full_attention_interval") or 4
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    out.update(
        attention_bias=bool(hf.get("attention_bias", False)), qk_norm="per_head", layer_types=tuple(layer_types),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        attention_output_gate=True, zero_centred_norm=True,
        linear_attention=LinearAttentionDims(
            need("linear_num_key_heads"), need("linear_num_value_heads"), need("linear_key_head_dim"),
            need("linear_value_head_dim"), need("linear_conv_kernel_dim")))
    return out


def _qwen3_next_random(kw: dict[str, Any]) -> dict[str, Any]:
    """Three linear-attention layers per full-attention one, as the released model; odd DeltaNet widths."""
    head_dim = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    if head_dim % 8:
        raise CheckpointError(f"qwen3_next rotates a quarter of each head: head_dim {head_dim} must be a multiple of 8")
    return _qwen_random(kw, full_attention_interval=min(4, kw["num_hidden_layers"]), shared_expert_intermediate_size=2 * kw["moe_intermediate_size"], norm_topk_prob=True,
                        linear_num_key_heads=max(1, kw["num_key_value_heads"]), linear_key_head_dim=head_dim,
                        linear_num_value_heads=2 * max(1, kw["num_key_value_heads"]), linear_value_head_dim=head_dim,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def _gpt_oss_random(kw: dict[str, Any]) -> dict[str, Any]:
    """A sliding window of 8 tokens (shorter than test prompts), YaRN as the released checkpoints."""
    kw = _expert_width_random(kw, "num_local_experts")
    return {**kw, "sliding_window": 8, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}}


def _qwen_random(kw: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**kw, "intermediate_size": kw["moe_intermediate_size"] * kw["num_experts_per_tok"], **extra}  # dense MLP


def _expert_width_random(kw: dict[str, Any], experts_key: str) -> dict[str, Any]:
    """Mixtral / OLMoE name the expert width intermediate_size."""
    kw = dict(kw)
    kw.update(intermediate_size=kw.pop("moe_intermediate_size"), **{experts_key: kw.pop("num_experts")})
    return kw


def _olmoe_random(kw: dict[str, Any]) -> dict[str, Any]:
    if kw.get("head_dim") not in (None, kw["hidden_size"] // kw["num_attention_heads"]):
        raise CheckpointError("olmoe's q/k norms span hidden_size, so head_dim must be hidden_size // num_heads")
    return _expert_width_random(kw, "num_experts")


def _deepseek_random(kw: dict[str, Any]) -> dict[str, Any]:
    """Small MLA dims from the head size, one dense layer first, two expert groups when they divide."""
    head_dim = kw.pop("head_dim", None) or kw["hidden_size"] // kw["num_attention_heads"]
    num_experts = kw.pop("num_experts")
    out = dict(n_routed_experts=num_experts, kv_lora_rank=2 * head_dim, q_lora_rank=3 * head_dim,
               qk_nope_head_dim=head_dim, qk_rope_head_dim=max(2, head_dim // 2) // 2 * 2, v_head_dim=head_dim,
               n_shared_experts=1, first_k_dense_replace=1, intermediate_size=2 * kw["moe_intermediate_size"],
               num_key_value_heads=kw["num_attention_heads"])
    groups = 2 if num_experts % 2 == 0 and num_experts // 2 >= 2 else 1
    out.update(n_group=groups, topk_group=groups)
    out.update({k: v for k, v in kw.items() if k != "num_key_value_heads"})
    return out


_GROUPED_SIGMOID_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # the router steers in fp32
ARCHS: dict[str, ArchSpec] = {
    "qwen3_moe": ArchSpec(
        "qwen3_moe", _qwen3_moe, ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        random_config=lambda kw: _qwen_random(
            kw, norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
        gguf_arch="qwen3moe",
    ),
    "qwen2_moe": ArchSpec(
        "qwen2_moe", _qwen2_moe, ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        random_config=lambda kw: _qwen_random(kw, shared_expert_intermediate_size=4 * kw["moe_intermediate_size"]),
        gguf_arch="qwen2moe",
    ),
    "mixtral": ArchSpec("mixtral", _mixtral, ("MixtralConfig", "MixtralForCausalLM"),
                        random_config=lambda kw: _expert_width_random(kw, "num_local_experts"), gguf_arch="llama"),
    "olmoe": ArchSpec("olmoe", _olmoe, ("OlmoeConfig", "OlmoeForCausalLM"), random_config=_olmoe_random,
                      gguf_arch="olmoe"),
    "deepseek_v3": ArchSpec(
        "deepseek_v3", lambda hf, need: _deepseek(hf, need, "sigmoid_grouped"),
        ("DeepseekV3Config", "DeepseekV3ForCausalLM"), attention="engine.models.mla:LatentAttention",
        random_config=_deepseek_random, fp32_params=_GROUPED_SIGMOID_FP32, gguf_arch="deepseek2",
    ),
    "deepseek_v2": ArchSpec(
        "deepseek_v2", lambda hf, need: _deepseek(hf, need, "softmax_grouped"),
        ("DeepseekV2Config", "DeepseekV2ForCausalLM"), attention="engine.models.mla:LatentAttention",
        random_config=lambda kw: {**_deepseek_random(kw), "topk_method": "group_limited_greedy"},
        fp32_params=("mlp.gate.weight",), gguf_arch="deepseek2",
    ),
    "glm4_moe": ArchSpec("glm4_moe", _glm4_moe, ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
                         random_config=_glm4_moe_random, fp32_params=_GROUPED_SIGMOID_FP32, gguf_arch="glm4moe"),
    "gpt_oss": ArchSpec(
        "gpt_oss", _gpt_oss, ("GptOssConfig", "GptOssForCausalLM"), attention="engine.models.gpt_oss:SinkAttention",
        random_config=_gpt_oss_random, renames=((".mlp.router.", ".mlp.gate."),), fused_experts="gpt_oss",
        gguf_arch="gpt-oss",
    ),
    "qwen3_next": ArchSpec(
        "qwen3_next", _qwen3_next, ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
        attention="engine.models.qwen3_next:GatedAttention", random_config=_qwen3_next_random,
        linear_attention="engine.models.qwen3_next:GatedDeltaNet", gguf_arch="qwen3next",
    ),
}
ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2 ships DeepSeek-V3's architecture under its own model_type
SUPPORTED_ARCHS = (*ARCHS, *ALIASES)


def arch_spec(model_type: str) -> ArchSpec:
    """The spec of a config.json model_type (aliases resolved); UnsupportedArchitectureError if none."""
    from engine.errors import UnsupportedArchitectureError

    spec = ARCHS.get(ALIASES.get(model_type, model_type))
    if spec is None:
        raise UnsupportedArchitectureError(model_type or "<missing model_type>", SUPPORTED_ARCHS)
    return spec
