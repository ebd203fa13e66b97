"""A GGUF's metadata as a Hugging Face config dict, per llama.cpp architecture.

llama.cpp names an architecture (`general.architecture`) and stores its hyperparameters under that
prefix with the keys convert_hf_to_gguf.py writes (`qwen3moe.block_count`, `deepseek2.attention.kv_lora_rank`,
...). Each family below turns them back into the config.json fields its `engine/archs.py` entry reads, so
`ModelConfig.from_hf` and `moegate plan` see a GGUF as they see the original checkpoint. The families read
are the registry entries that name a `gguf_arch`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.archs import ARCHS as REGISTRY
from engine.errors import CheckpointError, UnsupportedCheckpointError
from engine.gguf_file import open_gguf

_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)


class _Meta:
    """The metadata of one architecture: `need(key)` (a CheckpointError naming a missing key), `get(key, default)`."""

    def __init__(self, path: Path, meta: dict[str, Any], arch: str) -> None:
        self.path, self.meta, self.arch = path, meta, arch

    def need(self, key: str) -> Any:
        if f"{self.arch}.{key}" not in self.meta:
            raise CheckpointError(f"{self.path.name} lacks GGUF metadata {self.arch}.{key}")
        return self.meta[f"{self.arch}.{key}"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)


def text_layers(meta: dict[str, Any], arch: str) -> int:
    """Decoder layers the model runs: block_count less llama.cpp's multi-token-prediction (nextn) blocks."""
    return int(meta.get(f"{arch}.block_count", 0)) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)


def _common(m: _Meta, tensors: dict) -> dict[str, Any]:
    layers, hidden, heads = text_layers(m.meta, m.arch), m.need("embedding_length"), m.need("attention.head_count")
    if layers <= 0:
        m.need("block_count")
    hf: dict[str, Any] = {
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": m.get("attention.head_count_kv", heads),
        "head_dim": m.get("attention.key_length", hidden // heads),
        "rms_norm_eps": m.need("attention.layer_norm_rms_epsilon"), "rope_theta": m.get("rope.freq_base", 10000.0),
        "max_position_embeddings": m.need("context_length"),
        "vocab_size": tensors["token_embd.weight"].shape[0] if "token_embd.weight" in tensors else m.need("vocab_size"),
        "tie_word_embeddings": "output.weight" not in tensors, "num_experts_per_tok": m.need("expert_used_count"),
        "eos_token_id": m.meta.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    rope_type = m.get("rope.scaling.type", "none")
    if rope_type not in ("none", "linear", "yarn"):
        raise UnsupportedCheckpointError(f"GGUF rope scaling {rope_type!r} is not supported")
    if rope_type != "none":
        hf["rope_scaling"] = {"rope_type": rope_type, "factor": m.need("rope.scaling.factor"),
                              "original_max_position_embeddings": m.get("rope.scaling.original_context_length")}
        hf["rope_scaling"].update({k: m.get(f"rope.scaling.yarn_{k}") for k in ("beta_fast", "beta_slow")
                                   if m.get(f"rope.scaling.yarn_{k}") is not None})
    return hf


def _mlp_only(m: _Meta, tensors: dict) -> list[int]:
    return [i for i in range(text_layers(m.meta, m.arch)) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]


def _qwen(m: _Meta, tensors: dict, model_type: str) -> dict[str, Any]:
    hf = _common(m, tensors)
    expert_ffn = m.get("expert_feed_forward_length")
    hf.update(model_type=model_type, num_experts=m.need("expert_count"), mlp_only_layers=_mlp_only(m, tensors),
              moe_intermediate_size=expert_ffn or m.need("feed_forward_length"),
              intermediate_size=m.get("feed_forward_length", expert_ffn), qkv_bias=hf["attention_bias"],
              shared_expert_intermediate_size=m.get("expert_shared_feed_forward_length", 0),
              norm_topk_prob=bool(m.get("expert_weights_norm", model_type == "qwen3_moe")))
    return hf


def _llama(m: _Meta, tensors: dict) -> dict[str, Any]:
    if not m.get("expert_count"):
        raise UnsupportedCheckpointError("GGUF architecture 'llama' without experts is not supported (moegate "
                                         "reads llama with experts: Mixtral)")
    return {**_common(m, tensors), "model_type": "mixtral", "num_local_experts": m.need("expert_count"),
            "intermediate_size": m.need("feed_forward_length"), "mlp_only_layers": _mlp_only(m, tensors)}


def _olmoe(m: _Meta, tensors: dict) -> dict[str, Any]:
    return {**_common(m, tensors), "model_type": "olmoe", "num_experts": m.need("expert_count"),
            "intermediate_size": m.get("expert_feed_forward_length") or m.need("feed_forward_length"),
            "norm_topk_prob": bool(m.get("expert_weights_norm", False)), "clip_qkv": m.get("attention.clamp_kqv"),
            "mlp_only_layers": _mlp_only(m, tensors)}


def _routed(m: _Meta) -> dict[str, Any]:
    """DeepSeek-style routed and shared experts, dense first layers, grouped routing (glm4moe, deepseek2)."""
    n_group = m.get("expert_group_count", 1) or 1
    return dict(n_routed_experts=m.need("expert_count"), n_shared_experts=m.get("expert_shared_count", 0),
                moe_intermediate_size=m.need("expert_feed_forward_length"),
                intermediate_size=m.need("feed_forward_length"),
                first_k_dense_replace=m.get("leading_dense_block_count", 0),
                routed_scaling_factor=m.get("expert_weights_scale", 1.0), n_group=n_group,
                topk_group=m.get("expert_group_used_count", n_group) or n_group)


def _glm4moe(m: _Meta, tensors: dict) -> dict[str, Any]:
    hf = {**_common(m, tensors), **_routed(m), "model_type": "glm4_moe"}
    rotary = m.get("rope.dimension_count", hf["head_dim"])
    hf.update(use_qk_norm="blk.0.attn_q_norm.weight" in tensors, partial_rotary_factor=rotary / hf["head_dim"],
              norm_topk_prob=bool(m.get("expert_weights_norm", True)))
    return hf


def _deepseek2(m: _Meta, tensors: dict) -> dict[str, Any]:
    """DeepSeek-V2/V3 (and Kimi-K2): sigmoid gating and exp_probs_b make V3. Newer files store MLA as MQA
    (head_count_kv 1, key_length kv_lora_rank + rope) with the per-head sizes in key/value_length_mla."""
    hf = {**_common(m, tensors), **_routed(m)}
    v3 = m.get("expert_gating_func") == _SIGMOID
    rope = m.need("rope.dimension_count")
    qk = m.get("attention.key_length_mla") or m.need("attention.key_length")
    hf.update(model_type="deepseek_v3" if v3 else "deepseek_v2", num_key_value_heads=hf["num_attention_heads"],
              q_lora_rank=m.get("attention.q_lora_rank"), kv_lora_rank=m.need("attention.kv_lora_rank"),
              qk_rope_head_dim=rope, qk_nope_head_dim=qk - rope, head_dim=rope,
              v_head_dim=m.get("attention.value_length_mla") or m.need("attention.value_length"),
              norm_topk_prob=bool(m.get("expert_weights_norm", False)), rope_interleave=True,
              topk_method="noaux_tc" if v3 else "group_limited_greedy" if hf["n_group"] > 1 else "greedy")
    if "rope_scaling" in hf and hf["rope_scaling"]["rope_type"] == "yarn":
        # llama.cpp keeps DeepSeek's YaRN mscale as yarn_log_multiplier = 0.1 * mscale_all_dim (mscale equal)
        mscale = round(float(m.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)  # stored as f32
        hf["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)
    return hf


def _one(m: _Meta, key: str, default: float) -> float:
    """A value llama.cpp may store per layer: one for all layers, else UnsupportedCheckpointError."""
    value = m.get(key, default)
    values = set(value) if isinstance(value, list) else {value}
    if len(values) != 1:
        raise UnsupportedCheckpointError(f"GGUF {m.arch}.{key} differs between layers ({sorted(values)}): not supported")
    return float(values.pop())


def _gpt_oss(m: _Meta, tensors: dict) -> dict[str, Any]:
    """GPT-OSS: llama.cpp alternates sliding (even layers) and full attention and fixes the SwiGLU clamp at 7;
    its YaRN is transformers' with beta 32/1 and no truncation."""
    hf = _common(m, tensors)
    layers = hf["num_hidden_layers"]
    hf.update(model_type="gpt_oss", num_local_experts=m.need("expert_count"),
              intermediate_size=m.get("expert_feed_forward_length") or m.need("feed_forward_length"),
              sliding_window=m.need("attention.sliding_window"),
              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
              swiglu_limit=_one(m, "swiglu_clamp_exp", 7.0))
    if "rope_scaling" in hf:
        hf["rope_scaling"].update(beta_fast=32.0, beta_slow=1.0, truncate=False)
    return hf


def _qwen3next(m: _Meta, tensors: dict) -> dict[str, Any]:
    """Qwen3-Next: Qwen2-MoE's keys plus the DeltaNet widths under `ssm.*` (group_count key heads of state_size,
    time_step_rank value heads of inner_size / time_step_rank), which layers are recurrent (llama.cpp's
    `attention.recurrent_layers`, else every `full_attention_interval`-th layer is full attention) and the
    rotary share of each head (`rope.dimension_count`)."""
    hf = _qwen(m, tensors, "qwen3_next")
    layers, value_heads = hf["num_hidden_layers"], m.need("ssm.time_step_rank")
    recurrent = m.get("attention.recurrent_layers")
    if recurrent is None:
        interval = int(m.get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    hf.update(linear_num_key_heads=m.need("ssm.group_count"), linear_key_head_dim=m.need("ssm.state_size"),
              linear_num_value_heads=value_heads, linear_value_head_dim=m.need("ssm.inner_size") // value_heads,
              linear_conv_kernel_dim=m.need("ssm.conv_kernel"),
              layer_types=["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]],
              partial_rotary_factor=m.get("rope.dimension_count", hf["head_dim"]) / hf["head_dim"])
    return hf


FAMILIES: dict[str, Callable[[_Meta, dict], dict[str, Any]]] = {
    "qwen3moe": lambda m, t: _qwen(m, t, "qwen3_moe"), "qwen2moe": lambda m, t: _qwen(m, t, "qwen2_moe"),
    "llama": _llama, "olmoe": _olmoe, "glm4moe": _glm4moe, "deepseek2": _deepseek2,
    "gpt-oss": _gpt_oss, "qwen3next": _qwen3next,
}
assert set(FAMILIES) == {s.gguf_arch for s in REGISTRY.values() if s.gguf_arch}, "one family per registry gguf_arch"


def hf_config(path: Path) -> dict[str, Any]:
    """A Hugging Face style config dict from the GGUF metadata and tensor list (for ModelConfig.from_hf)."""
    file = open_gguf(path)
    arch = file.meta.get("general.architecture")
    if arch not in FAMILIES:
        raise UnsupportedCheckpointError(f"GGUF architecture {arch!r} is not supported (moegate reads "
                                         f"{', '.join(FAMILIES)}; llama with experts)")
    return FAMILIES[arch](_Meta(path, file.meta, arch), file.tensors)
